"""What the ledger's rules share: its streams and ranks, the bytes it holds, its observers, and the feed gate.

:class:`Books` is the one state object of the ledger. Each rule object (``partitions``, ``dispatch``, ``grants``,
``rejoin``, ``recovery``, ``matching``; composed in ``broker.ledger``) holds it and acts on it. It owns the state
every rule reads and the transitions every rule ends with: batches consumed (their bytes freed, the
acknowledgement observed), epochs retired, streams retired, and whether the feed may be read.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, Protocol

from sparkbus.broker.events import BatchesAcked, EpochRetired, Event, Observer
from sparkbus.broker.journal import RETIRED_KEEP_STATS, DeliveredEpochs, EpochRanges, Journal
from sparkbus.broker.state import EpochState, HeldBatch, RankState, StreamState
from sparkbus.wire.errors import ProtocolError

log = logging.getLogger("sparkbus.broker")

MAX_STREAMS = 4096            # a peer cannot make the broker track streams without bound
MAX_RETIRED = 16384           # retired streams whose delivered epochs are remembered (a range or a few: ~300 bytes)
KEEP_EPOCHS = RETIRED_KEEP_STATS     # delivered epochs per stream whose figures are kept, by default
MAX_STREAM_NAME = 256
STALL_WARN_EVERY = 10.0       # seconds between warnings that atomic partitions fill the buffer


class Outcome(Enum):
    """What became of a message handed to the ranks socket."""

    SENT = "sent"
    FULL = "full"          # not now (EAGAIN): the rank's queue is full; try again later
    GONE = "gone"          # the rank's connection is closed (EHOSTUNREACH)


# The daemon's I/O, handed to the ledger's sending rules: send ``frames`` to the rank on ``identity``. It only
# sends and says what became of it; what follows from that (a rank gone, a batch back in the queue) the ledger does.
Transmit = Callable[[bytes, list[Any]], Outcome]


class RankGone(Protocol):
    """The ledger's "a rank is gone" (:meth:`broker.ledger.Ledger.rank_gone`), handed to the rules that find one
    gone while they send: every rule that follows from it runs, in the ledger's order."""

    def __call__(self, identity: bytes, why: str, keep: bool = True) -> None: ...


class Books:
    """The state of the ledger and the transitions its rules share.

    Args:
        max_buffer: bytes of batches held before the feed is paused (None: never).
        rejoin_grace: seconds a lost rank's batches wait for it.
    """

    def __init__(self, max_buffer: int | None = None, rejoin_grace: float = 10.0):
        self.streams: dict[str, StreamState] = {}
        self.ranks: dict[bytes, RankState] = {}      # by connection identity on the ranks socket
        # Running sums, kept here only (keep, free, drop, consumed), for the feed gate on every read of the feed:
        # the hypothesis machine (test_ledger_machine) checks them against the containers that hold the batches.
        self._buffered = 0         # bytes of batches held: queued, in flight, or awaiting an atomic commit
        self._held_bytes = 0       # of which: batches of uncommitted partitions in atomic delivery
        self.max_buffer = max_buffer
        self.feed_paused = False   # as last decided by update_feed_gate
        self.observers: list[Observer] = []     # who hears of each event applied (the journal's recorder);
        # rules on the hot path make no event while there is none
        self._stall_warned = float("-inf")
        self.keep_epochs = KEEP_EPOCHS     # delivered epochs per stream whose figures are kept (StreamState.finished)
        self.retired: OrderedDict[str, EpochRanges] = OrderedDict()   # streams retired: the epochs they delivered
        self.retired_count = 0             # streams retired since the start
        self.journal: Journal | None = None    # the ledger's, if it keeps one
        self.rejoin_grace = rejoin_grace
        self.started = time.monotonic()      # independent consumers of a broker just (re)started may be coming back

    # ---- the bytes held ---------------------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        """Bytes of batches held: queued, in flight (or at a lost rank awaited), or awaiting an atomic commit."""
        return self._buffered

    @property
    def held_bytes(self) -> int:
        """Of :attr:`buffered`: batches of uncommitted partitions in atomic delivery."""
        return self._held_bytes

    def keep(self, nbytes: int, held: bool = False) -> None:
        """A batch of ``nbytes`` is kept from the feed (``held``: for an atomic commit)."""
        self._buffered += nbytes
        if held:
            self._held_bytes += nbytes

    def unhold(self, nbytes: int) -> None:
        """A batch held for an atomic commit is committed: still kept, no longer held."""
        self._held_bytes -= nbytes

    def free(self, nbytes: int) -> None:
        """Batches of ``nbytes`` are let go of (consumed, adopted, forgotten), not held for a commit."""
        self._buffered -= nbytes

    # ---- observers --------------------------------------------------------------------------------------

    def observe(self, observer: Observer) -> None:
        """Hand every event the ledger applies from now on to ``observer`` (the journal's recorder)."""
        self.observers.append(observer)

    def emit(self, event: Event) -> None:
        for observer in self.observers:
            observer(event)

    # ---- streams and epochs -----------------------------------------------------------------------------

    def stream(self, name: str) -> StreamState:
        """The stream of that name, made on first use. Raises :class:`ProtocolError` for a bad name or too many."""
        stream = self.streams.get(name)
        if stream is None:
            if len(name) > MAX_STREAM_NAME or not name:
                raise ProtocolError(f"a stream name must have 1 to {MAX_STREAM_NAME} characters")
            if len(self.streams) >= MAX_STREAMS and not self._retire_least_recent():
                raise ProtocolError(f"the broker already tracks {MAX_STREAMS} streams, all in use")
            # a retired stream comes back knowing which epochs it delivered: they are still not fed again
            stream = self.streams[name] = StreamState(name, finished=DeliveredEpochs(
                self.retired.pop(name, EpochRanges()).ranges(), keep=self.keep_epochs))
        return stream

    def touch(self, name: str, now: float) -> None:
        """A message named the stream: it is in use now (``--retire-streams-after`` counts from here)."""
        stream = self.streams.get(name)
        if stream is not None:
            stream.last_used = now

    def _retire_least_recent(self) -> bool:
        """At :data:`MAX_STREAMS`, a new stream retires the one unused for longest, before its time: better than
        refusing a job (a journal replaying more streams than that needs it too). False if every stream is in use."""
        unused = [s for s in self.streams.values() if not s.in_use()]
        if not unused:
            return False
        oldest = min(unused, key=lambda s: s.last_used)
        self._retire(oldest)
        self.retired_count += 1
        log.info("retired stream %r early: the broker tracks %d streams", oldest.name, MAX_STREAMS)
        return True

    def _retire(self, stream: StreamState) -> None:
        """Drop ``stream``, keeping the epochs it delivered (:attr:`retired`, bounded by :data:`MAX_RETIRED`)."""
        del self.streams[stream.name]
        if self.journal is not None:
            self.journal.retire_stream(stream.name)
        ranges = stream.finished.ranges
        for number in stream.finished.figures:
            ranges.add(number)
        if len(ranges.ranges()):
            self.retired[stream.name] = ranges
            self.retired.move_to_end(stream.name)
            while len(self.retired) > MAX_RETIRED:
                self.retired.popitem(last=False)

    def retire_streams(self, now: float, after: float) -> list[str]:
        """Drop the streams unused for ``after`` seconds (0: never): no ranks, no lost ranks waiting, no epoch
        in progress, and no message naming them. What each delivered is kept (ranges of epoch numbers, for at most
        :data:`MAX_RETIRED` streams), so a delivered epoch is still refused if the stream comes back."""
        retired: list[str] = []
        if after <= 0:
            return retired
        for name, stream in list(self.streams.items()):
            if stream.in_use():
                stream.last_used = now
            elif now - stream.last_used >= after:
                self._retire(stream)
                retired.append(name)
        if retired:
            self.retired_count += len(retired)
            log.info("retired %d streams unused for %g s: %s", len(retired), after,
                     ", ".join(repr(n) for n in retired[:5]) + (", ..." if len(retired) > 5 else ""))
        return retired

    def epoch(self, name: str, number: int) -> tuple[StreamState, EpochState]:
        """An open epoch (not closed yet). Raises :class:`ProtocolError` if there is none."""
        stream = self.streams.get(name)
        ep = stream.epochs.get(number) if stream else None
        if stream is None or ep is None or ep.closed:
            raise ProtocolError(f"stream {name!r} epoch {number} is not open (if the broker restarted without "
                                f"--journal, it lost this epoch: feed it again)")
        return stream, ep

    # ---- transitions every part ends with ---------------------------------------------------------------

    def consumed(self, stream: StreamState, rank: RankState, batches: list[HeldBatch], held: bool = True) -> None:
        """Batches that ``rank`` has consumed, out of its inflight already (``held``) or found elsewhere when it
        rejoined: their bytes are free, and observers hear of it."""
        if not batches:
            return
        self._buffered -= rank.consumed(batches, held)
        epochs = stream.epochs
        settled = []               # whole messages consumed (a pack cut in pieces: once its last piece is)
        for batch in batches:
            ep = epochs.get(batch.id[0])
            if ep is not None:
                ep.count_acked(batch)
            if batch.settle():
                settled.append(batch)
        if self.observers:
            by_epoch: dict[int, list[list[int]]] = {}
            for batch in settled:
                by_epoch.setdefault(batch.id[0], []).append(list(batch.id))
            for number, acked in by_epoch.items():
                self.emit(BatchesAcked(stream.name, number, acked))
        self.retire(stream)

    def drop(self, batches: Iterable[HeldBatch], held: bool = False) -> None:
        """Batches the broker lets go of without sending (``held``: copies held for an atomic commit)."""
        for batch in batches:
            self._buffered -= batch.nbytes
            if held:
                self._held_bytes -= batch.nbytes

    def retire(self, stream: StreamState) -> None:
        """Drop epochs that ended and were fully acknowledged, keeping their figures (the last
        :attr:`keep_epochs`', the older ones summed: ``StreamState.finished``). What the ranks counted of such an
        epoch goes too: a rank that reads epoch after epoch holds nothing per epoch it is done with."""
        for number, ep in list(stream.epochs.items()):
            if ep.end_sent and not ep.queue and ep.all_acked:
                stats = ep.stats()
                stream.finished.add(number, stats)
                del stream.epochs[number]
                stream.reclaims.pop(number, None)
                for rank in stream.members():
                    rank.forget_counts(number)
                self.emit(EpochRetired(stream.name, number, stats))

    # ---- the feed gate ----------------------------------------------------------------------------------

    def feed_full(self) -> bool:
        """Whether the buffer is full: the feed socket must not be read (backpressure reaches Spark)."""
        return self.max_buffer is not None and self.buffered >= self.max_buffer

    def update_feed_gate(self) -> bool:
        """Decide whether the feed is paused (:attr:`feed_paused`); returns whether that changed."""
        paused = self.feed_full()
        if paused == self.feed_paused:
            return False
        self.feed_paused = paused
        log.debug("feed %s at %d buffered bytes", "paused" if paused else "resumed", self.buffered)
        return True

    def warn_if_atomic_stall(self, now: float) -> None:
        """Warn (at most every :data:`STALL_WARN_EVERY` s) while the buffer is full of uncommitted atomic
        partitions: nothing can be released until they commit, and their tasks are blocked by the full buffer."""
        stuck = self.feed_paused and self.held_bytes >= self.buffered > 0
        if stuck and now - self._stall_warned > STALL_WARN_EVERY:
            self._stall_warned = now
            log.warning("the buffer is full of partitions that are not committed yet (atomic delivery): nothing "
                        "can be released until they are. Raise --max-buffer above (concurrent Spark tasks x "
                        "partition size) or use smaller partitions")
