"""Why a rank waits (``EpochStats``): the wait for data apart from the wait for peers (equal steps: holding
batches the broker has not granted yet), and the loop's own time per step beside them, with a verdict."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind
from sparkbus.worker.stats import EpochStats

from harness import FakeBroker, joined

pytestmark = pytest.mark.timeout(30)


def test_a_rank_holding_batches_it_may_not_use_yet_counts_that_wait_as_its_peers():
    ep = EpochStats(epoch=0, wait_seconds=3.0, peer_wait_seconds=2.0, first_batch_seconds=0.5, step_seconds=4.0)
    assert ep.data_wait_seconds == pytest.approx(0.5) and ep.verdict == "peer-bound"
    assert EpochStats(0, wait_seconds=2.0, first_batch_seconds=0.2, step_seconds=4.0).verdict == "input-bound"
    assert EpochStats(0, wait_seconds=0.3, first_batch_seconds=0.2, step_seconds=4.0).verdict == "compute-bound"


def test_the_wait_for_a_grant_is_the_peers_and_the_loops_time_is_its_own(context):
    broker = FakeBroker(context, "inproc://why-waits")
    stream = joined(broker, "inproc://why-waits", context, rank=0, size=2)
    for seq in range(2):
        broker.send(codec.encode_batch("s", 0, 0, seq, {"id": np.array([seq], dtype=np.int64)}))
    broker.send([protocol.pack_header(Kind.STEPS, stream="s", epoch=0, steps=1)])

    def grant_later():             # the other rank catches up a while after this one used its first batch
        time.sleep(0.5)
        broker.send([protocol.pack_header(Kind.STEPS, stream="s", epoch=0, steps=2)])
        broker.send([protocol.pack_header(Kind.EPOCH_END, stream="s", epoch=0, batches=2, steps=2)])

    peer = threading.Thread(target=grant_later)
    with stream:
        seen = []
        for batch in stream.epoch():
            if not seen:
                peer.start()
            seen.append(int(batch["id"][0]))
            time.sleep(0.1)       # the loop's own work
        peer.join(5)
        ep = stream.stats.epochs[-1]
    assert seen == [0, 1]
    assert 0.2 <= ep.peer_wait_seconds <= ep.wait_seconds, ep
    assert ep.step_seconds >= 0.2 and ep.data_wait_seconds < ep.peer_wait_seconds
    assert ep.verdict == "peer-bound"
    assert stream.stats.peer_wait_seconds == ep.peer_wait_seconds


def test_sparkbus_status_watch_gives_each_rank_the_same_verdict():
    from sparkbus.broker.status import why_it_waits

    assert why_it_waits(0.5, 2.0, 4.0) == "peer-bound"
    assert why_it_waits(1.5, 0.0, 4.0) == "input-bound"
    assert why_it_waits(0.1, 0.1, 4.0) == "compute-bound"
    for data, peer, step in [(0.5, 2.0, 4.0), (1.5, 0.0, 4.0), (0.1, 0.1, 4.0)]:
        assert why_it_waits(data, peer, step) == EpochStats(0, wait_seconds=data + peer, peer_wait_seconds=peer,
                                                            step_seconds=step).verdict
