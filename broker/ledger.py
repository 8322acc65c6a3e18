"""The broker's rules for batches, partitions, epochs and ranks, without sockets: what to keep, forward, commit.

The daemon calls the ledger with validated headers and does the I/O it asks for. The ledger holds one state
object (``broker.books``) and one rule object per topic, each holding that state; for every event it calls them
in an explicit order, here and nowhere else:

============================  ===========================================================================
``broker.books``              the state: streams, ranks, bytes held, observers; batches consumed, epochs retired
``broker.partitions``         epochs opened and closed, batches kept or dropped, commits, claims
``broker.rejoin``             ranks joining, rejoining, lost and gone; what goes back to the queue
``broker.grants``             equal steps granted (STEPS), the epoch's end evened out, the remainder
``broker.dispatch``           windows, batches to ranks, acknowledgements, epoch ends
``broker.recovery``           epochs streamed again after a loss or for a resume: EPOCH_RECOVER, RECLAIM, LOST
``broker.matching``           a recovering epoch's batches: held, then matched against what the ranks used
============================  ===========================================================================

What the journal must keep, the ledger hands to its observers as events (``broker.events``), each once applied;
replay applies the journal's records as the same events, through the same code, before the journal's recorder
observes the ledger again.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from sparkbus.broker.books import Books, Transmit
from sparkbus.broker.dispatch import MAX_WINDOW_BYTES, Dispatch
from sparkbus.broker.events import (
    Applied,
    BatchArrived,
    BatchesAcked,
    BatchesReclaimed,
    EpochClosed,
    EpochForgotten,
    EpochOpened,
    EpochRecovering,
    JournalRecorder,
    Observer,
    PartitionClaimed,
    PartitionCommitted,
    replayed_events,
)
from sparkbus.broker.grants import Grants
from sparkbus.broker.journal import DeliveredEpochs, EpochRanges, Journal
from sparkbus.broker.matching import Matching
from sparkbus.broker.partitions import MAX_PARTITIONS, Partitions, Rejected, Reply
from sparkbus.broker.recovery import Recovery
from sparkbus.broker.rejoin import MissedEnd, Rejoin, check_rank_hello
from sparkbus.broker.state import EpochState, HeldBatch, RankState, StreamState
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.headers import BatchHeader
from sparkbus.wire.records import BatchId, UsedCut, UsedEntry
from sparkbus.wire.requests import (
    EpochRecoverHeader,
    HelloHeader,
    PartitionClaimHeader,
    PartitionEndHeader,
    RankReport,
    ReclaimHeader,
    ReturnHeader,
)

log = logging.getLogger("sparkbus.broker")
T = TypeVar("T")


class OfBooks(Generic[T]):
    """An attribute of the ledger that is its books' (:class:`Books`), read and set there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, ledger: Ledger, owner: type | None = None) -> T:
        value: T = getattr(ledger.books, self.name)
        return value

    def __set__(self, ledger: Ledger, value: T) -> None:
        setattr(ledger.books, self.name, value)


class Ledger:
    """Streams, epochs, partitions and ranks: every decision about a batch. The daemon only moves frames.

    Args:
        journal: where to keep what the broker promised (observes the ledger's events); None: memory only.
        rejoin_grace: seconds a lost rank's batches wait for it.
        max_buffer: bytes of batches held before the feed pauses (:meth:`update_feed_gate`); None: never.
    """

    def __init__(self, journal: Journal | None = None, rejoin_grace: float = 10.0, max_buffer: int | None = None):
        self.books = books = Books(max_buffer, rejoin_grace)
        books.journal = journal
        # The rules, each over the one state; those that find a rank gone while sending call rank_gone below.
        self.matching = Matching(books)
        self.partitions = Partitions(books, self.matching)
        self.rejoin = Rejoin(books, self.rank_gone)
        self.grants = Grants(books, self.rejoin, self.matching, self.rank_gone)
        self.dispatcher = Dispatch(books, self.grants, self.rank_gone)
        self.recovery = Recovery(books, self.partitions, self.matching, self.rejoin, self.rank_gone)
        if journal is not None:
            self.observe(JournalRecorder(journal))
        parts = self.partitions
        self._appliers: dict[type, Callable[[Any], list[Reply] | None]] = {
            EpochOpened: parts.opened, BatchArrived: parts.arrived,
            PartitionCommitted: parts.committed,
            PartitionClaimed: parts.claimed, EpochClosed: parts.closed, BatchesAcked: self._acked_while_away,
            EpochRecovering: self.recovery.recover, BatchesReclaimed: self.recovery.reclaimed}
        self._away: dict[tuple[str, int], set[BatchId]] = {}     # replay: acked ids per epoch
        self.replay_refused: dict[str, int] = {}     # replay: records the rules refused, by reason (or event)

    # ---- the state, as the daemon and the tests read it: the books' own ------------------------------------

    streams = OfBooks[dict[str, StreamState]]()
    ranks = OfBooks[dict[bytes, RankState]]()          # by connection identity on the ranks socket
    buffered = OfBooks[int]()           # bytes of batches held: queued, in flight, or awaiting an atomic commit
    held_bytes = OfBooks[int]()         # ... of which: batches of uncommitted partitions in atomic delivery
    feed_paused = OfBooks[bool]()
    journal = OfBooks[Journal | None]()
    retired = OfBooks[OrderedDict[str, EpochRanges]]()
    retired_count = OfBooks[int]()
    keep_epochs = OfBooks[int]()        # delivered epochs per stream whose figures are kept
    rejoin_grace = OfBooks[float]()
    started = OfBooks[float]()          # when this broker (re)started

    # ---- the books ------------------------------------------------------------------------------------------

    def observe(self, observer: Observer) -> None:
        """Hand every event the ledger applies from now on to ``observer`` (the journal's recorder)."""
        self.books.observe(observer)

    def stream(self, name: str) -> StreamState:
        """The stream of that name, made on first use (:meth:`Books.stream`)."""
        return self.books.stream(name)

    def epoch(self, name: str, number: int) -> tuple[StreamState, EpochState]:
        """An open epoch (:meth:`Books.epoch`)."""
        return self.books.epoch(name, number)

    def touch(self, name: str, now: float) -> None:
        self.books.touch(name, now)

    def retire_streams(self, now: float, after: float) -> list[str]:
        return self.books.retire_streams(now, after)

    def feed_full(self) -> bool:
        return self.books.feed_full()

    def update_feed_gate(self) -> bool:
        return self.books.update_feed_gate()

    def warn_if_atomic_stall(self, now: float) -> None:
        self.books.warn_if_atomic_stall(now)

    # ---- the driver and the tasks: epochs, batches, partitions ---------------------------------------------

    def open_epoch(self, name: str, number: int, partitions: int, delivery: str, commit: str = "end") -> None:
        self.partitions.open_epoch(name, number, partitions, delivery, commit)

    def check_room_for_epoch(self, stream: StreamState, number: int) -> None:
        self.partitions.check_room_for_epoch(stream, number)

    def close_epoch(self, name: str, number: int, partitions: int, expected: int | None = None) -> list[int]:
        return self.partitions.close_epoch(name, number, partitions, expected)

    def accept_batch(self, header: BatchHeader, frames: list[Any], header_bytes: bytes | None = None) -> list[Reply]:
        """Keep, forward or drop one validated BATCH: ``apply(BatchArrived(header, frames, header_bytes))``, as the
        daemon's feed does. ``header_bytes``: the header as it came (default ``frames[0]``'s bytes), for the journal.
        Returns the commits it completes.

        Raises:
            Rejected: no such open epoch, out-of-range numbers, or the same attempt sent this seq before.
        """
        return self.apply(BatchArrived(header, frames, header_bytes))

    def claim_partition(self, h: PartitionClaimHeader) -> int:
        return self.partitions.claim_partition(h)

    def end_partition(self, identity: bytes, h: PartitionEndHeader) -> list[Reply]:
        return self.partitions.end_partition(identity, h)

    def commit_partitions(self, name: str, number: int, parts: list[Any]) -> list[int]:
        return self.partitions.commit_partitions(name, number, parts)

    # ---- recovery -------------------------------------------------------------------------------------------

    def recover_epoch(self, h: EpochRecoverHeader) -> None:
        """EPOCH_RECOVER (:meth:`Recovery.recover`), applied as an :class:`EpochRecovering`."""
        self.apply(EpochRecovering.of(h))

    def reclaim(self, rank: RankState, h: ReclaimHeader, entries: list[UsedEntry],
                cuts: Iterable[UsedCut] = ()) -> None:
        """RECLAIM from ``rank`` (:meth:`Recovery.reclaimed`), applied as a :class:`BatchesReclaimed`."""
        self.apply(self.recovery.reclaim(rank, h, entries, cuts))

    def send_lost(self, stream: StreamState, transmit: Transmit, only: bytes | None = None) -> None:
        self.recovery.send_lost(stream, transmit, only)

    def query_epoch(self, name: str, number: int) -> dict[str, Any]:
        return self.recovery.query_epoch(name, number)

    def recovering(self, name: str) -> bool:
        return self.recovery.recovering(name)

    def pending(self, stream: StreamState, ep: EpochState) -> list[tuple[RankState, int]]:
        return self.matching.pending(stream, ep)

    def counts(self, stream: StreamState, ep: EpochState) -> list[int]:
        return self.grants.counts(stream, ep)

    # ---- ranks: joining and leaving, in the rules' order ---------------------------------------------------

    def join_rank(self, identity: bytes, h: HelloHeader, held: Iterable[BatchId] = (),
                  consumed: Iterable[BatchId] = ()) -> list[MissedEnd]:
        """A rank's HELLO on the ranks socket (:meth:`Rejoin.join`): checked, then, in order, the earlier
        connection it may have (recovery: what it adopted), the group it joins (grants: another size at an
        epoch boundary lets the old group go), the join itself (rejoin: held and consumed batches reconciled),
        its grants (every evening out starts over), and what it had adopted kept.

        Returns:
            Each epoch that ended while a resuming rank was away (:meth:`send_missed`).
        Raises:
            ProtocolError: see :meth:`Rejoin.join` and :meth:`Grants.admit`.
        """
        check_rank_hello(h)
        earlier = self.recovery.before_join(h)
        self.grants.admit(identity, h)
        missed = self.rejoin.join(identity, h, held, consumed)
        self.grants.joined(identity, h)
        self.recovery.joined(identity, h, earlier)
        return missed

    def send_missed(self, identity: bytes, missed: list[MissedEnd], transmit: Transmit) -> None:
        self.rejoin.send_missed(identity, missed, transmit)

    def rank_gone(self, identity: bytes, why: str, keep: bool = True) -> None:
        """Forget a rank's connection (:meth:`Rejoin.leave`: an orphan for the grace, or its batches requeued);
        then, if its steps were granted, every evening out of its stream starts over."""
        rank = self.books.ranks.get(identity)
        self.rejoin.leave(identity, why, keep)
        if rank is not None and rank.grants:
            self.grants.start_over(self.books.streams[rank.stream])

    def expire_orphans(self, now: float) -> None:
        self.rejoin.expire_orphans(now)

    # ---- ranks: windows, batches out, acknowledgements -----------------------------------------------------

    def rank(self, identity: bytes) -> RankState:
        return self.dispatcher.rank(identity)

    def heard_from(self, identity: bytes, now: float | None = None) -> None:
        self.dispatcher.heard_from(identity, now)

    def set_window(self, rank: RankState, batches: int, nbytes: int) -> None:
        self.dispatcher.set_window(rank, batches, nbytes)

    def report(self, rank: RankState, h: RankReport) -> None:
        self.dispatcher.report(rank, h)

    def acknowledge(self, rank: RankState, ids: Sequence[Any], upto: Sequence[Any] = ()) -> int:
        return self.dispatcher.acknowledge(rank, ids, upto)

    def give_back(self, rank: RankState, h: ReturnHeader) -> int:
        return self.grants.give_back(rank, h)

    def dispatch(self, stream: StreamState, transmit: Transmit) -> None:
        """Hand queued batches to ranks with room, in order: nothing while a resumed epoch waits for its reset
        (recovery); recovered batches matched once every rank said what it used (matching); then the queue
        (:meth:`Dispatch.dispatch`: windows, grants, the epoch's end)."""
        if not self.recovery.may_dispatch(stream):
            return
        self.matching.release_ready(stream)
        self.dispatcher.dispatch(stream, transmit)

    # ---- events: live and replayed --------------------------------------------------------------------------

    def apply(self, event: Applied) -> list[Reply]:
        """Apply one event as the rules do live: its applier checks it, changes the state, then hands it to the
        observers (the replies are those owed to tasks, if any).

        Raises:
            Rejected: a batch the rules drop.
            ProtocolError: an event the rules refuse (an EPOCH_RECOVER, a RECLAIM), nothing changed.
        """
        return self._appliers[type(event)](event) or []

    def _acked_while_away(self, event: BatchesAcked) -> None:
        """Replay: batches a rank consumed before the restart. No rank holds them now (the ranks are gone), so they
        wait in the queue; :meth:`_settle_acked` takes them out once the epoch's records are read (one pass over
        the queue per epoch, not one per ACK record)."""
        self._away.setdefault((event.stream, event.epoch), set()).update(map(BatchId._make, event.ids))

    def _settle_acked(self, stream: str, epoch: int) -> None:
        ep = self.streams[stream].epochs.get(epoch)
        acked = self._away.pop((stream, epoch), set())
        if ep is None or not acked:
            return
        kept: deque[HeldBatch] = deque()
        for batch in ep.queue:
            if batch.id in acked:                # sent and acknowledged before the restart
                self.books.free(batch.nbytes)
                ep.count_out(batch)
                ep.count_acked(batch)
                ep.acked_before[batch.id] = batch.count    # a rank that rejoins may name it as consumed
            else:
                kept.append(batch)
        ep.queue = kept

    # ---- restart ----------------------------------------------------------------------------------------

    def replay(self) -> None:
        """Rebuild streams and epochs from the journal: committed and acknowledged state as it was."""
        assert self.journal is not None
        for record in self.journal.retired():
            stream = self.stream(record["stream"])
            if "delivered" in record:        # a compacted journal: epochs delivered long ago, figures dropped
                stream.finished = DeliveredEpochs(record["delivered"], stream.finished.figures,
                                                  self.journal.keep_stats)
            else:
                stream.finished.add(record["epoch"], record["stats"])
        # What is applied now is in the journal already: nobody observes the ledger until it is rebuilt
        observers, self.books.observers = self.books.observers, []
        replayed_epochs: list[tuple[str, int]] = []
        try:
            for replayed in self.journal.replay():
                replayed_epochs.append((replayed.stream, replayed.epoch))
                events = list(replayed_events(replayed))
                reset = any(isinstance(e, EpochRecovering) and e.reset for e in events)
                if replayed.epoch in self.stream(replayed.stream).finished and not reset:
                    continue                 # delivered (a resume's reset forgets that: its records follow)
                started = False              # before the epoch's open (or recover), only reclaims are worth anything
                for event in events:
                    started = started or isinstance(event, EpochOpened | EpochRecovering)
                    if not started and not isinstance(event, BatchesReclaimed):
                        continue
                    try:
                        self.apply(event)
                    except (Rejected, ProtocolError) as exc:  # as live: refused by the rules, and counted
                        reason = exc.reason if isinstance(exc, Rejected) else type(event).__name__
                        self.replay_refused[reason] = self.replay_refused.get(reason, 0) + 1
                        log.debug("journal replay: stream %r epoch %d: a record refused (%s): %s", replayed.stream,
                                  replayed.epoch, reason, exc)
                self._settle_acked(replayed.stream, replayed.epoch)
        finally:
            self.books.observers = observers
            self._away.clear()
        for name, number in replayed_epochs:     # files of nothing kept: an epoch retired, or reclaims dropped
            stream = self.streams[name]
            if number not in stream.epochs and number not in stream.reclaims:
                self.books.emit(EpochForgotten(name, number))
        if self.replay_refused:
            log.warning("journal replay: the rules refused %d records (%s)", sum(self.replay_refused.values()),
                        ", ".join(f"{n} {reason}" for reason, n in sorted(self.replay_refused.items())))
        restored = sum(len(e.queue) for s in self.streams.values() for e in s.epochs.values())
        log.info("journal replayed: %d epochs, %d unacknowledged batches to deliver",
                 sum(len(s.epochs) for s in self.streams.values()), restored)
        # Independent consumers are each "rank 0 of 1": the first to come back would complete its stream and could
        # be given a batch another one had in hand, or had consumed without the journal hearing of it. Their
        # streams wait --rejoin-grace for every consumer to come back and name what it has.
        until = time.monotonic() + self.rejoin_grace
        for stream in self.streams.values():
            if stream.epochs:
                stream.held_until = until


__all__ = ["Ledger", "MissedEnd", "Rejected", "Reply", "MAX_PARTITIONS", "MAX_WINDOW_BYTES"]
