"""What reaches a rank from its brokers, one batch at a time: :class:`Intake`.

A rank reads every broker of its stream (one :class:`~worker.connection.BrokerConnection` each), taking turns
among those that have not ended the current epoch; the epoch ends when every broker has ended it, and a broker's
batches of the next epoch wait until then. A pack of small batches arrives as one message and is cut here into
its batches (views of the received frames, no copy); it is acknowledged, once, when its last batch is. Every
batch is acknowledged to the broker that sent it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from broker import protocol
from broker.codec import decode_batch
from broker.protocol import Kind

from .connection import BatchId, BrokerConnection

if TYPE_CHECKING:                     # pragma: no cover
    from .stream import EpochStats, StreamStats

Batch = dict[str, Any]                # numpy arrays, masked arrays and RaggedColumns
Item = tuple[dict, Batch]             # a batch's header (its "rows", "nbytes", id fields) and its columns


def _rows_of(column: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a decoded column, without a copy, in the form the batch would have alone: a masked
    array only where those rows hold a null."""
    part = column[start:stop]
    if isinstance(part, np.ma.MaskedArray) and not part.mask.any():
        return part.data
    return part


class Intake:
    """A rank's batches from its brokers, epoch by epoch.

    Args:
        connections: one per broker, joined already.
        stats: the stream's totals (``first_batch_seconds`` is set here, at the first batch).
        figures: this rank's ``(consumed, wait_s)`` so far, told to the brokers with acknowledgements.
        verify: check each batch's checksum.
        heartbeat: seconds to wait in one poll for several brokers.
    """

    def __init__(self, connections: list[BrokerConnection], stats: StreamStats,
                 figures: Callable[[], tuple[int, float]], *, verify: bool, heartbeat: float):
        self.connections = connections
        self._stats, self._figures, self._verify, self._heartbeat = stats, figures, verify, heartbeat
        self._started = time.monotonic()
        self.end_seen = True                  # the current epoch's EPOCH_END arrived (or no epoch begun)
        self._waiting = list(connections)     # brokers that have not ended the current epoch yet
        self._turn = 0
        self._source: dict[BatchId, BrokerConnection] = {}     # batch id -> where to acknowledge it
        self._unpacked: deque[Item] = deque()                  # the rest of a pack, or batches put back
        self._pack_left: dict[BatchId, int] = {}               # a pack's batches not yet acknowledged

    @property
    def unfinished(self) -> bool:
        """Batches of the current epoch may still come: its end has not arrived, or some were put back."""
        return not self.end_seen or bool(self._unpacked)

    def begin_epoch(self) -> None:
        self.end_seen = False

    def put_back(self, items: deque[Item]) -> None:
        """Batches taken but not yielded, to be read again first (the next epoch skips and acknowledges them)."""
        self._unpacked.extendleft(reversed(items))

    # ---- receiving ------------------------------------------------------------------------------------------

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
            self.poll(int(self._heartbeat * 1000))

    def poll(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for a message from any broker still in the current epoch."""
        poller = zmq.Poller()
        for broker in self._waiting:
            poller.register(broker.socket, zmq.POLLIN)
        poller.poll(timeout_ms)

    def next_batch(self, ep: EpochStats, block: bool = True) -> Item | None:
        """This rank's next batch of the epoch; the time waited is data-wait, counted in ``ep``.

        None at the epoch's end (:attr:`end_seen` is then true) or, with ``block=False``, when no batch has
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
                self._waiting = list(self.connections)
                if ep.epoch < 0:                     # a rank that got no batch of the epoch (others had them all)
                    ep.epoch = header["epoch"]
                ep.wait_seconds += time.monotonic() - started
                self.end_seen = True
                return None
            batch_id = protocol.batch_id(header)
            if broker.arrived(batch_id):
                break
        ep.wait_seconds += time.monotonic() - started
        if ep.epoch < 0:
            ep.epoch = header["epoch"]
            if self._stats.first_batch_seconds < 0:
                self._stats.first_batch_seconds = time.monotonic() - self._started
                broker.report(first_batch_s=self._stats.first_batch_seconds)
        columns = decode_batch(header, frames, verify=self._verify)
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

    # ---- acknowledging --------------------------------------------------------------------------------------

    def ack(self, header: dict, send: bool = True) -> None:
        """The loop is done with this batch: acknowledge it (a pack: with its last batch) to the broker that
        sent it. ``send=False`` keeps it for the next :meth:`flush`."""
        batch_id = protocol.batch_id(header)
        left = self._pack_left.get(batch_id)
        if left is not None:
            if left > 1:
                self._pack_left[batch_id] = left - 1
                return
            del self._pack_left[batch_id]
        broker = self._source.pop(batch_id)
        if send:
            self._report()
        broker.ack(batch_id, send)

    def _report(self) -> None:
        # What this rank tells its brokers about itself (for monitoring): once per message, and with each flush.
        consumed, wait_s = self._figures()
        for broker in self.connections:
            broker.report(consumed=consumed, wait_s=wait_s)

    def flush(self) -> None:
        """Send every acknowledgement that waits, with this rank's figures."""
        self._report()
        for broker in self.connections:
            broker.flush()

    def service(self) -> None:
        """Keep every broker connection alive while the rank waits for its peers (heartbeats, a rejoin)."""
        for broker in self.connections:
            broker.service()
