"""The ledger's rules for an epoch's recovered batches: held until every rank said what it used, then matched.

A batch of a partition recovered from a lost broker (or of an epoch resumed from a checkpoint, every partition) is
**held** until every member of the stream (ranks connected and lost ranks waiting to rejoin, at least
``expected_ranks`` of them) has sent its ``RECLAIM`` for every loss the epoch waits for (``broker.recovery`` keeps
them). Then it is **matched**: what a rank used is counted consumed and never sent (``adopted``), the rest is
queued, a pack cut where it has to be (``broker.pieces``). Of a batch a rank used rows of only (``cuts``: its piece
of an epoch's remainder), those rows are adopted and the others queued as row pieces. What a rank used counts as
its own for grants from its RECLAIM on (:meth:`Matching.pending`).

These are the epoch's recovery rules (its state is ``state.EpochRecovery``): partitions call :meth:`Matching.take`
for a recovered partition's batch, grants :meth:`Matching.pending`, the ledger :meth:`Matching.release_ready` before
a dispatch.
"""

from __future__ import annotations

import logging
import time
from itertools import groupby

from sparkbus.broker.books import Books
from sparkbus.broker.events import BatchesAcked
from sparkbus.broker.pieces import RowRange, batch_rows, cut, cut_rows, singles
from sparkbus.broker.state import EpochState, HeldBatch, RankState, Reclaimed, StreamState, Used
from sparkbus.wire.protocol import RESUME_LOSS

log = logging.getLogger("sparkbus.broker")

RESUME = RESUME_LOSS            # the loss a resume from a checkpoint is named by (one definition: wire.protocol)
CHECKPOINT = "<checkpoint>"     # who used what a resume's RECLAIMs name: the checkpointed model, no rank of now


class Matching:
    """Hold and match the batches of recovered partitions against the ranks' RECLAIMs.

    Args:
        books: the ledger's state.
    """

    def __init__(self, books: Books):
        self.books = books

    def may_release(self, stream: StreamState, ep: EpochState) -> bool:
        """Whether every member of the stream, and at least ``expected_ranks`` (one at least), said what it used of
        each loss ``ep`` waits for."""
        rec = ep.recovery
        if rec is None:
            return True
        members = stream.members()
        if len(members) < max(stream.expected_ranks, 1):
            return False
        if stream.expected_ranks <= 1 and time.monotonic() < self.books.started + self.books.rejoin_grace:
            # Independent consumers (each rank 0 of 1) cannot say how many they are: after this broker (re)started,
            # one that has not reconnected yet may have used batches of the lost incarnation.
            return False
        reclaimed = stream.reclaims.get(ep.epoch, {})
        return all(m.member in reclaimed.get(loss, ()) for loss in rec.lost for m in members)

    # ---- hold and match -------------------------------------------------------------------------------------

    def take(self, stream: StreamState, ep: EpochState, batch: HeldBatch) -> None:
        """A batch of a recovered partition, first copy (or at its commit, atomic): counted in (the driver's report
        counts what the broker took), then held, or matched now."""
        rec = ep.recovery
        assert rec is not None
        ep.count_in(batch)
        if not self.may_release(stream, ep):
            rec.held.append(batch)
            return
        self.release(stream, ep)
        self._match(stream, ep, batch)

    def release_ready(self, stream: StreamState) -> None:
        """Before a dispatch: match the held batches of every epoch whose ranks have all said what they used."""
        for ep in stream.epochs.values():
            if ep.recovery is not None and ep.recovery.held and self.may_release(stream, ep):
                self.release(stream, ep)

    def release(self, stream: StreamState, ep: EpochState) -> None:
        rec = ep.recovery
        if rec is None or not rec.held:
            return
        held, rec.held = rec.held, []
        log.info("stream %r epoch %d: every rank said what it used; %d held batches are matched", stream.name,
                 ep.epoch, len(held))
        for batch in held:
            self._match(stream, ep, batch)

    def _index(self, stream: StreamState, ep: EpochState) -> dict[tuple[int, int], list[Used]]:
        """The union of the ranks' reclaimed entries of ``ep``, every loss, by ``(part, seq)``."""
        rec = ep.recovery
        assert rec is not None
        if rec.index is None:
            index: dict[tuple[int, int], list[Used]] = {}
            losses = stream.reclaims.get(ep.epoch, {})
            # a checkpoint's first: what the resumed model had used is the group's, whichever rank names it (a
            # resume on another number of ranks names the old group's batches on every new rank)
            for loss in sorted(losses, key=lambda loss: loss != RESUME):
                for member, reclaimed in losses[loss].items():
                    if loss == RESUME:
                        member, reclaimed = CHECKPOINT, Reclaimed(-1, reclaimed.entries, reclaimed.cuts)
                    for part, seq, first, stop, checksum in reclaimed.entries:
                        index.setdefault((part, seq), []).append(Used(first, stop, checksum, member, reclaimed.rank,
                                                                      None))
                    for part, seq, at, lo, hi, checksum in reclaimed.cuts:
                        index.setdefault((part, seq), []).append(Used(at, at + 1, checksum, member, reclaimed.rank,
                                                                      (lo, hi)))
            rec.index = index
        return rec.index

    # ---- grants: what a rank used counts from its RECLAIM on, not from its match ------------------------------

    def pending(self, stream: StreamState, ep: EpochState) -> list[tuple[RankState, int]]:
        """Per rank, the batches of recovered partitions it said it used that are not matched yet.

        They count as the rank's (for grants, and in ``STEPS.adopted``) from its RECLAIM on: counted only once
        matched, a rank would take steps on a grant that did not know them yet, and end the epoch with more steps
        than the others once Spark's recomputation reached them. What a checkpoint had used (a resume's RECLAIM)
        counts for no rank: the resumed group's steps are those it takes from the resume on, shared out evenly
        whatever the size of the group that took the checkpoint."""
        rec = ep.recovery
        if rec is None:
            return []
        if rec.expected is None:
            named: dict[str, tuple[int, set[tuple[int, ...]]]] = {}
            losses = stream.reclaims.get(ep.epoch, {})
            checkpoint: set[tuple[int, ...]] = set()
            for reclaimed in losses.get(RESUME, {}).values():
                checkpoint.update((part, seq, first, stop) for part, seq, first, stop, _ in reclaimed.entries)
                checkpoint.update((part, seq, at, at + 1, lo, hi) for part, seq, at, lo, hi, _ in reclaimed.cuts)
            for loss, members in losses.items():       # as the index: every loss, each entry once
                if loss == RESUME:
                    continue
                for member, reclaimed in members.items():
                    entries = named.setdefault(member, (reclaimed.rank, set()))[1]
                    entries.update((part, seq, first, stop) for part, seq, first, stop, _ in reclaimed.entries
                                   if part in rec.recovered)
                    entries.update((part, seq, at, at + 1, lo, hi) for part, seq, at, lo, hi, _ in reclaimed.cuts
                                   if part in rec.recovered)      # a cut is one step of its rank's
            rec.expected = {member: (number, sum(e[3] - e[2] for e in entries - checkpoint))
                            for member, (number, entries) in named.items()}
        pending = []
        for member, (number, count) in rec.expected.items():
            left = count - rec.matched.get(member, 0)
            rank = self.rank_of(stream, member, number) if left > 0 else None
            if rank is not None:
                pending.append((rank, left))
        return pending

    def _match(self, stream: StreamState, ep: EpochState, batch: HeldBatch) -> None:
        """Queue what no rank used of ``batch`` (counted in already); count what a rank used as consumed by it,
        never sent."""
        _, number, seq = batch.id
        used = self._index(stream, ep).get((number, seq))
        if not used:
            ep.queue.append(batch)
            return
        part = ep.part(number)
        if not part.diverged and any(u.checksum != part.checksums.get(seq) for u in used):
            part.diverged = True
            log.warning("stream %r epoch %d partition %d: Spark recomputed it differently from the copy a rank used "
                        "(batch %d's checksum differs): the rank's copy stands, rows of this partition may be missing "
                        "or repeated", stream.name, ep.epoch, number, seq)
        owners: list[tuple[str, int] | None] = [None] * batch.count
        for first, stop, _, member, rank, rows in used:
            if rows is not None and (batch.cut is not None or rows != (0, batch.rows) or batch.count > 1):
                continue                       # rows of one batch: matched below
            for i in range(max(first, batch.first), min(stop, batch.first + batch.count)):
                if owners[i - batch.first] is None:
                    owners[i - batch.first] = (member, rank)
        pieces: list[tuple[HeldBatch, tuple[str, int] | None]] = []
        rest, at = batch, batch.first
        runs = [(owner, len(list(run))) for owner, run in groupby(owners)]
        for owner, length in runs[:-1]:
            at += length
            piece, rest = cut(rest, at)
            pieces.append((piece, owner))
        pieces.append((rest, runs[-1][0]))
        cuts = [u for u in used if u.rows is not None]
        for piece, owner in pieces:
            if owner is not None:
                self._adopt(stream, ep, piece, *owner)
            elif not cuts:
                ep.queue.append(piece)
            else:
                for single in singles(piece):
                    self._match_rows(stream, ep, single, [u for u in cuts if u.first == single.first])

    def _match_rows(self, stream: StreamState, ep: EpochState, single: HeldBatch, cuts: list[Used]) -> None:
        """Of one batch no rank used whole: the rows each rank used (its cut) adopted by it, one piece a cut (the
        rows an earlier cut had left out of it), the rows nobody used queued as pieces."""
        if not cuts:
            ep.queue.append(single)
            return
        base, top = batch_rows(single)
        plan: list[RowRange] = []
        owners: list[tuple[str, int] | None] = []
        at = base
        for _, _, _, member, rank, rows in sorted(cuts, key=lambda u: u.rows or (0, 0)):
            assert rows is not None
            lo, hi = max(rows[0], at, base), max(min(rows[1], top), at, base)
            if lo > at:
                plan.append(RowRange(at - base, lo - base))
                owners.append(None)
            plan.append(RowRange(lo - base, hi - base))
            owners.append((member, rank))
            at = max(at, hi)
        if at < top:
            plan.append(RowRange(at - base, top - base))
            owners.append(None)
        for piece, owner in zip(cut_rows(single, plan), owners):
            if owner is None:
                ep.queue.append(piece)
            else:
                self._adopt(stream, ep, piece, *owner)

    def _adopt(self, stream: StreamState, ep: EpochState, piece: HeldBatch, member: str, number: int) -> None:
        """``piece`` was used by the rank ``member`` (rank ``number``) before the loss: consumed by it; or
        (``member`` :data:`CHECKPOINT`) by the model a resume's checkpoint saved: consumed, counted for no rank."""
        ep.adopt(piece)
        self.books.free(piece.nbytes)
        if member == CHECKPOINT:
            if piece.settle() and self.books.observers:
                self.books.emit(BatchesAcked(stream.name, ep.epoch, [list(piece.id)]))
            return
        assert ep.recovery is not None
        ep.recovery.matched[member] = ep.recovery.matched.get(member, 0) + piece.count
        rank = self.rank_of(stream, member, number)
        if rank is not None:
            epoch = ep.epoch
            rank.acked += piece.count
            rank.given[epoch] = rank.given.get(epoch, 0) + piece.count
            rank.adopted[epoch] = rank.adopted.get(epoch, 0) + piece.count
        if piece.settle() and self.books.observers:
            self.books.emit(BatchesAcked(stream.name, ep.epoch, [list(piece.id)]))

    def rank_of(self, stream: StreamState, member: str, number: int) -> RankState | None:
        """The rank whose reclaim it was: its connection, its lost connection waiting, else (a group) the rank
        number's connection now."""
        for rank in stream.ranks.values():
            if rank.member == member:
                return rank
        orphan = stream.orphans.get(member)
        if orphan is not None:
            return orphan.rank
        if stream.expected_ranks > 1:
            return next((r for r in stream.ranks.values() if r.rank == number), None)
        return None
