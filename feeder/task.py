"""What runs inside one Spark task: push a partition's batches to the broker and wait for its commit."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import Any, NamedTuple

import zmq

from sparkbus.broker.auth import client_socket
from sparkbus.broker.client import ControlClient
from sparkbus.feeder.columns import Message, pack_small
from sparkbus.wire.address import feed_and_control_addresses
from sparkbus.wire.codec import encode_batch
from sparkbus.wire.errors import BrokerError, FeedTimeout
from sparkbus.wire.protocol import Kind
from sparkbus.wire.ragged import WireColumn

# Batches a task may have queued in its own PUSH socket. Past this, send blocks: that is the backpressure
# that holds the Spark task (and so Spark's scheduling) back while the broker is full.
PUSH_SNDHWM = 8
DEFAULT_PACK_BYTES = 1 << 20


def attempt_id(run: int, task_attempt: int) -> int:
    """The attempt identity a task sends: its feed run in the high bits, Spark's task attempt id in the low 32.

    Spark's ``TaskContext.taskAttemptId()`` is unique within an application (``attemptNumber()`` is not: it starts
    at 0 again when a stage is resubmitted after a fetch failure, and such a new attempt would look like one
    that sent its batches twice). A second driver (another application) re-feeding an epoch that was left half fed
    numbers its tasks from 0 again: with the run in it, the broker sees another attempt and compares checksums, as
    for any retry.
    """
    return (run << 32) | (task_attempt & 0xFFFFFFFF)


class PartitionReport(NamedTuple):
    """What one task sent: returned to the driver through Spark."""

    partition: int
    batches: int
    rows: int
    bytes: int
    seconds: float
    broker: int = 0         # which of the feed's brokers streamed it (an index in its list)
    attempt: int = -1       # the attempt identity it streamed with (:func:`attempt_id`); -1: it streamed nothing
    messages: int = 0       # the messages it sent (a pack of small batches is one): its PARTITION_END's count
    blocked: float = 0.0    # seconds held back by a full broker (backpressure: the ranks were slower): its blocked
                            # sends and the wait for PARTITION_END's answer, which comes once the broker holds all
    host: str = ""          # the executor's host
    started: float = 0.0    # when the task began (time.time() on the executor's clock); it ended ``seconds`` later


def stream_partition(batches: Iterable[dict], feed_address: str | Sequence[str],
                     control_address: str | Sequence[str] | None, stream: str, epoch: int, partition: int,
                     attempt: int, timeout: float, pack_bytes: int = DEFAULT_PACK_BYTES, key: str | None = None,
                     broker_key: str | None = None) -> PartitionReport:
    """Push every batch of one partition, then return only once the broker confirms all of them arrived.

    Batches are dicts of columns in any form :func:`sparkbus.wire.codec.encode_batch` takes (numpy arrays, for
    example); consecutive small numpy batches travel as packs (:func:`feeder.columns.pack_small`). ``feed()``
    itself streams Arrow record batches through :func:`stream_messages`; this is the same for other callers.
    See :func:`stream_messages` for the arguments and errors.
    """
    return stream_messages(pack_small(batches, pack_bytes), feed_address, control_address, stream, epoch,
                           partition, attempt, timeout, key, broker_key)


def stream_messages(messages: Iterable[Message] | Iterable[tuple[dict[str, Any], list[int] | None]],
                    feed_address: str | Sequence[str], control_address: str | Sequence[str] | None, stream: str,
                    epoch: int, partition: int, attempt: int, timeout: float, key: str | None = None,
                    broker_key: str | None = None, route: int | None = None) -> PartitionReport:
    """Push every message of one partition, then return only once the broker confirms all of them arrived.

    Who commits the partition is the epoch's (its opener's) choice: ``feed()`` opens epochs that the driver commits
    from Spark's word (:mod:`feeder.commits`), so that an attempt whose input was cut short never commits; an epoch
    opened without ``commit="driver"`` (a caller streaming partitions without Spark) is committed by this call's
    ``PARTITION_END``, since nobody else can say that the partition's iterator was whole.

    With several brokers, the partition goes to one of them, chosen when its first attempt starts and recorded by
    the partition's home broker (``partition % len(brokers)``), so that every later attempt (a retry, a speculative
    copy) streams to the same broker and its duplicates are recognised: the home broker itself, unless another
    has more than twice its free buffer.

    Args:
        messages: ``(columns, splits)`` in order: a batch (``splits`` None) or a pack of batches (the rows of
            each in ``splits``; see :func:`feeder.columns.messages`).
        feed_address: the broker's PULL endpoint, or the endpoints of several brokers (a list, or comma-separated).
        control_address: the brokers' control endpoints, in the same order (None: each feed port + 2).
        attempt: this attempt's identity, unique among the attempts that stream the partition (:func:`attempt_id`).
        timeout: seconds any single wait may take (handshake, each blocked send, the commit).
        key, broker_key: CURVE key files for a broker run with ``--auth`` (see :class:`broker.client.ControlClient`).
        route: the broker (an index in the list) the driver fixed for this partition in a recovery
            (docs/design/RECOVERY.md): the task says HELLO to that broker only and claims nothing.
    Raises:
        BrokerError: a broker is unreachable, speaks another protocol version, or refused the commit.
        FeedTimeout: the broker stayed full (no batch taken) for longer than ``timeout``.
    """
    started, began = time.monotonic(), time.time()
    feeds, controls = feed_and_control_addresses(feed_address, control_address)
    context: zmq.Context = zmq.Context.instance()
    with ExitStack() as clients:
        hello = time.perf_counter()
        if route is not None:       # a recovery's fixed route: that broker only, no claim
            index = route
            control = clients.enter_context(ControlClient(controls[index], timeout, context, key, broker_key))
            control.hello("feeder", stream)
        else:
            controls_open = [clients.enter_context(ControlClient(c, timeout, context, key, broker_key))
                             for c in controls]
            index = _choose_broker(controls_open, stream, epoch, partition)
            control = controls_open[index]
        # the handshake's round trips (and connections): the part of the commit's wait that is not backpressure
        round_trip = time.perf_counter() - hello
        feed_address = feeds[index]
        push = client_socket(context, zmq.PUSH, key, broker_key)
        push.sndhwm = PUSH_SNDHWM
        push.sndtimeo = int(timeout * 1000)
        push.connect(feed_address)
        messages_sent = count = rows = nbytes = 0
        blocked = 0.0
        try:
            for seq, (columns, splits) in enumerate(messages):
                frames = encode_batch(stream, epoch, partition, seq, columns, attempt=attempt, splits=splits)
                before = time.perf_counter()
                try:
                    push.send_multipart(frames, copy=False)
                except zmq.Again:
                    raise FeedTimeout(f"the broker at {feed_address} took no batch for {timeout:g} s "
                                      f"(partition {partition}, message {seq}): it is full and its ranks are "
                                      f"not consuming, or it is gone") from None
                blocked += time.perf_counter() - before     # ~0 unless the broker's --max-buffer is full
                messages_sent += 1
                count += 1 if splits is None else len(splits)
                rows += sum(splits) if splits is not None else _rows(columns)
                nbytes += sum(memoryview(f).nbytes for f in frames)
            before = time.perf_counter()
            control.request(Kind.PARTITION_END, stream=stream, epoch=epoch, part=partition, attempt=attempt,
                            batches=messages_sent, rows=rows)
            # answered once the broker holds every batch, which needs room for them: the wait beyond a round trip
            blocked += max(time.perf_counter() - before - round_trip, 0.0)
        finally:
            push.close(linger=0)    # answered: nothing left in it is needed; on failure Spark retries
    return PartitionReport(partition, count, rows, nbytes, time.monotonic() - started, index, attempt,
                           messages_sent, blocked, socket.gethostname(), began)


def _rows(columns: dict[str, Any]) -> int:
    column = next(iter(columns.values()), None)
    return 0 if column is None else column.rows if isinstance(column, WireColumn) else len(column)


def _choose_broker(clients: list[ControlClient], stream: str, epoch: int, partition: int) -> int:
    """Say hello to every broker; with several, ask the partition's home broker which one streams it."""
    free = [client.hello("feeder", stream)["free"] for client in clients]
    if len(clients) == 1:
        return 0
    # The home broker spreads partitions evenly while the brokers are alike; one with less than half the free
    # buffer of the emptiest is passed over for it (its ranks are slower, or it holds more).
    home = partition % len(clients)
    emptiest = max(range(len(clients)), key=free.__getitem__)
    choice = home if free[home] * 2 >= free[emptiest] else emptiest
    chosen = clients[home].request(Kind.PARTITION_CLAIM, stream=stream, epoch=epoch, part=partition,
                                   broker=choice).get("broker")
    if type(chosen) is not int or not 0 <= chosen < len(clients):
        raise BrokerError(f"the broker at {clients[home].address} named broker {chosen!r} for partition "
                          f"{partition}, but this feed has {len(clients)}: do the driver and the tasks list the same "
                          f"brokers?")
    return chosen
