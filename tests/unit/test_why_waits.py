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


@pytest.mark.parametrize("size", [1, 2], ids=["every-batch", "granted-steps"])
def test_a_rank_waiting_for_data_tells_its_wait_at_each_heartbeat_while_it_waits(context, size):
    """The brokers (and so the feed's verdict) hear of a long wait while it lasts, not at the next ACK: the wait
    for the batch Spark has not made yet is known before that batch comes; as a wait for data, not for peers,
    whichever plan of steps waits (a group of 2 waits on the broker's grants)."""
    address = f"inproc://why-waits-heartbeat-{size}"
    broker = FakeBroker(context, address)
    stream = joined(broker, address, context, rank=0, size=size, heartbeat=0.2)
    broker.send(codec.encode_batch("s", 0, 0, 0, {"id": np.array([0], dtype=np.int64)}))
    if size > 1:
        broker.send([protocol.pack_header(Kind.STEPS, stream="s", epoch=0, steps=1)])
    told: list[float] = []
    peers: list[float] = []

    def spark_late():              # the second batch comes after the rank told at least three growing waits
        deadline = time.monotonic() + 10
        while len(told) < 3 and time.monotonic() < deadline:
            heartbeat = broker.next(Kind.HEARTBEAT)
            if "wait_s" in heartbeat:
                told.append(heartbeat["wait_s"])
                peers.append(heartbeat["peer_wait_s"])
        broker.send(codec.encode_batch("s", 0, 0, 1, {"id": np.array([1], dtype=np.int64)}))
        if size > 1:
            broker.send([protocol.pack_header(Kind.STEPS, stream="s", epoch=0, steps=2)])
            broker.send([protocol.pack_header(Kind.EPOCH_END, stream="s", epoch=0, batches=2, steps=2)])
        else:
            broker.end(0, 2)

    spark = threading.Thread(target=spark_late)
    with stream:
        seen = []
        for batch in stream.epoch():
            if not seen:
                spark.start()
            seen.append(int(batch["id"][0]))
        spark.join(15)
        ep = stream.stats.epochs[-1]
    assert seen == [0, 1] and len(told) == 3, told
    assert told == sorted(told) and told[-1] > told[0] > 0, told      # it grew while the rank waited
    assert peers == [peers[0]] * 3 and peers[0] < 0.05, peers         # ... for data, not for peers
    assert ep.wait_seconds >= told[-1], (ep, told)                    # ... and the epoch counts the whole wait


def test_sparkbus_status_watch_gives_each_rank_the_same_verdict():
    from sparkbus.broker.status import why_it_waits

    assert why_it_waits(0.5, 2.0, 4.0) == "peer-bound"
    assert why_it_waits(1.5, 0.0, 4.0) == "input-bound"
    assert why_it_waits(0.1, 0.1, 4.0) == "compute-bound"
    for data, peer, step in [(0.5, 2.0, 4.0), (1.5, 0.0, 4.0), (0.1, 0.1, 4.0)]:
        assert why_it_waits(data, peer, step) == EpochStats(0, wait_seconds=data + peer, peer_wait_seconds=peer,
                                                            step_seconds=step).verdict


# ---- the pipeline's verdict: the ranks' figures beside Spark's backpressure (wire.verdict) ------------------------

def test_the_pipeline_verdict_names_who_to_look_at():
    from sparkbus.wire.verdict import RankWaits, SlowTask, of_pipeline

    tasks = [(2, "exec-b", 12.5), (0, "exec-a", 3.0)]
    waited = of_pipeline([RankWaits(0, 3.0, 0.0, 10.0), RankWaits(1, 2.0, 0.5, 10.0)], 0.02, tasks)
    assert (waited.kind, waited.slowest_rank) == ("input-bound", None)
    assert waited.slowest_tasks == (SlowTask(2, "exec-b", 12.5), SlowTask(0, "exec-a", 3.0))
    assert waited.data_wait_share == pytest.approx(0.25)
    assert str(waited) == ("input-bound: ranks waited 25% of their step time for data, Spark held back 2%; slowest "
                           "Spark tasks: partition 2 on exec-b (12.5 s), partition 0 on exec-a (3.0 s)")
    assert not waited.window
    # most of the ranks' wait passed while the broker held batches for them: the window round trip, not Spark
    window = of_pipeline([RankWaits(0, 3.0, 0.0, 10.0)], 0.6, tasks, queued_share=0.9)
    assert (window.kind, window.window) == ("input-bound", True)
    assert str(window) == ("input-bound on the window round trip: ranks waited 30% of their step time for data, "
                           "Spark held back 60% while the broker held batches for them (raise BatchStream's "
                           "prefetch or prefetch_bytes)")
    assert not of_pipeline([RankWaits(0, 3.0, 0.0, 10.0)], 0.0, tasks, queued_share=0.4).window
    # Spark held back: the ranks are behind, the one with the most step time named (the other waits for it)
    behind = of_pipeline([RankWaits(0, 0.1, 4.0, 6.0), RankWaits(1, 0.1, 0.0, 10.0)], 0.6, tasks)
    assert (behind.kind, behind.slowest_rank) == ("compute-bound", 1)
    assert str(behind).endswith("Spark held back 60%; slowest rank: 1")
    # neither waits for the other
    even = of_pipeline([RankWaits(0, 0.2, 0.0, 10.0), RankWaits(1, 0.3, 0.0, 10.0)], 0.05, tasks)
    assert (even.kind, even.slowest_rank, even.data_wait_share) == ("balanced", None, pytest.approx(0.025))
    # backpressure unknown (sparkbus status): ranks that hardly wait are compute-bound
    assert of_pipeline([RankWaits(0, 0.2, 0.0, 10.0)]).kind == "compute-bound"
    assert of_pipeline([], 0.5).kind == "unknown" and str(of_pipeline([], None)) == "unknown: no rank's figures"
    # a rank that waited for data and told no step time yet (its loop did nothing between its batches) waited for
    # data all of its time; one that neither waited nor stepped is balanced
    idle = of_pipeline([RankWaits(0, 2.0, 0.0, 0.0)], 0.0, tasks)
    assert (idle.kind, idle.data_wait_share) == ("input-bound", 1.0)
    assert of_pipeline([RankWaits(0, 0.0, 0.0, 0.0)], 0.0).kind == "balanced"


def test_the_ranks_figures_leave_the_start_up_out_and_count_from_a_restart():
    from sparkbus.feeder.waits import waits_between
    from sparkbus.wire.verdict import RankWaits, rank_waits

    stream = {"ranks": [
        {"rank": 0, "wait_s": 5.0, "peer_wait_s": 1.0, "first_batch_s": 3.0, "step_s": 8.0},
        {"rank": 1, "wait_s": 4.0, "peer_wait_s": 0.0, "step_s": 0.0},       # no first batch yet: all start-up
        {"rank": 2},                                                          # has reported nothing
    ]}
    assert rank_waits(stream) == [RankWaits(0, 1.0, 1.0, 8.0), RankWaits(1, 0.0, 0.0, 0.0)]
    before = {0: RankWaits(0, 1.0, 1.0, 8.0), 1: RankWaits(1, 2.0, 0.0, 9.0)}
    after = {0: RankWaits(0, 1.5, 3.0, 12.0), 1: RankWaits(1, 0.5, 0.0, 1.0), 3: RankWaits(3, 0.1, 0.0, 2.0)}
    assert waits_between(before, after) == (RankWaits(0, 0.5, 2.0, 4.0), RankWaits(1, 0.5, 0.0, 1.0),
                                            RankWaits(3, 0.1, 0.0, 2.0))


def test_sparkbus_status_says_why_each_stream_waits():
    from sparkbus.broker.status import render_stats, totals, with_verdicts

    def figures(step0: float, step1: float) -> dict:
        rank = {"size": 2, "window": 4, "window_bytes": 2**20, "inflight": 0, "batches": 10, "bytes": 2**20,
                "acked": 10, "idle_s": 0.1, "wait_s": 1.5, "peer_wait_s": 0.0, "first_batch_s": 1.0}
        return {"broker": {"version": "0.3.0", "pid": 1, "uptime_s": 9.0, "buffered_bytes": 0, "max_buffer": 2**30,
                           "feed_paused": False, "rejected": {}},
                "streams": {"train": {"ranks": [{**rank, "rank": 0, "step_s": step0},
                                                {**rank, "rank": 1, "step_s": step1}],
                                      "expected_ranks": 2, "epochs": {}}}}

    one = figures(10.0, 20.0)
    text = render_stats(one)
    assert "acked 10, idle 0.1 s, compute-bound" in text
    assert ("  why training waits: compute-bound: ranks waited 3% of their step time for data; slowest rank: 1"
            in text.splitlines())
    assert with_verdicts(one)["verdicts"]["train"]["kind"] == "compute-bound"
    assert with_verdicts(one)["verdicts"]["train"]["slowest_rank"] == 1
    # two brokers hold the same ranks' figures (the latest kept): input-bound once the ranks' steps are short
    both = totals({"a": figures(1.0, 2.0), "b": figures(1.0, 1.0)})
    assert both["streams"]["train"]["verdict"]["kind"] == "input-bound"     # 0.5 s of data wait each over 1 + 2 s
    assert both["streams"]["train"]["verdict"]["data_wait_share"] == pytest.approx(1.0 / 3.0, abs=1e-4)
    assert not both["streams"]["train"]["verdict"]["window"]          # nothing queued: the ranks waited for Spark
    held = figures(1.0, 2.0)
    held["streams"]["train"]["epochs"] = {"0": {"queued": 5}}
    assert with_verdicts(held)["verdicts"]["train"]["window"] is True
