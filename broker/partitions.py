"""The ledger's rules for epochs, batches and partitions: what to keep, forward, commit; which broker streams what.

Requests are checked here (:class:`ProtocolError` with the reason, sent back as ``ERROR``), then applied as
events (``broker.events``): the appliers are what replay runs too.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, NamedTuple

from sparkbus.broker.books import Books
from sparkbus.broker.events import BatchArrived, EpochClosed, EpochOpened, PartitionClaimed, PartitionCommitted
from sparkbus.broker.journal import DeliveredEpochs
from sparkbus.broker.matching import Matching
from sparkbus.broker.state import EpochState, HeldBatch, PendingCommit, StreamState
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import ErrorCode, Kind
from sparkbus.wire.requests import PartitionClaimHeader, PartitionEndHeader

log = logging.getLogger("sparkbus.broker")

MAX_PARTITIONS = 10_000_000
# Epochs a stream may have open (opened and not yet retired: delivered and every batch acknowledged). feed_epochs
# opens one epoch at a time and a few run ahead of the ranks (as far as --max-buffer lets them): a limit far above
# that, which a peer opening epochs it never feeds meets long before the broker's memory does.
MAX_OPEN_EPOCHS = 256
MAX_BROKER_EPOCHS = 16_384    # ... and epochs open on the whole broker, over its streams (MAX_STREAMS of them)
# Runs of consecutive epoch numbers a stream's delivered epochs make: each is kept (a range) for as long as the
# stream, and after it retires, so that a delivered epoch is refused again. feed_epochs delivers one run.
MAX_DELIVERED_RUNS = 1024
# Attempts of one partition the broker keeps apart: Spark's retries, speculative copies and re-feeds are a handful;
# each attempt costs the seqs it sent, so a peer inventing attempt numbers is refused past this.
MAX_ATTEMPTS = 256


class Rejected(Exception):
    """A feed message that is dropped and counted under ``reason``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Reply(NamedTuple):
    """A control-socket answer the ledger owes someone (a deferred partition commit)."""

    identity: bytes
    kind: Kind
    fields: dict[str, Any]


class Partitions:
    """Epochs opened and closed by the driver, batches and commits from the tasks, claims of several brokers.

    Each request is checked here, then applied by its applier (``opened``, ``arrived``, ``committed``, ``claimed``,
    ``closed``): what :meth:`broker.ledger.Ledger.apply` runs for an event, live and on replay.

    Args:
        books: the ledger's state.
        matching: where a batch of a recovered partition goes (held, or matched against the ranks' RECLAIMs).
    """

    def __init__(self, books: Books, matching: Matching):
        self.books = books
        self.matching = matching

    # ---- epochs -----------------------------------------------------------------------------------------

    def open_epoch(self, name: str, number: int, partitions: int, delivery: str, commit: str = "end") -> None:
        """EPOCH_OPEN. Opening an open epoch again with the same terms changes nothing. ``partitions`` is the
        epoch's count, or an upper bound on it that EPOCH_CLOSE lowers (see :meth:`close_epoch`). ``commit``
        says who commits an attempt of a partition (``protocol.COMMIT_MODES``): its own PARTITION_END, or the
        driver's PARTITION_COMMIT once Spark declared the attempt successful.

        Raises:
            ProtocolError: numbers out of range, an unknown delivery or commit, an epoch already delivered or open
                with other terms.
        """
        if not 0 <= partitions <= MAX_PARTITIONS or number < 0:
            raise ProtocolError(f"epoch {number} with {partitions} partitions is out of range")
        check_modes(delivery, commit)
        stream = self.books.stream(name)
        if number in stream.finished or (number in stream.epochs and stream.epochs[number].end_sent):
            raise ProtocolError(f"stream {name!r} has already delivered epoch {number}; "
                                f"feed a new epoch number or a new stream name")
        ep = stream.epochs.get(number)
        if ep is None:
            self.check_room_for_epoch(stream, number)
            self.opened(EpochOpened(name, number, partitions, delivery, commit))
            log.info("stream %r epoch %d opened: %d partitions, %s delivery, committed by %s", name, number,
                     partitions, delivery, "the driver" if commit == "driver" else "each task's end")
        elif ep.partitions != partitions or ep.delivery != delivery or ep.closed:
            raise ProtocolError(f"stream {name!r} epoch {number} is already open with {ep.partitions} "
                                f"partitions and {ep.delivery} delivery")

    def check_room_for_epoch(self, stream: StreamState, number: int) -> None:
        """Raise :class:`ProtocolError` if ``stream`` may not open another epoch (``number``): it has
        :data:`MAX_OPEN_EPOCHS` open, its delivered epochs make :data:`MAX_DELIVERED_RUNS` runs and ``number`` would
        start another, or the broker has :data:`MAX_BROKER_EPOCHS` open over all its streams."""
        if len(stream.epochs) >= MAX_OPEN_EPOCHS:
            raise ProtocolError(f"stream {stream.name!r} cannot open epoch {number}: it has {len(stream.epochs)} "
                                f"epochs open (not yet delivered and acknowledged), the most a stream may have "
                                f"({MAX_OPEN_EPOCHS}). Open the next epoch once its ranks have consumed earlier ones, "
                                f"or feed another stream")
        finished = stream.finished
        if not any(n in finished or n in stream.epochs for n in (number - 1, number + 1)):
            runs = delivered_runs(finished)
            if runs >= MAX_DELIVERED_RUNS:
                raise ProtocolError(f"stream {stream.name!r} cannot open epoch {number}: its delivered epochs make "
                                    f"{runs} runs of consecutive numbers, the most a stream keeps "
                                    f"({MAX_DELIVERED_RUNS}); number the epochs one after the other, or feed "
                                    f"another stream")
        total = sum(len(s.epochs) for s in self.books.streams.values())
        if total >= MAX_BROKER_EPOCHS:
            raise ProtocolError(f"stream {stream.name!r} cannot open epoch {number}: the broker has {total} epochs "
                                f"open over its streams, the most it keeps ({MAX_BROKER_EPOCHS}). Let the ranks "
                                f"finish earlier epochs first, or spread the streams over more brokers")

    def opened(self, event: EpochOpened) -> None:
        self.open_state(event)
        self.books.emit(event)

    def open_state(self, event: EpochOpened) -> EpochState:
        """The epoch's state, new: :meth:`opened` without the event observed (an EPOCH_RECOVER's own is)."""
        ep = self.books.stream(event.stream).epochs[event.epoch] = EpochState(event.epoch, event.partitions,
                                                                              event.delivery, commit=event.commit)
        return ep

    def close_epoch(self, name: str, number: int, partitions: int, expected: int | None = None) -> list[int]:
        """EPOCH_CLOSE, once the ``expected`` partitions streamed through this broker are committed (all of them
        with one broker; this broker's share with several). Returns the partitions that diverged.

        ``partitions`` is the epoch's count. It may be lower than EPOCH_OPEN's, which was then an upper bound: a
        driver that learns the count from its job's results (on Spark Connect, which has no RDD to ask) opens
        with :data:`MAX_PARTITIONS`. The epoch then has ``partitions`` partitions, provided that nothing arrived
        for a partition past them.

        Raises:
            ProtocolError: the epoch is not open, partitions are missing, more partitions than it was opened
                with, or batches, commits or claims of partitions past ``partitions``.
        """
        _, ep = self.books.epoch(name, number)
        committed = ep.committed
        beyond = sorted(n for n in {*ep.parts, *ep.claims} if n >= partitions)
        if partitions > ep.partitions or beyond:
            past = f": partitions {beyond[:10]}{'...' if len(beyond) > 10 else ''} are past that" if beyond else ""
            raise ProtocolError(f"stream {name!r} epoch {number}: {len(committed)} of {ep.partitions} "
                                f"partitions committed, and the driver closes it with {partitions}{past}")
        expected = partitions if expected is None else expected
        if len(committed) != expected:
            missing = list(itertools.islice((p for p in range(partitions) if p not in committed), 10))
            if expected == partitions:
                raise ProtocolError(f"stream {name!r} epoch {number}: {len(committed)} of {partitions} "
                                    f"partitions committed (missing {missing}{'...' if len(missing) == 10 else ''})")
            raise ProtocolError(f"stream {name!r} epoch {number}: {len(committed)} of the {expected} partitions "
                                f"streamed through this broker are committed")
        lowered = partitions < ep.partitions
        if lowered:
            log.info("stream %r epoch %d: %d partitions (opened with at most %d)", name, number, partitions,
                     ep.partitions)
        self.closed(EpochClosed(name, number, partitions if lowered else None))
        log.info("stream %r epoch %d closed: %d batches, %d rows", name, number, ep.batches_in, ep.rows_in)
        return ep.diverged

    def closed(self, event: EpochClosed) -> None:
        ep = self.books.streams[event.stream].epochs[event.epoch]
        if event.partitions is not None:
            ep.partitions = event.partitions       # EPOCH_OPEN's was an upper bound (journalled with the close)
        ep.closed = True
        self.books.emit(event)

    # ---- batches and partitions -------------------------------------------------------------------------

    def arrived(self, event: BatchArrived) -> list[Reply]:
        """Keep, forward or drop one validated BATCH: the applier of :class:`~broker.events.BatchArrived`. Observers
        hear of it once taken, with ``kept`` (the journal: its header, ``header_bytes`` or ``frames[0]``'s, and its
        payload if kept). Returns the commits it completes.

        Raises:
            Rejected: no such open epoch, out-of-range numbers, or the same attempt sent this seq before.
        """
        header, frames = event.header, event.frames
        books = self.books
        stream = books.streams.get(header["stream"])
        ep = stream.epochs.get(header["epoch"]) if stream else None
        if stream is None or ep is None:
            late = stream is not None and header["epoch"] in stream.finished
            raise Rejected("late_duplicate" if late else "unknown_epoch",
                           f"stream {header['stream']!r} epoch {header['epoch']} is not open")
        number, seq, attempt, checksum = header["part"], header["seq"], header["attempt"], header["checksum"]
        if not 0 <= number < ep.partitions or seq < 0 or attempt < 0:
            raise Rejected("out_of_range", f"partition {number} seq {seq} attempt {attempt}")
        rec = ep.recovery
        if rec is not None and number not in rec.carries:
            splits = header.get("splits")
            ep.unassigned += 1 if splits is None else len(splits)
            raise Rejected("unassigned", f"partition {number} of recovering epoch {ep.epoch} is not carried here")
        part = ep.part(number)
        seen = part.attempts.get(attempt)
        if seen is None:
            if len(part.attempts) >= MAX_ATTEMPTS:
                raise Rejected("refused", f"partition {number} of epoch {ep.epoch} has {MAX_ATTEMPTS} attempts "
                                          f"already: attempt {attempt} is refused")
            seen = part.attempts[attempt] = set()
        if seq in seen:
            raise Rejected("replayed", f"attempt {attempt} sent partition {number} seq {seq} twice")
        seen.add(seq)
        known = part.checksums.get(seq)
        if known is not None and known != checksum and not part.diverged:
            part.diverged = True
            self._warn_diverged(stream.name, ep, number)
        keep = part.committed_attempt is None and (known is None or ep.delivery == "atomic")
        if keep:
            splits = header.get("splits")
            batch = HeldBatch((header["epoch"], number, seq), frames, sum(map(len, frames)), header["rows"],
                              count=1 if splits is None else len(splits), bucket=header.get("bucket"))
            part.checksums.setdefault(seq, checksum)
            atomic = ep.delivery == "atomic"
            books.keep(batch.nbytes, atomic)
            if atomic:
                part.held.setdefault(attempt, []).append(batch)
            elif rec is not None and number in rec.recovered:
                self.matching.take(stream, ep, batch)
            else:
                ep.take(batch)
        else:
            ep.count_duplicate()        # a retried or speculative attempt: the first copy is the one kept
            if known is None:
                part.diverged = True    # a seq the committed attempt never sent
        if books.observers:              # every batch taken (its payload if kept): the journal's
            event.kept = keep
            books.emit(event)
        pending = part.pending.get(attempt)
        if pending is not None and len(seen) >= pending.batches:
            return self._attempt_complete(stream, ep, number, attempt)
        return []

    def claim_partition(self, h: PartitionClaimHeader) -> int:
        """PARTITION_CLAIM: which broker streams a partition, decided once by its home broker. The first attempt's
        choice holds for every later attempt (a retry or speculative copy must go where the first copy's batches
        went). Raises :class:`ProtocolError` for an epoch not open or numbers out of range."""
        stream, ep = self.books.epoch(h["stream"], h["epoch"])
        number, choice = h["part"], h["broker"]
        if not 0 <= number < ep.partitions or choice < 0:
            raise ProtocolError(f"partition {number} or broker {choice} out of range for epoch {ep.epoch}")
        if ep.recovery is not None:
            raise ProtocolError(f"stream {stream.name!r} epoch {ep.epoch} is recovering: the driver fixed the routes "
                                f"of its partitions, claims are refused")
        self.claimed(PartitionClaimed(stream.name, ep.epoch, number, choice))
        return ep.claims[number]

    def claimed(self, event: PartitionClaimed) -> None:
        claims = self.books.streams[event.stream].epochs[event.epoch].claims
        if event.part not in claims:
            claims[event.part] = event.broker
            self.books.emit(event)

    def end_partition(self, identity: bytes, h: PartitionEndHeader) -> list[Reply]:
        """A task's PARTITION_END: commit now if all its batches are here, else when the last one comes.

        Returns the replies owed: PARTITION_COMMITTED, or ERROR if the attempt's count differs. Raises
        :class:`ProtocolError` for an epoch not open or a partition out of range.
        """
        stream, ep = self.books.epoch(h["stream"], h["epoch"])
        number, attempt = h["part"], h["attempt"]
        if not 0 <= number < ep.partitions:
            raise ProtocolError(f"partition {number} is outside epoch {ep.epoch}'s {ep.partitions} partitions")
        if ep.recovery is not None and number not in ep.recovery.carries:
            raise ProtocolError(f"partition {number} of recovering epoch {ep.epoch} is not carried by this broker")
        part = ep.part(number)
        if attempt not in part.pending and len(part.pending) >= MAX_ATTEMPTS:
            raise ProtocolError(f"partition {number} of epoch {ep.epoch} has {MAX_ATTEMPTS} attempts waiting for "
                                f"their batches already: attempt {attempt}'s PARTITION_END is refused (Spark retries "
                                f"a partition a few times; so many attempts is a bug of the sender)")
        part.pending[attempt] = PendingCommit(identity, h["req"], h["batches"], h["rows"])
        if part.committed_attempt is not None or len(part.attempts.get(attempt, ())) >= h["batches"]:
            return self._attempt_complete(stream, ep, number, attempt)
        return []

    def _attempt_complete(self, stream: StreamState, ep: EpochState, number: int, attempt: int) -> list[Reply]:
        """Every batch an attempt said it sent is here (or the partition is committed already). In an epoch the
        tasks commit (``commit="end"``), that commits it; in one the driver commits, it is only *complete*: its
        input may have been cut short (an executor lost mid-partition ends the Python worker's input as if it were
        whole), so only Spark's word commits it (:meth:`commit_partitions`), and the task is told it was received."""
        if ep.commit == "end":
            return self.committed(PartitionCommitted(stream.name, ep.epoch, number, attempt))
        part = ep.part(number)
        pending = part.pending.pop(attempt)
        got = len(part.attempts.get(attempt, ()))
        if part.committed_attempt is None and got != pending.batches:
            return [Reply(pending.identity, Kind.ERROR, {
                "req": pending.req, "code": ErrorCode.REFUSED, "reason": f"partition {number} of epoch "
                f"{ep.epoch}: the broker holds {got} batches of attempt {attempt}, the task says it sent "
                f"{pending.batches}"})]
        if part.committed_attempt is None:
            part.complete.add(attempt)
        elif part.committed_attempt != attempt:
            ep.superseded += 1           # complete after Spark chose another attempt (a losing speculative copy)
        return [Reply(pending.identity, Kind.PARTITION_RECEIVED, {"req": pending.req, "stream": stream.name,
                                                                  "epoch": ep.epoch, "part": number,
                                                                  "attempt": attempt})]

    def commit_partitions(self, name: str, number: int, parts: list[Any]) -> list[int]:
        """PARTITION_COMMIT: the driver names, for each partition, the attempt Spark declared successful and the
        batches it sent (``[part, attempt, batches, ...]``, at most :data:`~broker.protocol.MAX_COMMITS` triplets).
        Each is committed if every one of those batches is here; a partition committed already (the same attempt
        again, or, in an epoch the tasks commit, whichever ended first) is left as it is. Returns the partitions
        not committed because their batches are not all here (a broker that lost them: the driver recovers them).

        Raises:
            ProtocolError: the epoch is not open, or ``parts`` is not a list of such triplets in range.
        """
        stream, ep = self.books.epoch(name, number)
        if len(parts) % 3 or len(parts) > 3 * protocol.MAX_COMMITS or any(type(v) is not int for v in parts):
            raise ProtocolError(f"PARTITION_COMMIT's parts must be at most {protocol.MAX_COMMITS} triplets of ints "
                                f"[part, attempt, batches]")
        missing = []
        for i in range(0, len(parts), 3):
            part_number, attempt, batches = parts[i:i + 3]
            if not 0 <= part_number < ep.partitions or attempt < 0 or batches < 0:
                raise ProtocolError(f"partition {part_number}, attempt {attempt}, {batches} batches: out of range "
                                    f"for epoch {number}")
            if ep.recovery is not None and part_number not in ep.recovery.carries:
                missing.append(part_number)
                continue
            part = ep.part(part_number)
            if part.committed_attempt is not None:
                if part.committed_attempt != attempt:
                    log.warning("stream %r epoch %d partition %d: Spark declared attempt %d successful, attempt %d "
                                "was committed first", name, number, part_number, attempt, part.committed_attempt)
                continue
            if len(part.attempts.get(attempt, ())) < batches:
                missing.append(part_number)
                continue
            self.committed(PartitionCommitted(name, number, part_number, attempt))
        if missing:
            log.warning("stream %r epoch %d: the driver committed partitions %s whose batches this broker does not "
                        "hold (all of them): they are fed again", name, number, missing[:10])
        return missing

    def committed(self, event: PartitionCommitted) -> list[Reply]:
        """Commit ``event.attempt`` of a partition unless one is committed already; answer its PARTITION_END if one
        waits (live; replayed commits have none). The first attempt to commit wins."""
        stream = self.books.streams[event.stream]
        ep, number, attempt = stream.epochs[event.epoch], event.part, event.attempt
        part = ep.part(number)
        pending = part.pending.pop(attempt, None)
        if part.committed_attempt is None:
            got = len(part.attempts.get(attempt, ()))
            if pending is not None and got != pending.batches:
                return [Reply(pending.identity, Kind.ERROR, {
                    "req": pending.req, "code": ErrorCode.REFUSED, "reason": f"partition {number} of epoch "
                    f"{ep.epoch}: the broker holds {got} batches of attempt {attempt}, the task says it sent "
                    f"{pending.batches}"})]
            part.committed_attempt = attempt
            part.complete.discard(attempt)
            ep.superseded += len(part.complete)      # complete too, but Spark chose this one
            part.complete.clear()
            self.books.emit(event)
            if ep.delivery == "atomic":
                recovered = ep.recovery is not None and number in ep.recovery.recovered
                for batch in sorted(part.held.pop(attempt, []), key=lambda b: b.id):
                    self.books.unhold(batch.nbytes)
                    if recovered:
                        self.matching.take(stream, ep, batch)
                    else:
                        ep.take(batch)
            elif set(part.checksums) != set(range(got)):
                part.diverged = True
        for loser in list(part.held):          # atomic: other attempts' copies are not needed any more
            self.books.drop(part.held.pop(loser), held=True)
        if pending is None:
            return []
        return [Reply(pending.identity, Kind.PARTITION_COMMITTED,
                      {"req": pending.req, "stream": stream.name, "epoch": ep.epoch, "part": number})]

    def _warn_diverged(self, stream: str, ep: EpochState, number: int) -> None:
        if ep.delivery == "atomic":
            log.info("stream %r epoch %d partition %d: attempts produced different batches; atomic delivery "
                     "forwards only the committed attempt's", stream, ep.epoch, number)
        else:
            log.warning("stream %r epoch %d partition %d: a retried or speculative task produced different "
                        "batches than the copy already forwarded (Spark recomputed it in another order?). Rows of "
                        "this partition may be missing or repeated; feed with delivery='atomic' for exactly-once",
                        stream, ep.epoch, number)


def delivered_runs(finished: DeliveredEpochs) -> int:
    """How many runs of consecutive numbers a stream's delivered epochs make: its ranges and the epochs that keep
    their figures (not folded into the ranges yet), together."""
    runs, reach = 0, -1
    for start, stop in sorted([*finished.ranges.pairs(), *((n, n + 1) for n in finished.figures)]):
        if start > reach:              # epochs are not negative: the first span starts a run
            runs += 1
        reach = max(reach, stop)
    return runs


def check_modes(delivery: str, commit: str) -> None:
    """Raise :class:`ProtocolError` for a delivery or commit mode this broker does not know."""
    if delivery not in protocol.DELIVERY_MODES:
        raise ProtocolError(f"delivery {delivery!r} is not one of {', '.join(protocol.DELIVERY_MODES)}")
    if commit not in protocol.COMMIT_MODES:
        raise ProtocolError(f"commit {commit!r} is not one of {', '.join(protocol.COMMIT_MODES)}")


__all__ = ["Partitions", "Rejected", "Reply", "MAX_PARTITIONS", "MAX_OPEN_EPOCHS", "MAX_BROKER_EPOCHS",
           "MAX_DELIVERED_RUNS", "MAX_ATTEMPTS", "check_modes"]
