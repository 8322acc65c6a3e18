"""The ledger's rules for an epoch streamed again from Spark's lineage: a lost broker's partitions taken over, or an
epoch resumed from a checkpoint (docs/design/RECOVERY.md, "The broker").

- ``EPOCH_RECOVER`` says which partitions this broker now ``carries`` and which of them it ``recovered`` (a lost
  broker's, or all of them for a resume). Batches of other partitions are dropped (``unassigned``); claims are
  refused.
- ``RECLAIM`` says, per rank and per loss, which batches of the epoch the rank used. They are kept per stream,
  bounded, whether or not the epoch is recovering yet.
- A batch of a recovered partition is **held** until every member of the stream (ranks connected and lost ranks
  waiting to rejoin, at least ``expected_ranks`` of them) has sent its ``RECLAIM`` for every loss waited for;
  ``LOST`` asks those that have not. Then it is **matched**: what a rank used is counted consumed and never sent
  (``adopted``), the rest is queued, a pack cut where it has to be (``broker.pieces``). Of a batch a rank used
  rows of only (``cuts``: its piece of an epoch's remainder), those rows are adopted and the others queued as
  row pieces.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from itertools import groupby
from typing import Any

from sparkbus.broker.books import MAX_STREAM_NAME, Outcome, Transmit
from sparkbus.broker.dispatch import Dispatch
from sparkbus.broker.events import BatchesAcked, EpochOpened
from sparkbus.broker.journal import DeliveredEpochs, EpochRanges
from sparkbus.broker.partitions import MAX_PARTITIONS, Partitions, check_modes
from sparkbus.broker.pieces import batch_rows, cut, cut_rows, singles
from sparkbus.broker.rejoin import MissedEnd
from sparkbus.broker.state import BatchId, EpochRecovery, EpochState, HeldBatch, RankState, Reclaimed, StreamState
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import RESUME_LOSS, Kind, PartitionRanges

log = logging.getLogger("sparkbus.broker")

MAX_RECLAIM_EPOCHS = 4          # epochs per stream whose RECLAIMs are kept (the open one, a resume's, a few late)
MAX_RECLAIM_ENTRIES = 1 << 21   # used-batch entries per stream kept (about 200 MB at the very most)
MAX_RECLAIM_RECORDS = 16_384    # RECLAIMs kept per stream, one per (epoch, loss, rank session): ranks x losses
MAX_INCARNATION = 64            # characters of a loss's name (a broker's incarnation: 16 hex digits; "" a resume)
MAX_LOSSES = 32                 # losses one epoch waits for, or keeps RECLAIMs of: a few brokers lost, a resume
MAX_RECOVERY_RANGES = 1 << 16   # ranges of partitions an epoch's recovery carries (each EPOCH_RECOVER adds some)
RESUME = RESUME_LOSS            # the loss a resume from a checkpoint is named by (one definition: wire.protocol)
CHECKPOINT = "<checkpoint>"     # who used what a resume's RECLAIMs name: the checkpointed model, no rank of now

# (first, stop, checksum, member, rank number, rows) of one message's batches; rows: (lo, hi) of batch ``first``
# only (a cut), or None: all of them
Used = tuple[int, int, int, str, int, "tuple[int, int] | None"]


class Recovery(Partitions, Dispatch):
    """EPOCH_RECOVER, RECLAIM, LOST and EPOCH_QUERY: the broker's side of recovery from lineage and exact resume."""

    # ---- EPOCH_RECOVER ------------------------------------------------------------------------------------

    def recover_epoch(self, h: dict) -> None:
        """EPOCH_RECOVER: stream ``carries`` of the epoch from now on; hold and match the batches of ``recovered``
        against the ranks' RECLAIMs for every loss in ``lost``. Opens the epoch if this broker does not know it;
        ``reset`` drops what it had of it first, delivered or not (a resume). Several add up.

        Raises:
            ProtocolError: numbers out of range, bad ranges, ``recovered`` not within ``carries``, another delivery,
                or partitions to recover of an epoch whose end already went out here (without ``reset``).
        """
        name, number, partitions, delivery = h["stream"], h["epoch"], h["partitions"], h["delivery"]
        commit = h.get("commit", "end")
        if not 0 <= partitions <= MAX_PARTITIONS or number < 0:
            raise ProtocolError(f"epoch {number} with {partitions} partitions is out of range")
        check_modes(delivery, commit)
        lost = h["lost"]
        if len(lost) > MAX_LOSSES or not all(type(loss) is str and len(loss) <= MAX_INCARNATION for loss in lost):
            raise ProtocolError(f"EPOCH_RECOVER's lost must be a list of at most {MAX_LOSSES} incarnations, strings "
                                f"of at most {MAX_INCARNATION} characters")
        stream = self.stream(name)
        ep = stream.epochs.get(number)
        limit = ep.partitions if ep is not None and not h["reset"] else partitions
        carries = PartitionRanges(protocol.range_pairs(h["carries"], limit))
        recovered = carries if h["reset"] else PartitionRanges(protocol.range_pairs(h["recovered"], limit))
        if not recovered <= carries:
            raise ProtocolError("EPOCH_RECOVER's recovered partitions must be among those it carries")
        self._check_recovery_bounds(stream, number, h["reset"], lost, carries, recovered)
        if h["reset"]:
            self._rewind(stream, number)
            lost = [RESUME, *(loss for loss in lost if loss != RESUME)]
            ep = None
            if stream.awaiting_reset == number:
                stream.awaiting_reset = None
        if ep is not None and ep.delivery != delivery:
            raise ProtocolError(f"stream {name!r} epoch {number} is open with {ep.delivery} delivery")
        if number in stream.finished or (ep is not None and ep.end_sent):
            if len(recovered) > recovered.count_in(ep.committed if ep is not None else ()):
                raise ProtocolError(f"stream {name!r} has already delivered epoch {number} here: its partitions "
                                    f"can be recovered only with reset (a resume), or at another broker")
            return                        # nothing new for this broker: it carries what it had
        if ep is None:
            self._open(EpochOpened(name, number, partitions, delivery, commit))
            ep = stream.epochs[number]
        rec = ep.recovery
        if rec is None:
            rec = ep.recovery = EpochRecovery(carries, recovered, [], reset=h["reset"])
        else:
            rec.carries |= carries
            rec.recovered |= recovered
            rec.index = rec.expected = None
        rec.lost.extend(loss for loss in dict.fromkeys(lost) if loss not in rec.lost)
        if ep.closed:
            ep.closed = False             # more partitions come: the driver closes it again
        log.info("stream %r epoch %d recovering: %d partitions carried, %d recovered, losses %s%s", name, number,
                 len(rec.carries), len(rec.recovered), ", ".join(repr(loss) for loss in rec.lost),
                 " (reset)" if h["reset"] else "")

    def _check_recovery_bounds(self, stream: StreamState, number: int, reset: bool, lost: list[str],
                               carries: PartitionRanges, recovered: PartitionRanges) -> None:
        """Refuse (:class:`ProtocolError`), before anything changes, an EPOCH_RECOVER that would make the epoch wait
        for more than :data:`MAX_LOSSES` losses, carry more than :data:`MAX_RECOVERY_RANGES` ranges of partitions,
        or open an epoch beyond :data:`~broker.partitions.MAX_OPEN_EPOCHS`."""
        ep = None if reset else stream.epochs.get(number)
        rec = ep.recovery if ep is not None else None
        losses = dict.fromkeys([*(rec.lost if rec is not None else ()), *([RESUME] if reset else ()), *lost])
        if len(losses) > MAX_LOSSES:
            raise ProtocolError(f"stream {stream.name!r} epoch {number} would wait for {len(losses)} losses, more "
                                f"than the {MAX_LOSSES} an epoch's recovery may: feed the epoch again instead")
        if rec is not None:
            ranges = max(len((rec.carries | carries).pairs()), len((rec.recovered | recovered).pairs()))
            if ranges > MAX_RECOVERY_RANGES:
                raise ProtocolError(f"stream {stream.name!r} epoch {number}: its recovery would carry {ranges} "
                                    f"ranges of partitions, more than {MAX_RECOVERY_RANGES}: feed the epoch again "
                                    f"instead")
        freed = reset and any(n >= number for n in stream.epochs)      # the rewind forgets them first
        if number not in stream.epochs and not freed and (reset or number not in stream.finished):
            self.check_room_for_epoch(stream, number)

    def _rewind(self, stream: StreamState, number: int) -> None:
        """A resume at epoch ``number``: forget it and every later epoch (:meth:`_reset`). The checkpointed model has
        seen none of the later ones, which the run that died may have been given (the feed runs ahead): left here,
        the rest of them would go to the resumed ranks before the driver's resets of them come."""
        for later in sorted(n for n in stream.epochs if n > number):
            self._reset(stream, later)
        finished = stream.finished
        for later in [n for n in dict.keys(finished) if n > number]:
            dict.pop(finished, later)
        if isinstance(finished, DeliveredEpochs):
            finished.ranges = _before(finished.ranges, number + 1)
        self._reset(stream, number)

    def _reset(self, stream: StreamState, number: int) -> None:
        """Forget everything of epoch ``number``: its queue and held batches, the ranks' (and lost ranks') batches
        and counts of it (a lost rank left with none is not waited for), its delivered record, and the reclaims of
        any loss but a resume's."""
        ep = stream.epochs.pop(number, None)
        if ep is not None:
            self._drop(ep.queue)
            for part in ep.parts.values():
                for batches in part.held.values():
                    self._drop(batches, held=True)
            if ep.recovery is not None:
                self._drop(ep.recovery.held)
        for rank in self._members(stream):
            for batch_id, batch in list(rank.inflight.items()):
                if batch_id[0] == number:
                    del rank.inflight[batch_id]
                    rank.inflight_bytes -= batch.nbytes
                    self.buffered -= batch.nbytes
            for counts in (rank.given, rank.told, rank.adopted, rank.told_adopted):
                counts.pop(number, None)
        for session, orphan in list(stream.orphans.items()):
            if not orphan.rank.inflight:       # it waited for batches of this epoch only: nothing to wait for
                del stream.orphans[session]
        finished = stream.finished
        if number in finished:
            if dict.__contains__(finished, number):
                dict.pop(finished, number)
            if isinstance(finished, DeliveredEpochs) and number in finished.ranges:
                finished.ranges = _without(finished.ranges, number)
            log.info("stream %r epoch %d: its delivery is forgotten, it is fed again (a resume)", stream.name, number)
        for loss in [loss for loss in stream.reclaims.get(number, {}) if loss != RESUME]:
            del stream.reclaims[number][loss]

    # ---- RECLAIM and LOST -----------------------------------------------------------------------------------

    def reclaim(self, rank: RankState, h: dict, entries: list[protocol.UsedEntry],
                cuts: Iterable[tuple[int, int, int, int, int, int]] = ()) -> None:
        """RECLAIM: what ``rank`` used of ``h["epoch"]`` of the broker ``h["lost"]`` lost (all its lost entries of
        the epoch: it sends them whole each time), and the rows it used of batches it used part of (``cuts``).
        Kept until the epoch retires, bounded per stream."""
        stream = self.streams[rank.stream]
        if h["stream"] != stream.name:
            raise ProtocolError(f"rank {rank.rank} reads stream {stream.name!r}, not {h['stream']!r}")
        number, loss = h["epoch"], h["lost"]
        if number < 0:
            raise ProtocolError(f"epoch {number} is out of range")
        if len(loss) > MAX_INCARNATION:
            raise ProtocolError(f"a RECLAIM's lost names a broker's incarnation: at most {MAX_INCARNATION} "
                                f"characters, got {len(loss)}")
        losses = stream.reclaims.get(number, {})
        if loss not in losses and len(losses) >= MAX_LOSSES:
            raise ProtocolError(f"stream {stream.name!r} epoch {number} has the ranks' RECLAIMs of {len(losses)} "
                                f"losses already, the most the broker keeps ({MAX_LOSSES}): this one is refused")
        members = stream.reclaims.setdefault(number, {}).setdefault(loss, {})
        members[rank.member] = Reclaimed(rank.rank, entries, tuple(cuts))
        ep = stream.epochs.get(number)
        if ep is not None and ep.recovery is not None:
            ep.recovery.index = ep.recovery.expected = None
        if h["lost"] == RESUME and (ep is None or ep.recovery is None or not ep.recovery.reset):
            # A rank resumes from a checkpoint: the old job's rest of this epoch (or its later epochs) must not
            # reach it. Nothing from this epoch on goes out until the driver's EPOCH_RECOVER(reset) comes.
            if stream.awaiting_reset is None or number < stream.awaiting_reset:
                stream.awaiting_reset = number
                log.info("stream %r: rank %d resumes epoch %d; its delivery waits for the epoch's reset",
                         stream.name, rank.rank, number)
        self._bound_reclaims(stream)

    def _bound_reclaims(self, stream: StreamState) -> None:
        """At most :data:`MAX_RECLAIM_EPOCHS` epochs, :data:`MAX_RECLAIM_RECORDS` RECLAIMs and
        :data:`MAX_RECLAIM_ENTRIES` entries per stream: the oldest epoch not recovering goes first."""
        reclaims = stream.reclaims

        def entries() -> int:
            return sum(len(r.entries) + len(r.cuts) for losses in reclaims.values() for ms in losses.values()
                       for r in ms.values())

        def records() -> int:
            return sum(len(ms) for losses in reclaims.values() for ms in losses.values())

        while len(reclaims) > MAX_RECLAIM_EPOCHS or (len(reclaims) > 0 and (
                records() > MAX_RECLAIM_RECORDS or entries() > MAX_RECLAIM_ENTRIES)):
            def recovering(n: int) -> bool:
                ep = stream.epochs.get(n)
                return ep is not None and ep.recovery is not None
            oldest = min(reclaims, key=lambda n: (recovering(n), n))
            del reclaims[oldest]
            log.warning("stream %r: the ranks' reclaims of epoch %d are dropped (at most %d epochs, %d reclaims and "
                        "%d entries are kept per stream)", stream.name, oldest, MAX_RECLAIM_EPOCHS,
                        MAX_RECLAIM_RECORDS, MAX_RECLAIM_ENTRIES)

    def send_lost(self, stream: StreamState, transmit: Transmit, only: bytes | None = None) -> None:
        """``LOST`` to each rank of ``stream`` (or only to ``only``) that has not sent its RECLAIM for a loss a
        recovering epoch waits for."""
        gone = []
        for ep in stream.epochs.values():
            rec = ep.recovery
            if rec is None or ep.end_sent:
                continue
            reclaimed = stream.reclaims.get(ep.epoch, {})
            for rank in stream.ranks.values():
                if only is not None and rank.identity != only:
                    continue
                for loss in rec.lost:
                    if rank.member in reclaimed.get(loss, {}):
                        continue
                    header = protocol.pack_header(Kind.LOST, stream=stream.name, epoch=ep.epoch, lost=loss)
                    if transmit(rank.identity, [header]) is Outcome.GONE:
                        gone.append(rank.identity)
                        break
        for identity in dict.fromkeys(gone):
            self.rank_gone(identity, "disconnected")

    def _members(self, stream: StreamState) -> list[RankState]:
        return [*stream.ranks.values(), *(o.rank for o in stream.orphans.values())]

    def may_release(self, stream: StreamState, ep: EpochState) -> bool:
        """Whether every member of the stream, and at least ``expected_ranks`` (one at least), said what it used of
        each loss ``ep`` waits for."""
        rec = ep.recovery
        if rec is None:
            return True
        members = self._members(stream)
        if len(members) < max(stream.expected_ranks, 1):
            return False
        if stream.expected_ranks <= 1 and time.monotonic() < self.started + self.rejoin_grace:
            # Independent consumers (each rank 0 of 1) cannot say how many they are: after this broker (re)started,
            # one that has not reconnected yet may have used batches of the lost incarnation.
            return False
        reclaimed = stream.reclaims.get(ep.epoch, {})
        return all(m.member in reclaimed.get(loss, ()) for loss in rec.lost for m in members)

    # ---- hold and match -------------------------------------------------------------------------------------

    def _take_recovered(self, stream: StreamState, ep: EpochState, batch: HeldBatch) -> None:
        """A batch of a recovered partition, first copy (or at its commit, atomic): counted in (the driver's report
        counts what the broker took), then held, or matched now."""
        rec = ep.recovery
        assert rec is not None
        ep.count_in(batch)
        if not self.may_release(stream, ep):
            rec.held.append(batch)
            return
        self._release(stream, ep)
        self._match(stream, ep, batch)

    def _release(self, stream: StreamState, ep: EpochState) -> None:
        rec = ep.recovery
        if rec is None or not rec.held:
            return
        held, rec.held = rec.held, []
        log.info("stream %r epoch %d: every rank said what it used; %d held batches are matched", stream.name,
                 ep.epoch, len(held))
        for batch in held:
            self._match(stream, ep, batch)

    def dispatch(self, stream: StreamState, transmit: Transmit) -> None:
        if stream.awaiting_reset is not None:
            ep = stream.delivering()
            if ep is None or ep.epoch >= stream.awaiting_reset:
                return
        for ep in stream.epochs.values():
            if ep.recovery is not None and ep.recovery.held and self.may_release(stream, ep):
                self._release(stream, ep)
        super().dispatch(stream, transmit)

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
                        index.setdefault((part, seq), []).append((first, stop, checksum, member, reclaimed.rank,
                                                                  None))
                    for part, seq, at, lo, hi, checksum in reclaimed.cuts:
                        index.setdefault((part, seq), []).append((at, at + 1, checksum, member, reclaimed.rank,
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
            rank = self._rank_of(stream, member, number) if left > 0 else None
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
        if not part.diverged and any(u[2] != part.checksums.get(seq) for u in used):
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
        cuts = [u for u in used if u[5] is not None]
        for piece, owner in pieces:
            if owner is not None:
                self._adopt(stream, ep, piece, *owner)
            elif not cuts:
                ep.queue.append(piece)
            else:
                for single in singles(piece):
                    self._match_rows(stream, ep, single, [u for u in cuts if u[0] == single.first])

    def _match_rows(self, stream: StreamState, ep: EpochState, single: HeldBatch, cuts: list[Used]) -> None:
        """Of one batch no rank used whole: the rows each rank used (its cut) adopted by it, one piece a cut (the
        rows an earlier cut had left out of it), the rows nobody used queued as pieces."""
        if not cuts:
            ep.queue.append(single)
            return
        base, top = batch_rows(single)
        plan: list[tuple[int, int, bool]] = []
        owners: list[tuple[str, int] | None] = []
        at = base
        for _, _, _, member, rank, rows in sorted(cuts, key=lambda u: u[5] or (0, 0)):
            assert rows is not None
            lo, hi = max(rows[0], at, base), max(min(rows[1], top), at, base)
            if lo > at:
                plan.append((at - base, lo - base, False))
                owners.append(None)
            plan.append((lo - base, hi - base, False))
            owners.append((member, rank))
            at = max(at, hi)
        if at < top:
            plan.append((at - base, top - base, False))
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
        self.buffered -= piece.nbytes
        if member == CHECKPOINT:
            if piece.settle() and self._observed:
                self._emit(BatchesAcked(stream.name, ep.epoch, [list(piece.id)]))
            return
        assert ep.recovery is not None
        ep.recovery.matched[member] = ep.recovery.matched.get(member, 0) + piece.count
        rank = self._rank_of(stream, member, number)
        if rank is not None:
            epoch = ep.epoch
            rank.acked += piece.count
            rank.given[epoch] = rank.given.get(epoch, 0) + piece.count
            rank.adopted[epoch] = rank.adopted.get(epoch, 0) + piece.count
        if piece.settle() and self._observed:
            self._emit(BatchesAcked(stream.name, ep.epoch, [list(piece.id)]))

    def _rank_of(self, stream: StreamState, member: str, number: int) -> RankState | None:
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

    # ---- joining: a rank that rejoins keeps what it adopted ---------------------------------------------------

    def join_rank(self, identity: bytes, h: dict, held: Iterable[BatchId] = (),
                  consumed: Iterable[BatchId] = ()) -> list[MissedEnd]:
        stream = self.streams.get(h["stream"])
        previous = self._same_session(stream, h["session"], h["rank"]) if stream is not None else None
        adopted = dict(previous.adopted) if previous is not None else {}
        missed = super().join_rank(identity, h, held, consumed)
        rank = self.ranks[identity]
        if previous is rank:
            return missed                     # the same HELLO again on the same connection
        for epoch, count in adopted.items():
            if epoch in self.streams[rank.stream].epochs:
                rank.adopted[epoch] = count
                if h.get("got") is None:      # the rank's own count, when it says it, has them already
                    rank.given[epoch] = rank.given.get(epoch, 0) + count
        return missed

    def recovering(self, name: str) -> bool:
        """Whether an epoch of the stream ``name`` is being recovered (a version-5 rank cannot take part)."""
        stream = self.streams.get(name)
        return stream is not None and any(e.recovery is not None and not e.end_sent for e in stream.epochs.values())

    # ---- EPOCH_QUERY ------------------------------------------------------------------------------------------

    def query_epoch(self, name: str, number: int) -> dict[str, Any]:
        """EPOCH_QUERY's answer, but ``incarnation`` and ``journal`` (the daemon's). ``seen``: partitions with a
        batch or a commit here (claims are not counted: this broker does not know its own index in a feed)."""
        stream = self.streams.get(name)
        if stream is None and not 0 < len(name) <= MAX_STREAM_NAME:     # what EPOCH_OPEN would refuse, said first
            raise ProtocolError(f"a stream name must have 1 to {MAX_STREAM_NAME} characters")
        ep = stream.epochs.get(number) if stream is not None else None
        if ep is not None:
            seen = {n for n, p in ep.parts.items() if any(p.attempts.values())} | ep.committed
            return {"known": True, "closed": ep.closed, "ended": ep.end_sent, "delivered": False,
                    "partitions": ep.partitions, "committed": protocol.pack_ranges(ep.committed),
                    "seen": protocol.pack_ranges(seen)}
        if (stream is not None and number in stream.finished) or \
                (stream is None and number in self.retired.get(name, ())):     # a retired stream's, by range
            stream_figures = stream.finished if stream is not None else {}
            figures = dict.get(stream_figures, number)      # None once only the range of it is kept
            partitions = figures["partitions"] if figures is not None else 0
            every = protocol.pack_ranges(range(partitions))
            return {"known": True, "closed": True, "ended": True, "delivered": True, "partitions": partitions,
                    "committed": every, "seen": every}
        return {"known": False, "closed": False, "ended": False, "delivered": False, "partitions": 0,
                "committed": [], "seen": []}


def _before(ranges: EpochRanges, number: int) -> EpochRanges:
    """``ranges`` without the epochs from ``number`` on."""
    return EpochRanges([first, min(last, number - 1)] for first, last in ranges.ranges() if first < number)


def _without(ranges: EpochRanges, number: int) -> EpochRanges:
    """``ranges`` without the epoch ``number``."""
    kept: list[list[int]] = []
    for first, last in ranges.ranges():
        if first <= number <= last:
            kept.extend([a, b] for a, b in ((first, number - 1), (number + 1, last)) if a <= b)
        else:
            kept.append([first, last])
    return EpochRanges(kept)


__all__ = ["Recovery", "MAX_RECLAIM_EPOCHS", "MAX_RECLAIM_ENTRIES", "MAX_RECLAIM_RECORDS", "MAX_INCARNATION",
           "MAX_LOSSES", "MAX_RECOVERY_RANGES"]
