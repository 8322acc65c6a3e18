"""What runs inside one Spark task: push a partition's batches to the broker and wait for its commit."""

from __future__ import annotations

import time
from typing import Iterable, NamedTuple

import zmq

from broker.client import ControlClient
from broker.codec import encode_batch
from broker.errors import FeedTimeout
from broker.protocol import Kind

# Batches a task may have queued in its own PUSH socket. Past this, send blocks: that is the backpressure
# that holds the Spark task (and so Spark's scheduling) back while the broker is full.
PUSH_SNDHWM = 8


def attempt_id(run: int, spark_attempt: int) -> int:
    """The attempt identity a task sends: its feed run in the high bits, Spark's attempt number in the low 16.

    Spark numbers attempts from 0 in every job, so a second driver re-feeding an epoch that was left half fed
    would otherwise look like the same attempt sending its batches twice; with the run in it, the broker sees
    another attempt and compares checksums, as for any retry.
    """
    return (run << 16) | (spark_attempt & 0xFFFF)


class PartitionReport(NamedTuple):
    """What one task sent: returned to the driver through Spark."""

    partition: int
    batches: int
    rows: int
    bytes: int
    seconds: float


def stream_partition(batches: Iterable[dict], feed_address: str, control_address: str, stream: str,
                     epoch: int, partition: int, attempt: int, timeout: float) -> PartitionReport:
    """Push every batch of one partition, then return only once the broker confirms all of them arrived.

    Args:
        batches: column dicts, one per batch, in order.
        feed_address: the broker's PULL endpoint; control_address: its control endpoint.
        attempt: this attempt's identity, unique among the attempts that stream the partition (:func:`attempt_id`).
        timeout: seconds any single wait may take (handshake, each blocked send, the commit).
    Raises:
        BrokerError: the broker is unreachable, speaks another protocol version, or refused the commit.
        FeedTimeout: the broker stayed full (no batch taken) for longer than ``timeout``.
    """
    started = time.monotonic()
    context = zmq.Context.instance()
    with ControlClient(control_address, timeout, context) as control:
        control.hello("feeder", stream)
        push = context.socket(zmq.PUSH)
        push.linger = 0
        push.sndhwm = PUSH_SNDHWM
        push.sndtimeo = int(timeout * 1000)
        push.connect(feed_address)
        count = rows = nbytes = 0
        try:
            for seq, columns in enumerate(batches):
                frames = encode_batch(stream, epoch, partition, seq, columns, attempt=attempt)
                try:
                    push.send_multipart(frames, copy=False)
                except zmq.Again:
                    raise FeedTimeout(f"the broker at {feed_address} took no batch for {timeout:g} s "
                                      f"(partition {partition}, batch {seq}): it is full and its ranks are "
                                      f"not consuming, or it is gone") from None
                count += 1
                rows += len(next(iter(columns.values())))
                nbytes += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
            control.request(Kind.PARTITION_END, stream=stream, epoch=epoch, part=partition, attempt=attempt,
                            batches=count, rows=rows)
        finally:
            push.close(linger=0)    # after the commit nothing is left in it; on failure Spark retries
    return PartitionReport(partition, count, rows, nbytes, time.monotonic() - started)
