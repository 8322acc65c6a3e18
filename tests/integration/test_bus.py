"""The whole path with real pieces: Spark local mode -> broker process (CLI) -> ranks under mpiexec -n 2."""

import threading

import numpy as np
import psutil
import pytest

from sparkbus.feeder import feed
from sparkbus.feeder.task import DEFAULT_PACK_BYTES

from harness import wait_for
from sources import check_values, labelled_frame

pytestmark = pytest.mark.timeout(180)


def received_ids(ranks, n, epoch):
    # a rank that got no batch (a fast peer took them all) saved no columns
    return np.concatenate([ranks.epoch(r, epoch).get("id", np.zeros(0, np.int64)) for r in range(n)])


def test_two_epochs_every_row_once_with_values_and_dtypes_intact(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "exact", "--epochs", "2")
    df = labelled_frame(spark, rows=12_000, partitions=4)    # 3,000 rows a partition: 6 batches of 500 each
    reports = [feed(df, broker.feed, stream="exact", epoch=0, batch_size=500, timeout=60),
               feed(df.orderBy("w", ascending=False), broker.feed, stream="exact", epoch=1, batch_size=500,
                    timeout=60)]
    summaries = ranks.wait()
    assert reports[0].rows == 12_000 and reports[0].batches == 24 and reports[0].partitions == 4
    assert reports[1].rows == 12_000
    for epoch in (0, 1):
        ids = received_ids(ranks, 2, epoch)
        assert len(ids) == 12_000
        np.testing.assert_array_equal(np.sort(ids), np.arange(12_000))       # every row once
        for r in range(2):
            check_values(ranks.epoch(r, epoch))
            assert summaries[r]["epochs"][epoch]["dtypes"] == {
                "id": "int64", "x": "float32", "y": "int32", "flag": "bool", "w": "float64", "v": "float64"}
        assert [s["epochs"][epoch]["epoch"] for s in summaries] == [epoch, epoch]
        assert sum(s["epochs"][epoch]["dropped_batches"] for s in summaries) == 0
    stats = broker.stats()["streams"]["exact"]["epochs"]
    assert stats["0"]["rows_in"] == 12_000 and stats["1"]["batches_out"] == stats["1"]["acked"] == 24


def test_even_ranks_yield_equal_counts_and_drop_at_most_one(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    # 21 batches of 100 rows: one must be left over; rank 1 is slow so the broker hands rank 0 more
    ranks = start_ranks(2, broker.ranks, "--stream", "even", "--slow-rank", "1", "--slow-seconds", "0.05",
                        "--remainder", "drop")
    df = labelled_frame(spark, rows=2_100, partitions=3)
    feed(df, broker.feed, stream="even", batch_size=100, timeout=60)
    summaries = ranks.wait()
    counts = [s["epochs"][0]["batches"] for s in summaries]
    assert counts[0] == counts[1] == 10
    assert sum(s["epochs"][0]["dropped_batches"] for s in summaries) == 1
    kept = received_ids(ranks, 2, 0)
    dropped = np.concatenate([ranks.epoch(r, 0)["dropped_id"] for r in range(2)])
    assert len(dropped) == 100 and len(kept) == 2_000
    np.testing.assert_array_equal(np.sort(np.concatenate([kept, dropped])), np.arange(2_100))
    for r in range(2):
        check_values(ranks.epoch(r, 0))


def test_even_ranks_that_leave_an_epoch_together_lose_nothing_and_go_on(spark, start_broker_process, start_ranks,
                                                                        tmp_path):
    broker = start_broker_process()
    go = tmp_path / "go"
    ranks = start_ranks(2, broker.ranks, "--stream", "leave", "--epochs", "2", "--even", "yes",
                        "--leave-after", "5", "--stall-file", str(go))
    df = labelled_frame(spark, rows=4_000, partitions=4)     # 40 batches, in the ranks' windows before they start
    feed(df, broker.feed, stream="leave", epoch=0, batch_size=100, timeout=60)
    go.touch()
    feed(df, broker.feed, stream="leave", epoch=1, batch_size=100, timeout=60)
    summaries = ranks.wait()
    # epoch 0: both ranks left at step 6 (5 recorded, the 6th in hand); what they had taken in was skipped
    for r in range(2):
        assert summaries[r]["epochs"][0]["batches"] == 6
        assert len(ranks.epoch(r, 0)["id"]) == 500
    assert sum(s["skipped_batches"] for s in summaries) <= 40 - 12
    epochs = broker.stats()["streams"]["leave"]["epochs"]
    assert epochs["0"]["acked"] == epochs["0"]["batches_out"] == 40, "every batch of the left epoch acknowledged"
    np.testing.assert_array_equal(np.sort(received_ids(ranks, 2, 1)), np.arange(4_000))
    assert summaries[0]["epochs"][1]["batches"] == summaries[1]["epochs"][1]["batches"] == 20


@pytest.mark.filterwarnings("ignore::sparkbus.feeder.NoRanksWarning")     # the ranks start after the feed
def test_a_slow_rank_gets_markedly_fewer_batches(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    df = labelled_frame(spark, rows=6_000, partitions=2)
    # 60 batches of 3 kB wait in the broker, one message each (pack_bytes=0), and each rank's window is 4 batches
    # (no byte window, which would let the first rank to connect take all 60): shares are counted in batches
    feed(df, broker.feed, stream="lb", batch_size=100, timeout=60, pack_bytes=0)
    ranks = start_ranks(2, broker.ranks, "--stream", "lb", "--even", "no", "--slow-rank", "1",
                        "--slow-seconds", "0.05", "--prefetch-bytes", "0")
    summaries = ranks.wait()
    fast, slow = (s["epochs"][0]["batches"] for s in summaries)
    assert fast + slow == 60
    assert fast >= 3 * slow, f"fast rank got {fast}, slow rank {slow}"
    np.testing.assert_array_equal(np.sort(received_ids(ranks, 2, 0)), np.arange(6_000))


def test_backpressure_bounds_broker_memory_while_ranks_stall(spark, start_broker_process, start_ranks, tmp_path):
    max_buffer = 8 << 20
    broker = start_broker_process("--max-buffer", "8MiB")
    stall = tmp_path / "go"
    ranks = start_ranks(2, broker.ranks, "--stream", "bp", "--stall-file", str(stall))
    from pyspark.sql import functions as F
    rows = 48_000        # 1 KiB a row: 48 MiB through an 8 MiB buffer
    df = spark.range(rows, numPartitions=2).select(
        "id", F.array(*[F.col("id").cast("float")] * 255).alias("x"))
    process = psutil.Process(broker.proc.pid)
    baseline = process.memory_info().rss
    result = {}
    feeding = threading.Thread(target=lambda: result.update(report=feed(df, broker.feed, stream="bp",
                                                                        batch_size=256, timeout=60)))
    feeding.start()
    try:
        paused = wait_for(lambda: (s := broker.stats())["broker"]["feed_paused"] and s, 60, "the feed to pause")
        peak = 0
        for _ in range(20):          # the feed stays held back while the ranks stall
            stats = broker.stats()
            peak = max(peak, process.memory_info().rss)
            # over the buffer by at most the message that crossed it: a pack of these 263 kB batches
            assert stats["broker"]["buffered_bytes"] <= max_buffer + DEFAULT_PACK_BYTES + 4096
            assert feeding.is_alive(), "feed() finished although nothing was consumed"
            threading.Event().wait(0.05)
        assert paused["streams"]["bp"]["epochs"]["0"]["rows_in"] < rows
        assert peak - baseline <= max_buffer + (48 << 20), f"RSS grew by {(peak - baseline) >> 20} MiB"
    finally:
        stall.touch()
    feeding.join(120)
    assert result["report"].rows == rows
    ranks.wait()
    ids = received_ids(ranks, 2, 0)
    np.testing.assert_array_equal(np.sort(ids), np.arange(rows))


def test_two_streams_at_once_stay_apart(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    train = start_ranks(2, broker.ranks, "--stream", "train")
    val = start_ranks(1, broker.ranks, "--stream", "val")
    feeds = [threading.Thread(target=feed, args=(labelled_frame(spark, 4_000, 2), broker.feed),
                              kwargs=dict(stream="train", batch_size=250)),
             threading.Thread(target=feed, args=(labelled_frame(spark, 1_000, 2, first_id=100_000), broker.feed),
                              kwargs=dict(stream="val", batch_size=250))]
    for t in feeds:
        t.start()
    for t in feeds:
        t.join(120)
    train.wait()
    val.wait()
    np.testing.assert_array_equal(np.sort(received_ids(train, 2, 0)), np.arange(4_000))
    np.testing.assert_array_equal(np.sort(received_ids(val, 1, 0)), np.arange(100_000, 101_000))
    check_values(val.epoch(0, 0))
