"""The ledger's rules for an epoch streamed again from Spark's lineage: a lost broker's partitions taken over, or an
epoch resumed from a checkpoint (docs/design/RECOVERY.md, "The broker").

- ``EPOCH_RECOVER`` says which partitions this broker now ``carries`` and which of them it ``recovered`` (a lost
  broker's, or all of them for a resume). Batches of other partitions are dropped (``unassigned``); claims are
  refused.
- ``RECLAIM`` says, per rank and per loss, which batches of the epoch the rank used. They are kept per stream,
  bounded, whether or not the epoch is recovering yet.
- A batch of a recovered partition is **held** until every member of the stream has sent its ``RECLAIM`` for
  every loss waited for; ``LOST`` asks those that have not. Then it is **matched** (``broker.matching``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from sparkbus.broker.books import MAX_STREAM_NAME, Books, Outcome, RankGone, Transmit
from sparkbus.broker.events import BatchesReclaimed, EpochForgotten, EpochOpened, EpochRecovering
from sparkbus.broker.matching import RESUME, Matching
from sparkbus.broker.partitions import MAX_PARTITIONS, Partitions, check_modes
from sparkbus.broker.rejoin import Rejoin
from sparkbus.broker.state import EpochRecovery, RankState, Reclaimed, StreamState
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind, PartitionRanges
from sparkbus.wire.records import UsedCut, UsedEntry
from sparkbus.wire.requests import HelloHeader, ReclaimHeader

log = logging.getLogger("sparkbus.broker")

MAX_RECLAIM_EPOCHS = 4          # epochs per stream whose RECLAIMs are kept (the open one, a resume's, a few late)
MAX_RECLAIM_ENTRIES = 1 << 21   # used-batch entries per stream kept (about 200 MB at the very most)
MAX_RECLAIM_RECORDS = 16_384    # RECLAIMs kept per stream, one per (epoch, loss, rank session): ranks x losses
MAX_INCARNATION = 64            # characters of a loss's name (a broker's incarnation: 16 hex digits; "" a resume)
MAX_LOSSES = 32                 # losses one epoch waits for, or keeps RECLAIMs of: a few brokers lost, a resume
MAX_RECOVERY_RANGES = 1 << 16   # ranges of partitions an epoch's recovery carries (each EPOCH_RECOVER adds some)


class Earlier(NamedTuple):
    """A rank's earlier connection (live, or lost and waiting), as it was before the rank said HELLO again."""

    rank: RankState | None
    adopted: dict[int, int]        # epoch -> batches it had adopted (used of lost brokers)


class Recovery:
    """EPOCH_RECOVER, RECLAIM, LOST and EPOCH_QUERY: the broker's side of recovery from lineage and exact resume.

    Args:
        books: the ledger's state.
        partitions: the rules of epochs (EPOCH_RECOVER opens one this broker does not know).
        matching: the epoch's recovered batches, held and matched (its ``members`` are the ranks waited for).
        rejoin: the rules of ranks that come back (a rank's earlier connection, for what it adopted).
        gone: the ledger's "a rank is gone".
    """

    def __init__(self, books: Books, partitions: Partitions, matching: Matching, rejoin: Rejoin, gone: RankGone):
        self.books = books
        self.partitions = partitions
        self.matching = matching
        self.rejoin = rejoin
        self.gone = gone

    # ---- EPOCH_RECOVER ------------------------------------------------------------------------------------

    def recover(self, event: EpochRecovering) -> None:
        """EPOCH_RECOVER (the applier of :class:`~broker.events.EpochRecovering`): stream ``carries`` of the epoch
        from now on; hold and match the batches of ``recovered`` against the ranks' RECLAIMs for every loss in
        ``lost``. Opens the epoch if this broker does not know it; ``reset`` drops what it had of it first, delivered
        or not (a resume). Several add up.

        Raises:
            ProtocolError: numbers out of range, bad ranges, ``recovered`` not within ``carries``, another delivery,
                or partitions to recover of an epoch whose end already went out here (without ``reset``).
        """
        name, number, partitions, delivery = event.stream, event.epoch, event.partitions, event.delivery
        commit, reset = event.commit, event.reset
        if not 0 <= partitions <= MAX_PARTITIONS or number < 0:
            raise ProtocolError(f"epoch {number} with {partitions} partitions is out of range")
        check_modes(delivery, commit)
        lost = event.lost
        if len(lost) > MAX_LOSSES or not all(type(loss) is str and len(loss) <= MAX_INCARNATION for loss in lost):
            raise ProtocolError(f"EPOCH_RECOVER's lost must be a list of at most {MAX_LOSSES} incarnations, strings "
                                f"of at most {MAX_INCARNATION} characters")
        stream = self.books.stream(name)
        ep = stream.epochs.get(number)
        limit = ep.partitions if ep is not None and not reset else partitions
        carries = PartitionRanges(protocol.range_pairs(event.carries, limit))
        recovered = carries if reset else PartitionRanges(protocol.range_pairs(event.recovered, limit))
        if not recovered <= carries:
            raise ProtocolError("EPOCH_RECOVER's recovered partitions must be among those it carries")
        self._check_recovery_bounds(stream, number, reset, lost, carries, recovered)
        if reset:
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
        if ep is None:           # opened by this event: its record is the journal's (no ``open`` before it)
            ep = self.partitions.open_state(EpochOpened(name, number, partitions, delivery, commit))
        rec = ep.recovery
        if rec is None:
            rec = ep.recovery = EpochRecovery(carries, recovered, [], reset=reset)
        else:
            rec.carries |= carries
            rec.recovered |= recovered
            rec.index = rec.expected = None
        rec.lost.extend(loss for loss in dict.fromkeys(lost) if loss not in rec.lost)
        if ep.closed:
            ep.closed = False             # more partitions come: the driver closes it again
        log.info("stream %r epoch %d recovering: %d partitions carried, %d recovered, losses %s%s", name, number,
                 len(rec.carries), len(rec.recovered), ", ".join(repr(loss) for loss in rec.lost),
                 " (reset)" if reset else "")
        self.books.emit(event)

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
            self.partitions.check_room_for_epoch(stream, number)

    def _rewind(self, stream: StreamState, number: int) -> None:
        """A resume at epoch ``number``: forget it and every later epoch (:meth:`_reset`). The checkpointed model has
        seen none of the later ones, which the run that died may have been given (the feed runs ahead): left here,
        the rest of them would go to the resumed ranks before the driver's resets of them come."""
        for later in sorted(n for n in stream.epochs if n > number):
            self._reset(stream, later)
        stream.finished.forget_after(number)
        self._reset(stream, number)

    def _reset(self, stream: StreamState, number: int) -> None:
        """Forget everything of epoch ``number``: its queue and held batches, the ranks' (and lost ranks') batches
        and counts of it (a lost rank left with none is not waited for), its delivered record, and the reclaims of
        any loss but a resume's."""
        ep = stream.epochs.pop(number, None)
        if ep is not None:
            self.books.drop(ep.queue)
            for part in ep.parts.values():
                for batches in part.held.values():
                    self.books.drop(batches, held=True)
            if ep.recovery is not None:
                self.books.drop(ep.recovery.held)
        for rank in stream.members():
            self.books.free(rank.forget_inflight(number))
            rank.forget_counts(number)
        for session, orphan in list(stream.orphans.items()):
            if not orphan.rank.inflight:       # it waited for batches of this epoch only: nothing to wait for
                del stream.orphans[session]
        if stream.finished.forget(number):
            log.info("stream %r epoch %d: its delivery is forgotten, it is fed again (a resume)", stream.name, number)
        for loss in [loss for loss in stream.reclaims.get(number, {}) if loss != RESUME]:
            del stream.reclaims[number][loss]

    # ---- RECLAIM and LOST -----------------------------------------------------------------------------------

    def reclaim(self, rank: RankState, h: ReclaimHeader, entries: list[UsedEntry],
                cuts: Iterable[UsedCut] = ()) -> BatchesReclaimed:
        """RECLAIM from ``rank``: the event to apply (:meth:`reclaimed`).

        Raises:
            ProtocolError: a stream other than the rank's.
        """
        if h["stream"] != rank.stream:
            raise ProtocolError(f"rank {rank.rank} reads stream {rank.stream!r}, not {h['stream']!r}")
        return BatchesReclaimed(rank.stream, h["epoch"], h["lost"], rank.member, rank.rank, entries, tuple(cuts))

    def reclaimed(self, event: BatchesReclaimed) -> None:
        """RECLAIM (the applier of :class:`~broker.events.BatchesReclaimed`): what the rank ``event.member`` used of
        the epoch of the broker ``event.lost`` lost (all its lost entries of the epoch: it sends them whole each
        time), and the rows it used of batches it used part of (``cuts``). Kept until the epoch retires, bounded
        per stream.

        Raises:
            ProtocolError: a bad epoch number or loss name, or one loss too many for the epoch.
        """
        stream = self.books.stream(event.stream)
        number, loss = event.epoch, event.lost
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
        members[event.member] = Reclaimed(event.rank, event.entries, event.cuts)
        ep = stream.epochs.get(number)
        if ep is not None and ep.recovery is not None:
            ep.recovery.index = ep.recovery.expected = None
        if loss == RESUME and (ep is None or ep.recovery is None or not ep.recovery.reset):
            # A rank resumes from a checkpoint: the old job's rest of this epoch (or its later epochs) must not
            # reach it. Nothing from this epoch on goes out until the driver's EPOCH_RECOVER(reset) comes.
            if stream.awaiting_reset is None or number < stream.awaiting_reset:
                stream.awaiting_reset = number
                log.info("stream %r: rank %d resumes epoch %d; its delivery waits for the epoch's reset",
                         stream.name, event.rank, number)
        self.books.emit(event)
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
            if oldest not in stream.epochs:
                self.books.emit(EpochForgotten(stream.name, oldest))
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
            self.gone(identity, "disconnected")

    def may_dispatch(self, stream: StreamState) -> bool:
        """Whether anything of ``stream`` may go out now: not while a rank resumes an epoch from a checkpoint and the
        driver's reset of it has not come (nothing from that epoch on)."""
        if stream.awaiting_reset is not None:
            ep = stream.delivering()
            if ep is None or ep.epoch >= stream.awaiting_reset:
                return False
        return True

    # ---- joining: a rank that rejoins keeps what it adopted ---------------------------------------------------

    def before_join(self, h: HelloHeader) -> Earlier:
        """Before a rank joins: its earlier connection (live or lost), whose adopted batches it keeps."""
        stream = self.books.streams.get(h["stream"])
        previous = self.rejoin.same_session(stream, h["session"], h["rank"]) if stream is not None else None
        return Earlier(previous, dict(previous.adopted) if previous is not None else {})

    def joined(self, identity: bytes, h: HelloHeader, earlier: Earlier) -> None:
        """After a rank joined: what its earlier connection had adopted stays its own, in its counts for grants."""
        rank = self.books.ranks[identity]
        if earlier.rank is rank:
            return                            # the same HELLO again on the same connection
        for epoch, count in earlier.adopted.items():
            if epoch in self.books.streams[rank.stream].epochs:
                rank.adopted[epoch] = count
                if h.get("got") is None:      # the rank's own count, when it says it, has them already
                    rank.given[epoch] = rank.given.get(epoch, 0) + count

    def recovering(self, name: str) -> bool:
        """Whether an epoch of the stream ``name`` is being recovered (a version-5 rank cannot take part)."""
        stream = self.books.streams.get(name)
        return stream is not None and any(e.recovery is not None and not e.end_sent for e in stream.epochs.values())

    # ---- EPOCH_QUERY ------------------------------------------------------------------------------------------

    def query_epoch(self, name: str, number: int) -> dict[str, Any]:
        """EPOCH_QUERY's answer, but ``incarnation`` and ``journal`` (the daemon's). ``seen``: partitions with a
        batch or a commit here (claims are not counted: this broker does not know its own index in a feed)."""
        stream = self.books.streams.get(name)
        if stream is None and not 0 < len(name) <= MAX_STREAM_NAME:     # what EPOCH_OPEN would refuse, said first
            raise ProtocolError(f"a stream name must have 1 to {MAX_STREAM_NAME} characters")
        ep = stream.epochs.get(number) if stream is not None else None
        if ep is not None:
            seen = {n for n, p in ep.parts.items() if any(p.attempts.values())} | ep.committed
            return {"known": True, "closed": ep.closed, "ended": ep.end_sent, "delivered": False,
                    "partitions": ep.partitions, "committed": protocol.pack_ranges(ep.committed),
                    "seen": protocol.pack_ranges(seen)}
        if (stream is not None and number in stream.finished) or \
                (stream is None and number in self.books.retired.get(name, ())):     # a retired stream's, by range
            figures = stream.finished.figures.get(number) if stream is not None else None   # None: a range's
            partitions = figures["partitions"] if figures is not None else 0
            every = protocol.pack_ranges(range(partitions))
            return {"known": True, "closed": True, "ended": True, "delivered": True, "partitions": partitions,
                    "committed": every, "seen": every}
        return {"known": False, "closed": False, "ended": False, "delivered": False, "partitions": 0,
                "committed": [], "seen": []}


__all__ = ["Recovery", "Earlier", "MAX_RECLAIM_EPOCHS", "MAX_RECLAIM_ENTRIES", "MAX_RECLAIM_RECORDS", "MAX_INCARNATION",
           "MAX_LOSSES", "MAX_RECOVERY_RANGES"]
