"""Why training waits, end to end: the feed's report says how long its tasks were held back by a full broker
(backpressure) and names the slowest tasks and their hosts; each rank's figures split its wait into data and
peers beside its own work, with a verdict. A slow training loop makes the feed backpressured and the rank
compute-bound; a slow Spark partition makes the rank input-bound and the feed unhindered."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from sparkbus.feeder import feed
from sparkbus.worker import BatchStream

from sources import staged_frame

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def consume(address: str, stream: str, seconds_per_batch: float, out: dict, **window) -> threading.Thread:
    def run():
        with BatchStream(address, stream=stream, timeout=60, **window) as rank:    # default window: 4 batches, 8 MiB
            ids = []
            for batch in rank.epoch():
                ids.append(batch["id"].copy())
                time.sleep(seconds_per_batch)         # the training loop's own work
            out["ids"], out["ep"] = np.concatenate(ids), rank.stats.epochs[-1]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_slow_loop_backpressures_the_feed_and_the_rank_is_compute_bound(spark, start_broker_process):
    broker = start_broker_process("--max-buffer", "256KiB")
    out: dict = {}
    rank = consume(broker.ranks, "slow-loop", 0.06, out)
    df = spark.range(3_000, numPartitions=2).selectExpr("id", "array_repeat(cast(id as float), 64) as x")
    report = feed(df, broker.feed, stream="slow-loop", batch_size=50, pack_bytes=0, timeout=60)
    rank.join(60)
    np.testing.assert_array_equal(np.sort(out["ids"]), np.arange(3_000))
    assert report.backpressure > 0.3, report            # 60 batches at 60 ms: the tasks waited for the rank
    assert [host for _, host, _ in report.slowest] == [socket.gethostname()] * 2
    assert sorted(p for p, _, _ in report.slowest) == [0, 1] and report.task_seconds >= report.blocked_seconds
    ep = out["ep"]
    assert ep.verdict == "compute-bound", ep
    assert ep.step_seconds >= 60 * 0.06 and ep.peer_wait_seconds == 0.0
    verdict = report.verdict            # the feed's: Spark held back by the rank, which is named
    assert (verdict.kind, verdict.slowest_rank) == ("compute-bound", 0), verdict
    assert [r.rank for r in report.ranks] == [0] and report.ranks[0].step > 1.0, report.ranks
    assert str(verdict).startswith("compute-bound: ") and str(verdict).endswith("slowest rank: 0"), str(verdict)


def test_a_slow_partition_leaves_the_rank_input_bound_and_the_feed_unhindered(spark, start_broker_process):
    broker = start_broker_process()
    out: dict = {}
    began = time.time()
    rank = consume(broker.ranks, "slow-spark", 0.0, out)
    # 3 partitions of 500 rows; partition 2 takes 0.5 s per batch of 100 (2.5 s): the rank has the others'
    # batches early, then waits for Spark
    report = feed(staged_frame(spark, 1_500, 3, slow=2, slow_seconds=0.5), broker.feed, stream="slow-spark",
                  batch_size=100, pack_bytes=0, timeout=60)
    rank.join(60)
    np.testing.assert_array_equal(np.sort(out["ids"]), np.arange(1_500))
    assert report.backpressure < 0.1, report
    # the slow partition named: at least three of its sleeps fall in its feeding task's time (the first batch can
    # be made before the task's clock starts, in Spark's Python worker for mapInArrow)
    assert report.slowest[0][0] == 2 and report.slowest[0][2] >= 1.5, report
    # every task: its partition, host, start on the executor's clock, seconds, and seconds held back
    assert [t.partition for t in report.tasks] == [0, 1, 2], report.tasks
    assert all(t.host == socket.gethostname() and began <= t.started <= time.time() and 0 <= t.blocked <= t.seconds
               for t in report.tasks), report.tasks
    assert max(report.tasks, key=lambda t: t.seconds).partition == 2
    ep = out["ep"]
    assert ep.verdict == "input-bound", ep
    assert ep.data_wait_seconds >= 0.5, ep
    (waits,) = report.ranks           # waited for Spark: the broker held nothing for it meanwhile
    assert waits.data_wait > 0 and waits.window_wait < 0.5 * waits.data_wait, waits
    verdict = report.verdict            # the feed's: the ranks waited for Spark; the slow task and its host named
    # (the feed takes its last reading when the job has ended, before it closes the epoch: the rank is still in it)
    assert verdict.kind == "input-bound" and verdict.slowest_tasks[0][:2] == (2, socket.gethostname()), \
        (verdict, report.ranks, ep)
    assert f"slowest Spark tasks: partition 2 on {socket.gethostname()}" in str(verdict), str(verdict)


def test_the_feeds_last_look_at_the_ranks_is_before_the_close(spark, start_broker_process, monkeypatch):
    """No periodic reading while the epoch is fed: the feed's verdict comes from its first reading and the one it
    takes when Spark's job has ended, before it closes the epoch, while the rank cannot have left (a rank that
    finished the epoch leaves at once, and the broker forgets its figures then)."""
    import sparkbus.feeder.waits as waits

    monkeypatch.setattr(waits, "READ_EVERY", 600.0)
    broker = start_broker_process()
    out: dict = {}
    rank = consume(broker.ranks, "last-look", 0.0, out)
    report = feed(staged_frame(spark, 800, 2, slow=1, slow_seconds=0.4), broker.feed, stream="last-look",
                  batch_size=100, pack_bytes=0, timeout=60)
    rank.join(60)
    np.testing.assert_array_equal(np.sort(out["ids"]), np.arange(800))
    (waits_of_rank,) = report.ranks
    assert waits_of_rank.rank == 0 and waits_of_rank.data_wait >= 0.4, report.ranks
    assert report.verdict.kind == "input-bound", (report.verdict, out["ep"])


def paced_frame(spark, rows: int, partitions: int, seconds_per_batch: float):
    """ids 0..rows-1, each partition made in Arrow batches of 50 at ``seconds_per_batch`` each: tasks that take
    a while, so that their share held back is measured over more than their last reply."""
    def produce(batches):
        import pyarrow as pa
        import pyarrow.compute as pc

        for batch in batches:
            for start in range(0, batch.num_rows, 50):
                time.sleep(seconds_per_batch)
                ids = batch.column("id").slice(start, 50)
                yield pa.RecordBatch.from_arrays([ids, pc.cast(ids, pa.float32())], ["id", "x"])

    return spark.range(rows, numPartitions=partitions).mapInArrow(produce, "id long, x float")


def test_a_run_where_neither_side_waits_is_balanced(spark, start_broker_process):
    """Spark produces faster than the rank trains (two tasks at 10 ms a batch of 50 rows, the rank at 30 ms) and
    the broker holds the whole epoch: the tasks are never held back and the rank, once its first batch came,
    always has its next one."""
    broker = start_broker_process()
    out: dict = {}
    rank = consume(broker.ranks, "balanced", 0.03, out)
    report = feed(paced_frame(spark, 4_000, 2, 0.01), broker.feed, stream="balanced", batch_size=50, pack_bytes=0,
                  timeout=60)
    rank.join(60)
    np.testing.assert_array_equal(np.sort(out["ids"]), np.arange(4_000))
    verdict = report.verdict
    assert report.backpressure < 0.25 and verdict.kind == "balanced", (report, verdict)
    assert str(verdict).startswith("balanced: ranks waited "), str(verdict)
    assert out["ep"].verdict == "compute-bound", out["ep"]       # the rank's own view: it hardly waited


def test_a_window_too_small_for_the_round_trip_is_named(spark, start_broker_process):
    """A rank whose window is one batch (``prefetch=1, prefetch_bytes=0``) and whose loop takes no time waits a
    round trip for every batch while the broker, full, holds batches for it: input-bound on the window, not on
    Spark."""
    broker = start_broker_process("--max-buffer", "64KiB")
    out: dict = {}
    rank = consume(broker.ranks, "window", 0.0, out, prefetch=1, prefetch_bytes=0)
    # 3,000 batches of 4 rows, a round trip each: seconds of feeding (the feed reads the ranks' figures each
    # second), with the broker full all along
    df = spark.range(12_000, numPartitions=2).selectExpr("id", "array_repeat(cast(id as float), 16) as x")
    report = feed(df, broker.feed, stream="window", batch_size=4, pack_bytes=0, timeout=60)
    rank.join(60)
    np.testing.assert_array_equal(np.sort(out["ids"]), np.arange(12_000))
    verdict = report.verdict
    assert (verdict.kind, verdict.window) == ("input-bound", True), (report, verdict)
    assert report.queued_share is not None and report.queued_share > 0.5, report
    (waits,) = report.ranks           # the rank's own split: most of its data wait was the window round trip
    assert 0.5 * waits.data_wait < waits.window_wait <= waits.data_wait, waits
    assert str(verdict).startswith("input-bound on the window round trip: ") and "prefetch" in str(verdict)
