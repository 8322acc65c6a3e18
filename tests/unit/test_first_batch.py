"""An epoch's figures show the wait before its first batch apart (``EpochStats.first_batch_seconds``): in a first
epoch, Spark's start-up, which ``wait_seconds`` counts too (its meaning stays)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from sparkbus.wire import codec
from sparkbus.wire.protocol import Kind
from sparkbus.worker import BatchStream

from harness import recv_header, send

pytestmark = pytest.mark.timeout(30)

LATE = 1.0      # seconds before the feed starts: the "start-up"


def test_first_batch_seconds_is_the_wait_before_the_first_batch_within_the_data_wait(start_broker_thread, sockets,
                                                                                     context):
    broker = start_broker_thread(heartbeat=0.5)
    control = sockets(zmq.DEALER, broker.config.control)
    push = sockets(zmq.PUSH, broker.config.feed)

    def request(kind, **fields):
        send(control, kind, req=7, **fields)
        return recv_header(control)[0]

    def feed_late():
        time.sleep(LATE)
        request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="stream")
        for seq in range(3):
            push.send_multipart(codec.encode_batch("s", 0, 0, seq, {"id": np.arange(4) + 4 * seq}))
        request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=0, batches=3, rows=12)
        request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=1)

    with BatchStream(broker.config.ranks, stream="s", context=context, timeout=10) as stream:
        feeder = threading.Thread(target=feed_late)
        feeder.start()
        try:
            assert sum(len(batch["id"]) for batch in stream.epoch()) == 12
        finally:
            feeder.join(10)
    ep = stream.stats.epochs[-1]
    assert LATE * 0.9 <= ep.first_batch_seconds <= ep.seconds
    assert ep.first_batch_seconds <= ep.wait_seconds + 0.05, "the first batch's wait is part of the data wait"
