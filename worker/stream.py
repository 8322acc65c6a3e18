"""``BatchStream``: a rank's end of the bus. Batches arrive against credits and are yielded epoch by epoch."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import zmq

from broker import protocol
from broker.address import broker_addresses
from broker.codec import decode_batch
from broker.protocol import Kind

from . import collectives, rebalance
from .connection import BatchId, BrokerConnection

log = logging.getLogger("sparkbus.worker")

Batch = dict[str, Any]     # numpy arrays, masked arrays and RaggedColumns
DEFAULT_PREFETCH_BYTES = 8 << 20
ROUND_BATCHES = 8       # even ranks short of data wait for a round of this many batches, or half a byte window,
ROUND_LINGER = 0.02     # ... but no longer than this (seconds)


@dataclass
class EpochStats:
    """One epoch as this rank saw it."""

    epoch: int
    batches: int = 0
    rows: int = 0
    bytes: int = 0
    dropped_batches: int = 0    # left over to keep ranks even (at most size - 1 across all ranks)
    dropped_rows: int = 0
    wait_seconds: float = 0.0   # time the training loop waited for data (and for the other ranks to agree)
    seconds: float = 0.0        # from the first request of the epoch to its end


@dataclass
class StreamStats:
    """Totals over the epochs of a :class:`BatchStream`, and each epoch's figures in ``epochs``."""

    batches: int = 0
    rows: int = 0
    bytes: int = 0
    dropped_batches: int = 0
    dropped_rows: int = 0
    wait_seconds: float = 0.0
    first_batch_seconds: float = -1.0   # from the stream's start to its first batch (-1: none yet)
    skipped_batches: int = 0    # left unread when the loop broke out of an epoch early
    rejoins: int = 0            # times this rank joined the broker again (a lost connection, a restarted broker)
    epochs: list[EpochStats] = field(default_factory=list)

    def add(self, ep: EpochStats) -> None:
        self.epochs.append(ep)
        for name in ("batches", "rows", "bytes", "dropped_batches", "dropped_rows", "wait_seconds"):
            setattr(self, name, getattr(self, name) + getattr(ep, name))


def _rows_of(column: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a decoded column, without a copy, in the form the batch would have alone: a masked
    array only where those rows hold a null."""
    part = column[start:stop]
    if isinstance(part, np.ma.MaskedArray) and not part.mask.any():
        return part.data
    return part


class BatchStream:
    """Batches of one stream for this rank, as dicts of columns, one epoch at a time.

    A column is a numpy array for numbers of a fixed shape (``[n]``, or ``[n, k, ...]`` for arrays that share
    one length within the batch), a numpy masked array where such a column holds nulls in the batch, and a
    :class:`~worker.RaggedColumn` for binary, strings and arrays of varying length (or declared
    ``feed(..., ragged=[...])``). See docs/PROTOCOL.md, "Column layouts".

    Args:
        address: the broker's ranks address, e.g. ``tcp://broker-host:5556``; or several brokers' (a list, or a
            comma-separated string): the rank consumes from all of them, and an epoch ends when every broker has
            ended it. None: the variable ``SPARKBUS_RANKS_ADDRESS``.
        comm: an mpi4py communicator whose ranks consume the stream together, or None for one process.
        stream: the stream name the feeder used.
        prefetch, prefetch_bytes: the window granted to each broker: up to ``prefetch`` batches in flight to this
            rank (the one in use included), or as many as fit in ``prefetch_bytes`` (8 MiB), whichever admits
            more: many small batches, a few large ones. The defaults suit batches from 1 KiB to 16 MiB.
        even: yield the same number of batches on every rank of ``comm`` each epoch (default: when
            ``comm.size > 1``); at most ``size - 1`` batches per epoch are dropped, counted in ``stats``.
        timeout: seconds the broker may stay silent (it heartbeats while idle) before this rank gives up.
        verify: check each batch's XXH3-64 checksum.
        heartbeat: seconds between this rank's heartbeats while it waits.
        on_drop: called with each batch dropped to keep the ranks even.
        abort_on_error: when an exception leaves the ``with`` block on one rank of a communicator of size > 1,
            call ``comm.Abort(1)`` so that the other ranks are not left waiting in a collective forever.
        context: a ZeroMQ context to use (needed for ``inproc://`` addresses); by default a private one.
        key, broker_key: for a broker run with ``--auth``: this rank's ``.key_secret`` file (a key allowed in the
            ranks role) and the broker's ``.key`` file; default the variables ``SPARKBUS_KEY`` and
            ``SPARKBUS_BROKER_KEY`` (``mpiexec -genv`` passes them to every rank).
    Raises:
        BrokerError: the broker does not answer within ``timeout``, refuses this rank, or goes silent.

    The columns of a batch are read-only views of the received frames; copy one to modify it.
    """

    def __init__(self, address: str | Sequence[str] | None = None, comm: Any = None, stream: str = "train",
                 prefetch: int = 4, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, even: bool | None = None, timeout: float = 60.0, verify: bool = True, heartbeat: float = 1.0,
                 on_drop: Callable[[Batch], None] | None = None, abort_on_error: bool = True,
                 context: zmq.Context | None = None, key: str | None = None, broker_key: str | None = None):
        if prefetch < 1 or prefetch_bytes < 0:
            raise ValueError("prefetch must be at least 1 and prefetch_bytes not negative")
        self.address, self.comm, self.stream = address, comm, stream
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.even = (self.size > 1) if even is None else even
        if self.even and comm is None:
            self.even = False
        self.timeout, self.verify, self.heartbeat, self.on_drop = timeout, verify, heartbeat, on_drop
        self.prefetch, self.prefetch_bytes, self.abort_on_error = prefetch, prefetch_bytes, abort_on_error
        self.stats = StreamStats()
        self._holding: dict | None = None      # header of the batch the loop has now (acknowledged on next)
        self._end_seen = True                  # the current epoch's EPOCH_END arrived (or no epoch begun)
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._brokers: list[BrokerConnection] = []
        try:
            for broker in broker_addresses(address, "SPARKBUS_RANKS_ADDRESS"):
                self._brokers.append(BrokerConnection(broker, self._context, stream=stream, rank=self.rank,
                                                      size=self.size, even=self.even, prefetch=prefetch,
                                                      prefetch_bytes=prefetch_bytes, timeout=timeout,
                                                      heartbeat=heartbeat, key=key, broker_key=broker_key))
        except BaseException:
            self._close_connections()
            raise
        self._waiting = list(self._brokers)      # brokers that have not ended the current epoch yet
        self._source: dict[BatchId, BrokerConnection] = {}     # batch id -> where to acknowledge it
        self._unpacked: deque[tuple[dict, Batch]] = deque()    # the rest of a pack of small batches
        self._pack_left: dict[BatchId, int] = {}              # a pack's batches not yet acknowledged
        self._turn = 0
        self._started = time.monotonic()
        self._ep = EpochStats(epoch=-1)           # the epoch being read

    def _receive(self, block: bool) -> tuple[BrokerConnection, dict, list[zmq.Frame]] | None:
        """The next BATCH or EPOCH_END from a broker still in the current epoch, taking turns among them."""
        if len(self._waiting) == 1:
            broker = self._waiting[0]
            message = broker.receive(block)
            return None if message is None else (broker, *message)
        while True:
            for _ in range(len(self._waiting)):
                self._turn = (self._turn + 1) % len(self._waiting)
                broker = self._waiting[self._turn]
                message = broker.receive(block=False)
                if message is not None:
                    return (broker, *message)
            if not block:
                return None
            poller = zmq.Poller()
            for broker in self._waiting:
                poller.register(broker.socket, zmq.POLLIN)
            poller.poll(self.heartbeat * 1000)

    def _next_batch(self, ep: EpochStats, block: bool = True) -> tuple[dict, Batch] | None:
        """This rank's next batch of the epoch; the time waited is data-wait.

        None at the epoch's end (``self._end_seen`` is then true) or, with ``block=False``, when no batch has
        arrived yet.
        """
        if self._unpacked:
            return self._unpacked.popleft()
        started = time.monotonic()
        while True:
            message = self._receive(block)
            if message is None:
                return None
            broker, header, frames = message
            if header["kind"] == Kind.EPOCH_END:
                self._waiting.remove(broker)         # its later batches wait until every broker ended this epoch
                if self._waiting:
                    continue
                self._waiting = list(self._brokers)
                if ep.epoch < 0:                     # a rank that got no batch of the epoch (others had them all)
                    ep.epoch = header["epoch"]
                ep.wait_seconds += time.monotonic() - started
                self._end_seen = True
                return None
            batch_id = protocol.batch_id(header)
            if batch_id not in broker.received:
                break
            if batch_id not in broker.acked:
                broker.ack(batch_id, send=False)   # a redelivery of one we have: it counts as consumed
        broker.received.add(batch_id)
        ep.wait_seconds += time.monotonic() - started
        if ep.epoch < 0:
            ep.epoch = header["epoch"]
            if self.stats.first_batch_seconds < 0:
                self.stats.first_batch_seconds = time.monotonic() - self._started
                broker.report["first_batch_s"] = self.stats.first_batch_seconds
        columns = decode_batch(header, frames, verify=self.verify)
        nbytes = header["nbytes"] = sum(len(f) for f in frames)
        self._source[batch_id] = broker
        splits = header.get("splits")
        if splits is None:
            return header, columns
        # A pack of small batches: each is a slice (a view) of the pack's columns, acknowledged with the last.
        self._pack_left[batch_id] = len(splits)
        start = 0
        for rows in splits:
            share = nbytes * rows // header["rows"] if header["rows"] else 0
            self._unpacked.append((dict(header, rows=rows, nbytes=share),
                                   {k: _rows_of(v, start, start + rows) for k, v in columns.items()}))
            start += rows
        return self._unpacked.popleft()

    def _ack(self, header: dict, send: bool = True) -> None:
        batch_id = protocol.batch_id(header)
        left = self._pack_left.get(batch_id)
        if left is not None:
            if left > 1:
                self._pack_left[batch_id] = left - 1
                return
            del self._pack_left[batch_id]
        broker = self._source.pop(batch_id)
        if send:
            self._report(self._ep)
        broker.ack(batch_id, send)

    def _report(self, ep: EpochStats) -> None:
        # What this rank tells its brokers about itself (for monitoring): once per message, and with each flush.
        for broker in self._brokers:
            broker.report["consumed"] = self.stats.batches + ep.batches
            broker.report["wait_s"] = self.stats.wait_seconds + ep.wait_seconds

    def _service(self) -> None:
        for broker in self._brokers:
            broker.service()

    def _flush_acks(self, ep: EpochStats) -> None:
        self._report(ep)
        for broker in self._brokers:
            broker.flush()

    # ---- epochs -------------------------------------------------------------------------------------------

    def epoch(self) -> Iterator[Batch]:
        """Yield the next epoch's batches, each a ``dict[str, numpy.ndarray]``, until the broker ends it.

        A batch is acknowledged when the loop asks for the next one. With ``even``, every rank of ``comm``
        yields the same number of batches (ranks must all iterate the epoch, and if they stop early, all at
        the same step). Leaving an epoch early (``break``) acknowledges the batch in hand; the next call first
        skips what is left of that epoch on this rank, counted in ``stats.skipped_batches``.

        Raises:
            BrokerError: the broker goes silent for longer than ``timeout`` or reports an error.
            ProtocolError: a malformed batch (checksum or shape mismatch).
        """
        if not self._end_seen or self._unpacked:
            self._skip_rest_of_epoch()
        ep = self._ep = EpochStats(epoch=-1)
        started = time.monotonic()
        self._end_seen = False
        try:
            yield from (self._even_epoch(ep) if self.even else self._plain_epoch(ep))
        finally:
            if self._holding is not None:         # the loop left with a batch in hand: it was consumed
                self._ack(self._holding)
                self._holding = None
            self._flush_acks(ep)
            ep.seconds = time.monotonic() - started
            self.stats.add(ep)
            self.stats.rejoins = sum(b.rejoins for b in self._brokers)

    def _skip_rest_of_epoch(self) -> None:
        log.warning("rank %d left the previous epoch before its end; skipping its remaining batches", self.rank)
        ignored = EpochStats(epoch=-1)
        while (self._unpacked or not self._end_seen) and (item := self._next_batch(ignored)) is not None:
            self._ack(item[0], send=False)
            self.stats.skipped_batches += 1
        self._flush_acks(ignored)

    @staticmethod
    def _count(ep: EpochStats, header: dict, batch: Batch) -> None:
        ep.batches += 1
        ep.rows += header["rows"]
        nbytes = header.get("nbytes")         # not on a batch that came from another rank at the epoch's end
        ep.bytes += nbytes if nbytes is not None else sum(a.nbytes for a in batch.values())

    def _hand_over(self, ep: EpochStats, header: dict, batch: Batch) -> Iterator[Batch]:
        """Yield one batch to the loop; acknowledge it when the loop comes back for the next."""
        self._count(ep, header, batch)
        self._holding = header
        yield batch
        self._holding = None
        self._ack(header)

    def _plain_epoch(self, ep: EpochStats) -> Iterator[Batch]:
        while (item := self._next_batch(ep)) is not None:
            yield from self._hand_over(ep, *item)

    def _even_epoch(self, ep: EpochStats) -> Iterator[Batch]:
        # Lockstep in rounds: the ranks agree to take as many steps as the rank holding the fewest batches has.
        # A round longer than ROUND_BATCHES (the data keeps ahead) starts the next round's agreement before its
        # last step, on the batches each rank holds beyond it, so the agreement completes while the loop trains.
        # Otherwise, or when some rank holds nothing more (the data is late, or the epoch ends), the ranks agree
        # again at the round's end, waiting for a round's worth of batches each or the epoch's end; an agreement
        # of 0 then ends the rounds. Every agreement costs each rank a few wake-ups, so rounds are kept long.
        ready: deque[tuple[dict, Batch]] = deque()
        ahead: collectives.PendingMin | None = None
        try:
            while True:
                steps = 0
                if ahead is not None:
                    started = time.monotonic()
                    pending, ahead = ahead, None         # an error while waiting must not wait again below
                    steps = pending.result(idle=self._service)
                    ep.wait_seconds += time.monotonic() - started
                if steps == 0:
                    if not ready and not self._end_seen:
                        item = self._next_batch(ep)
                        if item is not None:
                            ready.append(item)
                    # Some rank ran short: agreements would come one step at a time while the data trickles in;
                    # hold on briefly for a round's worth instead.
                    self._take_arrived(ep, ready, until_full=True)
                    started = time.monotonic()
                    self._flush_acks(ep)        # nothing of ours may hold the broker back while we agree
                    steps = collectives.allreduce_min(self.comm, len(ready), idle=self._service)
                    ep.wait_seconds += time.monotonic() - started
                    if steps == 0:
                        break
                for step in range(steps - 1, -1, -1):
                    if step == 0 and steps > ROUND_BATCHES:
                        self._take_arrived(ep, ready)
                        self._flush_acks(ep)
                        ahead = collectives.PendingMin(self.comm, len(ready) - 1)
                    yield from self._hand_over(ep, *ready.popleft())
        except BaseException:                   # the loop left early (break, or an error)
            if ahead is not None:               # every rank posted it before this step
                ahead.result(idle=self._service)
            self._unpacked.extendleft(reversed(ready))      # the next epoch() skips and acknowledges these
            raise
        # Some rank's share is used up: gather what is left everywhere and share it out evenly.
        started = time.monotonic()
        held = list(ready)
        for header, _ in held:
            self._ack(header, send=False)
        if not self._end_seen:
            while (more := self._next_batch(ep)) is not None:
                held.append(more)
                self._ack(more[0], send=False)
        self._flush_acks(ep)
        counts = collectives.allgather_count(self.comm, len(held), idle=self._service)
        transfers, target = rebalance.plan_transfers(counts)
        held = rebalance.exchange(self.comm, held, transfers, idle=self._service)
        ep.wait_seconds += time.monotonic() - started
        for header, batch in held[target:]:
            ep.dropped_batches += 1
            ep.dropped_rows += header["rows"]
            if self.on_drop is not None:
                self.on_drop(batch)
        for header, batch in held[:target]:
            self._count(ep, header, batch)
            yield batch

    def _take_arrived(self, ep: EpochStats, ready: deque, until_full: bool = False) -> None:
        """Move the batches that have arrived to ``ready``. With ``until_full``, then wait up to ``ROUND_LINGER``
        seconds (in ``poll``, counted as data-wait) for it to hold a round's worth (:meth:`_round_full`) or for
        the epoch's end."""
        deadline = time.monotonic() + ROUND_LINGER
        while not self._end_seen:
            item = self._next_batch(ep, block=False)
            if item is not None:
                ready.append(item)
                continue
            started = time.monotonic()
            if self._end_seen or not until_full or started >= deadline or self._round_full(ready):
                return
            poller = zmq.Poller()
            for broker in self._waiting:
                poller.register(broker.socket, zmq.POLLIN)
            poller.poll(math.ceil((deadline - started) * 1000))      # whole ms: 0 would not wait at all
            ep.wait_seconds += time.monotonic() - started

    def _round_full(self, ready: deque) -> bool:
        """``ready`` holds ROUND_BATCHES batches, or as many as the window is sure to admit (``prefetch``) and
        half its bytes: more may not come until this rank consumes."""
        if len(ready) >= ROUND_BATCHES:
            return True
        return len(ready) >= self.prefetch and 2 * sum(h["nbytes"] for h, _ in ready) >= self.prefetch_bytes

    # ---- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the broker this rank leaves (its unacknowledged batches go to other ranks), then close."""
        if not self._brokers or self._brokers[0].closed:
            return
        try:
            for broker in self._brokers:
                broker.bye()
        finally:
            self._close_connections()

    def _close_connections(self) -> None:
        for broker in self._brokers:
            broker.close()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> "BatchStream":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.abort_on_error and self.comm is not None and self.size > 1:
            log.critical("rank %d failed: %r; aborting the MPI job so the other ranks do not wait forever",
                         self.rank, exc, exc_info=(exc_type, exc, tb))
            self.comm.Abort(1)
        self.close()
