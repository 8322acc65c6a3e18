"""What reaches a rank from its brokers, one batch at a time: :class:`Intake`.

A rank reads every broker of its stream (one :class:`~worker.connection.BrokerConnection` each), taking turns
among those that have not ended the current epoch; the epoch ends when every broker has ended it, and a broker's
batches of the next epoch wait until then. A pack of small batches arrives as one message and is cut here into
its batches (views of the received frames, no copy); it is acknowledged, once, when its last batch is. Every
batch is acknowledged to the broker that sent it.

**Losses** (docs/design/RECOVERY.md, "The rank"). The intake records what the loop used of each connection in the
rank's current epoch (:meth:`Intake.note_used`). When a broker's incarnation is lost (a restart without journal,
seen in a rejoin's WELCOME; a ``LOST`` from another broker; silence past ``timeout`` while other brokers answer),
it drops that connection's unused batches (here and, through :attr:`Intake.forget`, in the step plan's buffers),
forgets its ids, moves what was used of it into the epoch's **lost entries**, and sends ``RECLAIM`` with all lost
entries of the epoch to every broker it still reads. A broker gone for good is closed and no longer waited for.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import zmq

from sparkbus.wire import protocol
from sparkbus.wire.codec import decode_batch
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.headers import BatchHeader, EpochEndHeader, LostHeader, ToIntake
from sparkbus.wire.protocol import RESUME_LOSS, Kind
from sparkbus.wire.records import BatchId, UsedCut, UsedEntry
from sparkbus.worker.connection import WHAT_TO_DO, BrokerConnection, BrokerSilent, Returned
from sparkbus.worker.stats import EpochStats, StreamStats
from sparkbus.worker.used import UsedBatches

Batch = dict[str, Any]                # numpy arrays, masked arrays and RaggedColumns


class Item(NamedTuple):
    """One batch as the rank holds it."""

    header: BatchHeader               # its "rows", "nbytes", id fields (a pack's batch: "index")
    batch: Batch


class Message(NamedTuple):
    """A message from a broker, and the connection it came on."""

    broker: BrokerConnection
    header: ToIntake
    frames: list[zmq.Frame]


log = logging.getLogger("sparkbus.worker")


def rows_of(column: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a decoded column, without a copy, in the form the batch would have alone: a masked
    array only where those rows hold a null."""
    part = column[start:stop]
    if isinstance(part, np.ma.MaskedArray) and not part.mask.any():
        return part.data
    return part


def _cut_rows(header: BatchHeader, columns: dict[str, Any], rows: tuple[int, int] | None) -> Item:
    """A batch, or the rows of it the broker sent this rank (``cut``, a piece of an epoch's remainder): its
    columns sliced without a copy, its header saying the rows (``rows``, and ``cut`` unless they are all)."""
    if rows is None:
        return Item(header, columns)
    lo, hi = rows
    if (lo, hi) == (0, header["rows"]):
        header.pop("cut", None)         # all of it (a pad's whole batch, or its repeat)
        return Item(header, columns)
    share = header["nbytes"] * (hi - lo) // header["rows"] if header["rows"] else 0
    return Item({**header, "rows": hi - lo, "nbytes": share}, {k: rows_of(v, lo, hi) for k, v in columns.items()})


class Waiting(NamedTuple):
    """The wait a rank's loop is in: since when (``time.monotonic()``), and whether for peers (equal steps)."""

    since: float
    for_peers: bool


class Intake:
    """A rank's batches from its brokers, epoch by epoch.

    Args:
        connections: one per broker, joined already.
        stats: the stream's totals (``first_batch_seconds`` is set here, at the first batch).
        figures: this rank's own figures so far (``consumed``, ``wait_s``, ``peer_wait_s``, ``step_s``), told to the
            brokers with acknowledgements.
        verify: check each batch's checksum.
        heartbeat: seconds to wait in one poll for several brokers.
    """

    def __init__(self, connections: list[BrokerConnection], stats: StreamStats,
                 figures: Callable[[], dict[str, float | int]], *, verify: bool, heartbeat: float,
                 progress_every: int = 4):
        self.connections = connections
        self._progress_every = max(progress_every, 1)
        self._stats, self._figures, self._verify, self._heartbeat = stats, figures, verify, heartbeat
        self._started = time.monotonic()
        self.end_seen = True                  # the current epoch's EPOCH_END arrived (or no epoch begun)
        self._waiting = list(connections)     # brokers that have not ended the current epoch yet
        self._turn = 0
        self._source: dict[BatchId, BrokerConnection] = {}     # batch id -> where to acknowledge it
        self._unpacked: deque[Item] = deque()                  # the rest of a pack, or batches put back
        self._pack_left: dict[BatchId, int] = {}               # a pack's batches not yet acknowledged
        self._pack_first: dict[BatchId, int] = {}              # ... and its first (a piece of a pack: > 0)
        self._pack_done: dict[BatchId, _PackProgress] = {}     # ... and how far its batches have been used
        self.current = -1                     # the rank's epoch: the latest with a batch or an end seen here
        self.lost = UsedBatches()             # the current epoch's lost entries (every loss's, and a resume's)
        self._elsewhere = UsedBatches()       # used batches of no connection of this rank (pooled at an end)
        self._handled: set[str] = set()       # incarnations whose loss this rank handled
        # The step plan's part in a loss: drop what it holds of a connection (the second argument: gone for good).
        self.forget: Callable[[BrokerConnection, bool], None] | None = None
        # the wait the loop is in (None: not waiting): when it began, and whether it is for peers (a grant); the
        # figures at each heartbeat count it, so that the brokers hear of a long wait while it lasts
        self.wait: Waiting | None = None
        for connection in connections:
            connection.figures_now = figures

    @property
    def unfinished(self) -> bool:
        """Batches of the current epoch may still come: its end has not arrived, or some were put back."""
        return not self.end_seen or bool(self._unpacked)

    @contextmanager
    def waiting(self, ep: EpochStats, for_peers: bool) -> Iterator[None]:
        """The loop waits in the block, for its peers or for data: told at each heartbeat while it lasts
        (:attr:`wait`), and counted in ``ep`` when it ends (with ``for_peers``, as a wait for peers too)."""
        started = time.monotonic()
        self.wait = Waiting(started, for_peers)
        try:
            yield
        finally:
            self.wait = None
            waited = time.monotonic() - started
            ep.wait_seconds += waited
            if for_peers:
                ep.peer_wait_seconds += waited

    def begin_epoch(self) -> None:
        self.end_seen = False

    def put_back(self, items: deque[Item]) -> None:
        """Batches taken but not yielded, to be read again first (the next epoch skips and acknowledges them)."""
        self._unpacked.extendleft(reversed(items))

    # ---- receiving ------------------------------------------------------------------------------------------

    def receive(self, block: bool) -> Message | None:
        """The next message (BATCH, EPOCH_END; STEPS, RELEASE) from a broker still in the current epoch, taking
        turns among them. Losses are handled on the way (``LOST``, a broker silent past its timeout); None also
        when the last broker still in the epoch was found gone (the epoch then ended: :attr:`end_seen`).

        Raises:
            BrokerError: every broker is silent past its timeout (or the only one is).
        """
        while True:
            try:
                message = self._take_turn(block)
            except BrokerSilent as silent:
                self._silent(silent)
                message = None
                if not self.end_seen:
                    continue
            if message is None:
                return None
            header = message.header
            if header["kind"] != Kind.LOST:
                return message
            self._lost(message.broker, header)
            if self.end_seen:                # the last broker still in the epoch was gone
                return None

    def _take_turn(self, block: bool) -> Message | None:
        if len(self._waiting) == 1:
            broker = self._waiting[0]
            message = broker.receive(block)
            return None if message is None else Message(broker, *message)
        while True:
            for _ in range(len(self._waiting)):
                self._turn = (self._turn + 1) % len(self._waiting)
                broker = self._waiting[self._turn]
                message = broker.receive(block=False)
                if message is not None:
                    return Message(broker, *message)
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
        # what waiting() does, by hand: this runs once a message, where a generator's context manager costs
        # microseconds; every way out counts the wait all the same
        started = time.monotonic()
        self.wait = Waiting(started, False)
        try:
            while True:
                message = self.receive(block)
                if message is None:
                    return None
                broker, header, frames = message
                if header["kind"] == Kind.EPOCH_END:
                    if self.ended(broker, header, ep):
                        return None
                elif header["kind"] == Kind.RELEASE:     # granted steps, while this rank skips the rest of an epoch
                    broker.give_back(header["epoch"], [], kept=broker.got + broker.adopted)
                elif header["kind"] == Kind.BATCH:      # not STEPS: nothing to wait for when batches come as they come
                    items = self.unpack(broker, header, frames, ep)
                    if items:
                        break
        finally:
            self.wait = None
            ep.wait_seconds += time.monotonic() - started
        self._unpacked.extend(items)
        return self._unpacked.popleft()

    def ended(self, broker: BrokerConnection, header: EpochEndHeader, ep: EpochStats) -> bool:
        """``broker``'s EPOCH_END: whether every broker has now ended the epoch (:attr:`end_seen`)."""
        self._enter(header["epoch"])
        self._waiting.remove(broker)         # its later batches wait until every broker ended this epoch
        if self._waiting:
            return False
        if ep.epoch < 0:                     # a rank that got no batch of the epoch (others had them all)
            ep.epoch = header["epoch"]
        self._end_epoch()
        return True

    def _end_epoch(self) -> None:
        self._waiting = list(self.connections)
        self.end_seen = True

    def source(self, header: BatchHeader) -> BrokerConnection:
        """The broker a batch this rank holds came from."""
        return self._source[protocol.batch_id(header)]

    def source_of(self, header: BatchHeader) -> BrokerConnection | None:
        """The broker a batch this rank holds came from, None if it no longer knows (acknowledged, or lost)."""
        return self._source.get(protocol.batch_id(header))

    def unpack(self, broker: BrokerConnection, header: BatchHeader, frames: list[zmq.Frame],
               ep: EpochStats) -> list[Item]:
        """A BATCH's batches, decoded: one, or the batches of a pack (views of its frames, no copy); none if
        this rank had it already (:meth:`BrokerConnection.arrived`).

        Raises:
            ProtocolError: a malformed batch (checksum or shape mismatch, a bad ``take``).
        """
        batch_id = protocol.batch_id(header)
        first, stop = protocol.taken_range(header)
        rows_cut = protocol.row_cut(header)
        if 0 <= self.current < header["epoch"] and broker.ended < self.current:
            raise BrokerError(
                f"the broker at {broker.address} sent a batch of epoch {header['epoch']} while this rank is in epoch "
                f"{self.current}, which that broker never ended: it restarted without its journal, lost epoch "
                f"{self.current}, and no driver fed it again (a feed() that has returned does not watch its epoch; "
                f"feed_epochs watches every epoch it fed until delivered). The rows it held of epoch "
                f"{self.current} are lost: {WHAT_TO_DO}")
        self._enter(header["epoch"])
        if not broker.arrived(batch_id, first, rows_cut):
            return []
        if ep.epoch < 0:
            ep.epoch = header["epoch"]
            if self._stats.first_batch_seconds < 0:
                self._stats.first_batch_seconds = time.monotonic() - self._started
                broker.report(first_batch_s=self._stats.first_batch_seconds)
        columns = decode_batch(header, frames, verify=self._verify)
        nbytes = header["nbytes"] = sum(len(f) for f in frames)
        self._source[batch_id] = broker
        broker.got += stop - first
        splits = header.get("splits")
        if splits is None:
            return [_cut_rows(header, columns, rows_cut)]
        # A pack of small batches: each is a slice (a view) of the pack's columns, acknowledged with the last.
        # A piece of a pack (``take``, an epoch evened out) holds some of them only.
        self._pack_left[batch_id] = stop - first
        self._pack_first[batch_id] = first
        items = []
        start = sum(splits[:first])
        for index in range(first, stop):
            rows = splits[index]
            share = nbytes * rows // header["rows"] if header["rows"] else 0
            items.append(_cut_rows({**header, "rows": rows, "nbytes": share, "index": index},
                                   {k: rows_of(v, start, start + rows) for k, v in columns.items()}, rows_cut))
            start += rows
        return items

    def give_back(self, broker: BrokerConnection, epoch: int, items: list[Item], kept: int) -> None:
        """Return ``items`` (batches of ``broker`` this rank got and has not used) to even the epoch out: see
        :meth:`BrokerConnection.give_back`. ``kept``: the batches of the epoch from it that this rank keeps."""
        firsts: dict[BatchId, int] = {}
        counts: dict[BatchId, int] = {}
        for header, _ in items:
            batch_id = protocol.batch_id(header)
            index = header.get("index", 0)
            firsts[batch_id] = min(firsts.get(batch_id, index), index)
            counts[batch_id] = counts.get(batch_id, 0) + 1
        returned = [Returned(i, first, first == self._pack_first.get(i, 0)) for i, first in firsts.items()]
        broker.give_back(epoch, returned, kept)
        broker.got -= len(items)
        for batch_id, _, whole in returned:
            left = self._pack_left.pop(batch_id, None)
            self._pack_done.pop(batch_id, None)
            if left is None or whole:
                self._pack_first.pop(batch_id, None)
                self._source.pop(batch_id)
                continue
            left -= counts[batch_id]
            if left:
                self._pack_left[batch_id] = left
            else:                           # what this rank kept of the pack is used: acknowledge it now
                self._pack_first.pop(batch_id, None)
                self._source.pop(batch_id).ack(batch_id, send=False)
        broker.flush()

    # ---- what was used, and losses ------------------------------------------------------------------------

    def note_used(self, header: BatchHeader) -> None:
        """The loop has this batch now (yielded): record it as used, of the connection it came from."""
        source = self._source.get(protocol.batch_id(header))
        record = source.used if source is not None else self._elsewhere
        cut = header.get("cut")
        record.add(header["part"], header["seq"], header.get("index", 0), header["checksum"],
                   (cut[0], cut[1]) if cut is not None else None)

    def used(self) -> UsedBatches:
        """Every batch the rank used of its current epoch, wherever it came from (lost entries included)."""
        every = UsedBatches()
        every.merge(self.lost)
        every.merge(self._elsewhere)
        for broker in self.connections:
            every.merge(broker.used)
        return every

    def used_entries(self) -> list[UsedEntry]:
        """The whole batches of :meth:`used`."""
        return self.used().entries()

    def resume(self, epoch: int, entries: Sequence[UsedEntry], cuts: Sequence[UsedCut] = ()) -> None:
        """Resume ``epoch`` from a checkpoint that had used ``entries`` (and the rows ``cuts``) of it: they are the
        lost entries of :data:`~wire.protocol.RESUME_LOSS` (the connections told their brokers when they joined:
        ``BrokerConnection(resume=)``)."""
        self._enter(epoch)
        self.lost.update(entries, cuts)
        self._handled.add(RESUME_LOSS)

    def _enter(self, epoch: int) -> None:
        """A message of ``epoch``: a later one than the rank's current epoch starts a new record of what was used."""
        if epoch <= self.current:
            return
        self.current = epoch
        self.lost.clear()
        self._elsewhere.clear()
        for broker in self.connections:
            broker.used.clear()

    def _lost(self, broker: BrokerConnection, header: LostHeader) -> None:
        """A LOST from ``broker`` (or, ``restarted``, its own rejoin found it restarted without journal)."""
        lost = header["lost"]
        if header.get("restarted"):
            self._lose(broker, lost, gone=False)
            return
        owner = next((b for b in self.connections if b.incarnation == lost), None)
        if owner is not None and lost not in self._handled:
            # A broker gone for good that this rank had not noticed yet (another broker took it over).
            log.warning("rank %d: the broker at %s (incarnation %s) was lost, says the broker at %s",
                        broker.rank, owner.address, lost, broker.address)
            self._lose(owner, lost, gone=owner is not broker)
            return
        current = header["epoch"] == self.current
        broker.reclaim(header["epoch"], lost, self.lost.entries() if current else [],
                       self.lost.cuts() if current else [])

    def _forget_ids(self, broker: BrokerConnection) -> None:
        """No batch this rank holds is to be acknowledged to ``broker`` (a lost incarnation)."""
        for batch_id in [i for i, b in self._source.items() if b is broker]:
            del self._source[batch_id]
            self._pack_left.pop(batch_id, None)
            self._pack_first.pop(batch_id, None)
            self._pack_done.pop(batch_id, None)

    def _silent(self, silent: BrokerSilent) -> None:
        """A broker silent past its timeout: gone for good if another one still answers, else the feed's end.

        Raises:
            BrokerError: no other broker answers.
        """
        gone = silent.broker
        answering = False
        for broker in self.connections:
            if broker is gone:
                continue
            try:
                broker.service()            # what it sent waits for later; its silence raises
                answering = True
            except BrokerSilent:
                pass
        if not answering:
            if len(self.connections) == 1:
                raise BrokerError(str(silent)) from silent
            raise BrokerError(f"every broker of stream {gone.stream!r} is gone or unreachable (the broker at "
                              f"{gone.address} has been silent for {gone.timeout:g} s, and so have the others): "
                              f"{WHAT_TO_DO}") from silent
        log.warning("rank %d: the broker at %s has been silent for %g s, gone for good; reading on from the others "
                    "(its partitions come again from Spark through them)", gone.rank, gone.address, gone.timeout)
        self._lose(gone, gone.incarnation, gone=True)

    def _lose(self, broker: BrokerConnection, incarnation: str, gone: bool) -> None:
        """Incarnation ``incarnation`` of ``broker`` lost its state (``gone``: for good). See the module."""
        self._handled.add(incarnation)
        if broker.ended < self.current:     # the loss takes what this rank had of its current epoch
            epoch = self.current
            if self.forget is not None:
                self.forget(broker, gone)
            self._unpacked = deque(item for item in self._unpacked
                                   if self._source.get(protocol.batch_id(item.header)) is not broker)
            self._forget_ids(broker)
            self.lost.merge(broker.used)
            self.lost.merge(self._elsewhere)   # the pooled ones may have been this broker's
            broker.used.clear()
            self._elsewhere.clear()
            entries, cuts = self.lost.entries(), self.lost.cuts()
        else:                               # it had ended this epoch: it lost the next, of which the rank has none
            epoch, entries, cuts = broker.ended + 1, [], []
        broker.forget_epoch()
        log.warning("rank %d: the broker at %s lost epoch %d (incarnation %s); %d used batches of the epoch are "
                    "reclaimed", broker.rank, broker.address, epoch, incarnation,
                    sum(entry.stop - entry.first for entry in entries))
        if gone:
            self._forget_ids(broker)          # what it had delivered of an ended epoch is used, never acknowledged
            broker.close()
            self.connections.remove(broker)
            if broker in self._waiting:
                self._waiting.remove(broker)
                if not self._waiting and not self.end_seen:
                    self._end_epoch()
        for other in self.connections:
            other.reclaim(epoch, incarnation, entries, cuts)

    # ---- acknowledging --------------------------------------------------------------------------------------

    def ack(self, header: BatchHeader, send: bool = True) -> None:
        """The loop is done with this batch: acknowledge it (a pack: with its last batch) to the broker that
        sent it. ``send=False`` keeps it for the next :meth:`flush`."""
        batch_id = protocol.batch_id(header)
        left = self._pack_left.get(batch_id)
        if left is not None:
            if left > 1:
                self._pack_left[batch_id] = left - 1
                self._progress(batch_id, header["index"], send)
                return
            del self._pack_left[batch_id]
            self._pack_first.pop(batch_id, None)
            self._pack_done.pop(batch_id, None)
        broker = self._source.pop(batch_id, None)
        if broker is None:                  # its broker lost it (the batch counts as used: RECLAIM)
            return
        if send:
            self._report()
        broker.ack(batch_id, send)

    def _progress(self, batch_id: BatchId, index: int, send: bool) -> None:
        """A batch of a pack was used: every ``progress_every`` batches used from the pack's start on, say how far
        (the pack is acknowledged with its last batch), so that a rank that dies costs at most that many batches
        trained again, as a batch window did before packs."""
        done = self._pack_done.get(batch_id)
        if done is None:
            first = self._pack_first.get(batch_id, 0)
            done = self._pack_done[batch_id] = _PackProgress(first, first)
        if done.used(index) - done.said >= self._progress_every:
            done.said = done.upto
            self._source[batch_id].progress(batch_id, done.upto, send)

    def _report(self) -> None:
        # What this rank tells its brokers about itself (for monitoring): once per message, and with each flush.
        figures = self._figures()
        for broker in self.connections:
            broker.report(**figures)

    def flush(self) -> None:
        """Send every acknowledgement that waits, with this rank's figures."""
        self._report()
        for broker in self.connections:
            broker.flush()

    def service(self) -> None:
        """Keep every broker connection alive while the rank waits for its peers (heartbeats, a rejoin).

        Raises:
            BrokerError: every broker is silent past its timeout (or the only one is).
        """
        for broker in list(self.connections):
            if broker in self.connections:
                try:
                    broker.service()
                except BrokerSilent as silent:
                    self._silent(silent)


class _PackProgress:
    """How far a pack's batches have been used: ``upto``, the first not yet used of those from its start; ``said``:
    as last told the broker. Batches used out of order (a shuffle buffer) wait in ``ahead``."""

    __slots__ = ("upto", "said", "ahead")

    def __init__(self, upto: int, said: int):
        self.upto, self.said = upto, said
        self.ahead: set[int] = set()

    def used(self, index: int) -> int:
        if index != self.upto:
            self.ahead.add(index)
            return self.upto
        self.upto += 1
        while self.upto in self.ahead:
            self.ahead.remove(self.upto)
            self.upto += 1
        return self.upto
