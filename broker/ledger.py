"""The broker's rules for batches, partitions and epochs, without sockets: what to keep, forward, commit.

The daemon calls these with validated headers and sends whatever replies they return. The journal records
the same transitions, and :meth:`Ledger.replay` runs them again after a restart.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Any, Callable, Iterable, NamedTuple

from . import protocol
from .errors import ProtocolError
from .journal import DeliveredEpochs, Journal, Record
from .protocol import ErrorCode, Kind
from .state import MAX_WINDOW, BatchId, EpochState, HeldBatch, Orphan, PendingCommit, RankState, StreamState

log = logging.getLogger("sparkbus.broker")

MAX_STREAMS = 4096            # a peer cannot make the broker track streams without bound
MAX_STREAM_NAME = 256
MAX_PARTITIONS = 10_000_000
MAX_WINDOW_BYTES = 1 << 40
REPORTED = ("wait_s", "first_batch_s", "consumed")      # a rank's own figures (protocol.OPTIONAL of ACK)


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


class MissedEnd(NamedTuple):
    """An epoch that ended while a rank was away: what to send it again, then ``EPOCH_END(epoch, batches)``."""

    epoch: int
    batches: int
    resend: list[HeldBatch]      # batches of the epoch sent into its lost connection, now in flight to it again


class Ledger:
    """Streams, epochs, partitions and ranks: every decision about a batch. The daemon only moves frames."""

    def __init__(self, journal: Journal | None = None, rejoin_grace: float = 10.0):
        self.journal = journal
        self.rejoin_grace = rejoin_grace
        self.streams: dict[str, StreamState] = {}
        self.ranks: dict[bytes, RankState] = {}      # by connection identity on the ranks socket
        self.buffered = 0          # bytes of batches held: queued, in flight, or awaiting an atomic commit
        self.held_bytes = 0        # of which: batches of uncommitted partitions in atomic delivery

    def stream(self, name: str) -> StreamState:
        stream = self.streams.get(name)
        if stream is None:
            if len(name) > MAX_STREAM_NAME or not name:
                raise ProtocolError(f"a stream name must have 1 to {MAX_STREAM_NAME} characters")
            if len(self.streams) >= MAX_STREAMS:
                raise ProtocolError(f"the broker already tracks {MAX_STREAMS} streams")
            stream = self.streams[name] = StreamState(name)
        return stream

    def epoch(self, name: str, number: int) -> tuple[StreamState, EpochState]:
        stream = self.streams.get(name)
        ep = stream.epochs.get(number) if stream else None
        if ep is None or ep.closed:
            raise ProtocolError(f"stream {name!r} epoch {number} is not open (if the broker restarted without "
                                f"--journal, it lost this epoch: feed it again)")
        return stream, ep

    # ---- epochs -----------------------------------------------------------------------------------------

    def open_epoch(self, name: str, number: int, partitions: int, delivery: str) -> None:
        if not 0 <= partitions <= MAX_PARTITIONS or number < 0:
            raise ProtocolError(f"epoch {number} with {partitions} partitions is out of range")
        if delivery not in protocol.DELIVERY_MODES:
            raise ProtocolError(f"delivery {delivery!r} is not one of {', '.join(protocol.DELIVERY_MODES)}")
        stream = self.stream(name)
        if number in stream.finished or (number in stream.epochs and stream.epochs[number].end_sent):
            raise ProtocolError(f"stream {name!r} has already delivered epoch {number}; "
                                f"feed a new epoch number or a new stream name")
        ep = stream.epochs.get(number)
        if ep is None:
            stream.epochs[number] = EpochState(number, partitions, delivery)
            if self.journal:
                self.journal.record_open(name, number, partitions, delivery)
            log.info("stream %r epoch %d opened: %d partitions, %s delivery", name, number, partitions, delivery)
        elif ep.partitions != partitions or ep.delivery != delivery or ep.closed:
            raise ProtocolError(f"stream {name!r} epoch {number} is already open with {ep.partitions} "
                                f"partitions and {ep.delivery} delivery")

    def close_epoch(self, name: str, number: int, partitions: int, expected: int | None = None) -> list[int]:
        """Close an epoch once the ``expected`` partitions streamed through this broker are committed (all of
        them with one broker; this broker's share with several). Returns the partitions that diverged."""
        stream, ep = self.epoch(name, number)
        expected = ep.partitions if expected is None else expected
        if partitions != ep.partitions or len(ep.committed) != expected:
            missing = list(itertools.islice((p for p in range(ep.partitions) if p not in ep.committed), 10))
            if expected == ep.partitions:
                raise ProtocolError(f"stream {name!r} epoch {number}: {len(ep.committed)} of {ep.partitions} "
                                    f"partitions committed (missing {missing}{'...' if len(missing) == 10 else ''})")
            raise ProtocolError(f"stream {name!r} epoch {number}: {len(ep.committed)} of the {expected} partitions "
                                f"streamed through this broker are committed")
        ep.closed = True
        if self.journal:
            self.journal.record_close(name, number)
        log.info("stream %r epoch %d closed: %d batches, %d rows", name, number, ep.batches_in, ep.rows_in)
        return ep.diverged

    # ---- batches and partitions -------------------------------------------------------------------------

    def accept_batch(self, header: dict, frames: list[Any], header_bytes: bytes | None = None) -> list[Reply]:
        """Keep, forward or drop one validated BATCH. ``header_bytes`` given means: journal it (live traffic).

        Raises:
            Rejected: no such open epoch, out-of-range numbers, or the same attempt sent this seq before.
        """
        stream = self.streams.get(header["stream"])
        ep = stream.epochs.get(header["epoch"]) if stream else None
        if ep is None:
            late = stream is not None and header["epoch"] in stream.finished
            raise Rejected("late_duplicate" if late else "unknown_epoch",
                           f"stream {header['stream']!r} epoch {header['epoch']} is not open")
        number, seq, attempt, checksum = header["part"], header["seq"], header["attempt"], header["checksum"]
        if not 0 <= number < ep.partitions or seq < 0 or attempt < 0:
            raise Rejected("out_of_range", f"partition {number} seq {seq} attempt {attempt}")
        part = ep.part(number)
        seen = part.attempts.setdefault(attempt, set())
        if seq in seen:
            raise Rejected("replayed", f"attempt {attempt} sent partition {number} seq {seq} twice")
        seen.add(seq)
        known = part.checksums.get(seq)
        if known is not None and known != checksum and not part.diverged:
            part.diverged = True
            self._warn_diverged(stream.name, ep, number)
        keep = part.committed_attempt is None and (known is None or ep.delivery == "atomic")
        if self.journal and header_bytes is not None:
            self.journal.record_batch(stream.name, ep.epoch, header_bytes, frames[1:] if keep else [])
        if keep:
            splits = header.get("splits")
            batch = HeldBatch(protocol.batch_id(header), frames, sum(len(f) for f in frames), header["rows"],
                              count=1 if splits is None else len(splits))
            part.checksums.setdefault(seq, checksum)
            self.buffered += batch.nbytes
            if ep.delivery == "atomic":
                part.held.setdefault(attempt, []).append(batch)
                self.held_bytes += batch.nbytes
            else:
                self._enqueue(ep, batch)
        else:
            ep.duplicates += 1          # a retried or speculative attempt: the first copy is the one kept
            if known is None:
                part.diverged = True    # a seq the committed attempt never sent
        pending = part.pending.get(attempt)
        if pending is not None and len(seen) >= pending.batches:
            return self.commit(stream, ep, number, attempt)
        return []

    def _enqueue(self, ep: EpochState, batch: HeldBatch) -> None:
        ep.queue.append(batch)
        ep.batches_in += batch.count
        ep.bytes_in += batch.nbytes
        ep.rows_in += batch.rows

    def claim_partition(self, h: dict) -> int:
        """Which broker streams a partition, decided once by its home broker: the first attempt's choice holds
        for every later attempt (a retry or speculative copy must go where the first copy's batches went)."""
        stream, ep = self.epoch(h["stream"], h["epoch"])
        number, choice = h["part"], h["broker"]
        if not 0 <= number < ep.partitions or choice < 0:
            raise ProtocolError(f"partition {number} or broker {choice} out of range for epoch {ep.epoch}")
        if number not in ep.claims:
            ep.claims[number] = choice
            if self.journal:
                self.journal.record_claim(stream.name, ep.epoch, number, choice)
        return ep.claims[number]

    def end_partition(self, identity: bytes, h: dict) -> list[Reply]:
        """A task's PARTITION_END: commit now if all its batches are here, else when the last one comes."""
        stream, ep = self.epoch(h["stream"], h["epoch"])
        number, attempt = h["part"], h["attempt"]
        if not 0 <= number < ep.partitions:
            raise ProtocolError(f"partition {number} is outside epoch {ep.epoch}'s {ep.partitions} partitions")
        part = ep.part(number)
        part.pending[attempt] = PendingCommit(identity, h["req"], h["batches"], h["rows"])
        if part.committed_attempt is not None or len(part.attempts.get(attempt, ())) >= h["batches"]:
            return self.commit(stream, ep, number, attempt)
        return []

    def commit(self, stream: StreamState, ep: EpochState, number: int, attempt: int) -> list[Reply]:
        part = ep.parts[number]
        pending = part.pending.pop(attempt, None)
        if part.committed_attempt is None:
            got = len(part.attempts.get(attempt, ()))
            if pending is not None and got != pending.batches:
                return [Reply(pending.identity, Kind.ERROR, {
                    "req": pending.req, "code": ErrorCode.REFUSED, "reason": f"partition {number} of epoch {ep.epoch}: the broker holds "
                                                  f"{got} batches of attempt {attempt}, the task says it sent "
                                                  f"{pending.batches}"})]
            part.committed_attempt = attempt
            if self.journal and pending is not None:
                self.journal.record_commit(stream.name, ep.epoch, number, attempt)
            if ep.delivery == "atomic":
                for batch in sorted(part.held.pop(attempt, []), key=lambda b: b.id):
                    self.held_bytes -= batch.nbytes
                    self._enqueue(ep, batch)
            elif set(part.checksums) != set(range(got)):
                part.diverged = True
            ep.committed.add(number)
        for loser in list(part.held):          # atomic: other attempts' copies are not needed any more
            for batch in part.held.pop(loser):
                self.held_bytes -= batch.nbytes
                self.buffered -= batch.nbytes
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

    # ---- ranks ------------------------------------------------------------------------------------------

    def join_rank(self, identity: bytes, h: dict, held: Iterable[BatchId] = (),
                  consumed: Iterable[BatchId] = ()) -> list[MissedEnd]:
        """Admit a rank that said HELLO on the ranks socket, or take back one that rejoins.

        A rank that comes back (its ``session`` is known: a new connection of the same BatchStream, or any
        ``resume`` after a broker restart) names the batches of its current epoch that it ``held`` unacknowledged
        and those it ``consumed``. Those are neither requeued nor sent again: held ones are in flight to the new
        connection, consumed ones count as acknowledged. What the old connection had in flight beyond them never
        reached the rank and goes back to the queue.

        Returns:
            Each epoch that ended while a resuming rank was away, in order: its EPOCH_END may have been lost with
            the old connection, so it is sent again, after the batches of that epoch the old connection lost.
        Raises:
            ProtocolError: a rank number outside its communicator, a communicator size other than the stream's
                ranks have, or a rank number that another process (another session) holds connected.
        """
        size, number, name, session = h["size"], h["rank"], h["stream"], h["session"]
        if not 0 <= number < size:
            raise ProtocolError(f"rank {number} is outside a communicator of size {size}")
        stream = self.stream(name)
        current = self.ranks.get(identity)
        if current is not None and session and current.session == session and current.stream == name:
            return []                    # the same HELLO again on the same connection: nothing changes
        if current is not None:
            self.rank_gone(identity, "said hello again", keep=False)
        if stream.ranks and size != stream.expected_ranks:
            raise ProtocolError(f"stream {name!r} is consumed by {stream.expected_ranks} ranks; "
                                f"a rank of a communicator of size {size} cannot join it")
        previous = self._same_session(stream, session, number)
        if size > 1 and any(r.rank == number and r is not previous for r in stream.ranks.values()):
            raise ProtocolError(f"rank {number} of stream {name!r} is already connected",
                                ErrorCode.ALREADY_CONNECTED)
        for other, orphan in list(stream.orphans.items()):
            if size > 1 and orphan.rank.rank == number and other != session:
                del stream.orphans[other]          # another process took this rank number: the old one is gone
                self._requeue(stream, orphan.rank)
        if previous is not None:
            stream.orphans.pop(previous.session, None)
            if self.ranks.get(previous.identity) is previous:
                del self.ranks[previous.identity], stream.ranks[previous.identity]
        stream.expected_ranks = size
        rank = stream.ranks[identity] = self.ranks[identity] = RankState(identity, name, number, size,
                                                                         even=h["even"], session=session)
        if len(stream.ranks) >= stream.expected_ranks:
            stream.complete = True
        if previous is None and not h["resume"]:
            log.info("rank %d/%d joined stream %r", number, size, name)
            return []
        lost = self._reconcile(stream, rank, previous, set(held), set(consumed))
        stream.rejoins += 1
        missed = self._missed_ends(stream, h["ended"], lost)
        self._requeue_batches(stream, lost)      # what is left of them belongs to epochs still being delivered
        for batch in (b for m in missed for b in m.resend):
            rank.inflight[batch.id] = batch      # sent again below, beyond its window: it acknowledges them first
            rank.inflight_bytes += batch.nbytes
            batch.sends += 1
            stream.epochs[batch.id[0]].redelivered += batch.count
        log.info("rank %d/%d rejoined stream %r: %d batches stay with it, %d of its old connection's are requeued",
                 number, size, name, len(rank.inflight), len(lost))
        return missed

    def _same_session(self, stream: StreamState, session: str, number: int) -> RankState | None:
        """The earlier connection (live or orphaned) of the rank that says HELLO, if there is one."""
        if not session:
            return None
        orphan = stream.orphans.get(session)
        if orphan is not None and orphan.rank.rank == number:
            return orphan.rank
        return next((r for r in stream.ranks.values() if r.session == session and r.rank == number), None)

    def _reconcile(self, stream: StreamState, rank: RankState, previous: RankState | None, held: set[BatchId],
                   consumed: set[BatchId]) -> tuple[int, int]:
        """Give ``rank`` the batches it holds and acknowledge those it consumed.

        Returns the batches the old connection had in flight that never reached the rank.
        """
        inflight = previous.inflight if previous is not None else {}
        wanted = held | consumed
        found = {i: b for i, b in inflight.items() if i in wanted}
        missing = wanted - found.keys()
        if missing:                      # after a restart or a requeue they wait in a queue: take them out
            for ep in stream.epochs.values():
                if not any(b.id in missing for b in ep.queue):
                    continue
                rest: deque[HeldBatch] = deque()
                for batch in ep.queue:
                    if batch.id in missing:
                        found[batch.id] = batch
                        ep.batches_out += batch.count          # out again: to the rank that has it
                        ep.bytes_out += batch.nbytes
                    else:
                        rest.append(batch)
                ep.queue = rest
        late = missing - found.keys()
        if late:
            # Batches it had that are nowhere to take back from: its grace ran out and they went to another rank
            # (or were consumed there). Both ranks have them; say so, loudly, and count them.
            for epoch, _, _ in late:
                ep = stream.epochs.get(epoch)
                if ep is not None:
                    ep.given_twice += 1
            log.warning("rank %d of stream %r came back after --rejoin-grace: %d batches it held or consumed had "
                        "already gone to another rank and are trained twice (raise --rejoin-grace above the "
                        "longest outage to ride out)", rank.rank, stream.name, len(late))
        acked: list[HeldBatch] = []
        for batch_id, batch in found.items():
            if batch_id in held:
                rank.inflight[batch_id] = batch
                rank.inflight_bytes += batch.nbytes
            else:
                acked.append(batch)
                rank.inflight_bytes += batch.nbytes      # in flight to it for a moment: _consumed frees it
        self._consumed(stream, rank, acked)
        return [b for i, b in inflight.items() if i not in wanted]

    def _missed_ends(self, stream: StreamState, ended: int, lost: list[HeldBatch]) -> list[MissedEnd]:
        """Epochs after ``ended`` that ended meanwhile; lost batches of them move from ``lost`` to a resend."""
        ends = {n: s["batches_out"] for n, s in stream.finished.items() if n > ended}
        ends.update((n, e.batches_out) for n, e in stream.epochs.items() if n > ended and e.end_sent)
        missed = []
        for number, batches in sorted(ends.items()):
            resend = sorted((b for b in lost if b.id[0] == number), key=lambda b: b.id)
            missed.append(MissedEnd(number, batches, resend))
        if missed:
            rank_lost = {b.id for m in missed for b in m.resend}
            lost[:] = [b for b in lost if b.id not in rank_lost]
        return missed

    def rank(self, identity: bytes) -> RankState:
        """The rank on this connection. Raises :class:`ProtocolError` if it has not joined."""
        rank = self.ranks.get(identity)
        if rank is None:
            raise ProtocolError("unknown rank: send HELLO with role 'rank' first", ErrorCode.UNKNOWN_RANK)
        return rank

    def set_window(self, rank: RankState, batches: int, nbytes: int) -> None:
        """A rank says how much may be in flight to it: ``batches`` batches, or ``nbytes`` bytes of batches."""
        if not 0 <= batches <= MAX_WINDOW or not 0 <= nbytes <= MAX_WINDOW_BYTES:
            raise ProtocolError(f"a window of {batches} batches or {nbytes} bytes is outside 0..{MAX_WINDOW} "
                                f"batches and 0..{MAX_WINDOW_BYTES} bytes")
        rank.window, rank.window_bytes, rank.window_stated = batches, nbytes, True

    def report(self, rank: RankState, h: dict) -> None:
        """Keep the figures a rank reports about itself (data-wait, time to first batch, batches consumed)."""
        for name in REPORTED:
            if name in h:
                rank.reported[name] = h[name]

    def sent(self, rank: RankState, ep: EpochState, batch: HeldBatch) -> None:
        """A batch went out to ``rank``: it takes room in the rank's window until acknowledged."""
        batch.sends += 1
        if batch.sends > 1:
            ep.redelivered += batch.count
        rank.inflight[batch.id] = batch
        rank.inflight_bytes += batch.nbytes
        rank.batches += batch.count
        rank.bytes += batch.nbytes
        ep.batches_out += batch.count
        ep.bytes_out += batch.nbytes

    def acknowledge(self, rank: RankState, ids: list[Any]) -> int:
        """Forget acknowledged batches (``ids``: epoch, part, seq, epoch, part, seq, ...).

        Returns how many ids were not in flight to that rank.
        Raises:
            ProtocolError: ids that are not whole triples of integers.
        """
        if len(ids) % 3:
            raise ProtocolError(f"ACK ids must be (epoch, part, seq) triples, got {len(ids)} numbers")
        if not all(type(i) is int for i in ids):      # checked whole first: a refused ACK changes nothing
            raise ProtocolError("ACK ids must be integers")
        pop, consumed = rank.inflight.pop, []
        triples = iter(ids)
        for key in zip(triples, triples, triples):
            batch = pop(key, None)
            if batch is not None:
                consumed.append(batch)
        self._consumed(self.streams[rank.stream], rank, consumed)
        return len(ids) // 3 - len(consumed)

    def _consumed(self, stream: StreamState, rank: RankState, batches: list[HeldBatch]) -> None:
        """Batches that a rank has consumed: their bytes are free, and the journal remembers them."""
        if not batches:
            return
        freed = sum(b.nbytes for b in batches)
        self.buffered -= freed
        rank.inflight_bytes -= freed
        epochs = stream.epochs
        for batch in batches:
            rank.acked += batch.count
            ep = epochs.get(batch.id[0])
            if ep is not None:
                ep.acked += batch.count
        if self.journal:
            by_epoch: dict[int, list[list[int]]] = {}
            for batch in batches:
                by_epoch.setdefault(batch.id[0], []).append(list(batch.id))
            for number, acked in by_epoch.items():
                self.journal.record_acks(stream.name, number, acked)
        self.retire(stream)

    def rank_gone(self, identity: bytes, why: str, keep: bool = True) -> None:
        """Forget a rank's connection.

        With ``keep`` (the connection was lost, not closed with BYE) and batches in flight to it, the rank is an
        orphan for ``rejoin_grace`` seconds: its batches wait for it to come back on a new connection (it may be
        alive behind a cut link) and go back to the front of their queues only when the grace runs out, so that a
        rank that lives never sees them trained by another. Otherwise they go back at once.
        """
        rank = self.ranks.pop(identity, None)
        if rank is None:
            return
        stream = self.streams[rank.stream]
        del stream.ranks[identity]
        if not stream.ranks:
            stream.complete = False
            stream.expected_ranks = 0            # the next job may have another size
        if keep and rank.session and rank.inflight and self.rejoin_grace > 0:
            stream.orphans[rank.session] = Orphan(rank, time.monotonic() + self.rejoin_grace)
            log.info("rank %d of stream %r %s; its %d unacknowledged batches wait %g s for it to rejoin",
                     rank.rank, stream.name, why, len(rank.inflight), self.rejoin_grace)
            return
        self._requeue(stream, rank)
        log.info("rank %d of stream %r %s (%d unacknowledged batches requeued)", rank.rank, stream.name, why,
                 len(rank.inflight))

    def expire_orphans(self, now: float) -> None:
        """Requeue the batches of ranks that did not come back within the grace: they are dead."""
        for stream in self.streams.values():
            for session, orphan in list(stream.orphans.items()):
                if orphan.deadline <= now:
                    del stream.orphans[session]
                    self._requeue(stream, orphan.rank)
                    log.info("rank %d of stream %r did not rejoin within %g s: %d batches requeued",
                             orphan.rank.rank, stream.name, self.rejoin_grace, len(orphan.rank.inflight))

    def _requeue(self, stream: StreamState, rank: RankState) -> None:
        self._requeue_batches(stream, rank.inflight.values())
        self._reopen_if_abandoned(stream)

    def _requeue_batches(self, stream: StreamState, batches: Iterable[HeldBatch]) -> None:
        """Batches in flight that will not be acknowledged go back to the front of their queues, in order."""
        for batch in sorted(batches, key=lambda b: b.id, reverse=True):
            ep = stream.epochs[batch.id[0]]
            ep.queue.appendleft(batch)
            ep.batches_out -= batch.count
            ep.bytes_out -= batch.nbytes

    def _reopen_if_abandoned(self, stream: StreamState) -> None:
        # The consumers are all gone (a job died): epochs they had been told were over, but that still hold
        # unacknowledged batches, are delivered again to whoever joins next, remainder first.
        if not stream.ranks:
            for ep in stream.epochs.values():
                if ep.end_sent and ep.queue:
                    ep.end_sent = False

    def dispatch(self, stream: StreamState, send_batch: Callable[[RankState, HeldBatch], bool],
                 send_end: Callable[[RankState, EpochState], None]) -> None:
        """Hand queued batches of the delivering epoch to ranks with room; end the epoch once delivered.

        ``send_batch(rank, batch)`` does the I/O and says whether the batch left (a rank found gone on the way
        is reported through :meth:`rank_gone` by the caller); ``send_end`` tells one rank the epoch is over.
        """
        while stream.ready():
            ep = stream.delivering()
            if ep is None:
                return
            queue, ranks = ep.queue, stream.ranks
            rotation = stream.rotation() if queue else []
            by_bytes = stream.windows_known()
            progress = True
            while queue and progress:
                progress = False
                for rank in rotation:
                    if not queue:
                        break
                    batch = queue[0]
                    if rank.identity not in ranks or not rank.has_room(batch.nbytes, by_bytes):   # gone, or full
                        continue
                    queue.popleft()
                    if send_batch(rank, batch):
                        self.sent(rank, ep, batch)
                        progress = True
                    else:
                        queue.appendleft(batch)
            if not ep.delivered(stream.even()):
                return
            for rank in list(stream.ranks.values()):
                send_end(rank, ep)
            ep.end_sent = True
            log.info("stream %r epoch %d delivered to %d ranks", stream.name, ep.epoch, len(stream.ranks))
            self.retire(stream)

    def retire(self, stream: StreamState) -> None:
        """Drop epochs that ended and were fully acknowledged, keeping their counters."""
        for number, ep in list(stream.epochs.items()):
            if ep.end_sent and not ep.queue and ep.all_acked:
                stats = ep.stats()
                stream.finished[number] = stats
                del stream.epochs[number]
                if self.journal:
                    self.journal.record_retired(stream.name, number, stats)

    # ---- restart ----------------------------------------------------------------------------------------

    def replay(self) -> None:
        """Rebuild streams and epochs from the journal: committed and acknowledged state as it was."""
        assert self.journal is not None
        for record in self.journal.retired():
            stream = self.stream(record["stream"])
            if "delivered" in record:        # a compacted journal: epochs delivered long ago, figures dropped
                stream.finished = DeliveredEpochs(record["delivered"], stream.finished, self.journal.keep_stats)
            else:
                stream.finished[record["epoch"]] = record["stats"]
        restored = 0
        for replayed in self.journal.replay():
            stream = self.stream(replayed.stream)
            if replayed.epoch in stream.finished:
                continue
            acked: set[tuple[int, int, int]] = set()
            ep = None
            for record in replayed.records:
                kind = record["t"]
                if kind is Record.OPEN:
                    ep = stream.epochs[replayed.epoch] = EpochState(replayed.epoch, record["partitions"],
                                                                   record["delivery"])
                elif ep is None:
                    break
                elif kind is Record.BATCH:
                    header = protocol.unpack_header(record["header"])
                    try:
                        self.accept_batch(header, [record["header"], *record.get("payload", [])])
                    except Rejected:
                        pass
                elif kind is Record.COMMIT:
                    part = ep.part(record["part"])
                    if part.committed_attempt is None:
                        self.commit(stream, ep, record["part"], record["attempt"])
                elif kind is Record.CLOSE:
                    ep.closed = True
                elif kind is Record.CLAIM:
                    ep.claims.setdefault(record["part"], record["broker"])
                elif kind is Record.ACK:
                    acked.update(tuple(i) for i in record["ids"])
            if ep is None:
                continue
            kept = deque(b for b in ep.queue if b.id not in acked)
            done = [b for b in ep.queue if b.id in acked]
            self.buffered -= sum(b.nbytes for b in done)
            ep.queue, ep.acked = kept, sum(b.count for b in done)
            ep.batches_out = ep.acked
            restored += len(kept)
        log.info("journal replayed: %d epochs, %d unacknowledged batches to deliver",
                 sum(len(s.epochs) for s in self.streams.values()), restored)
