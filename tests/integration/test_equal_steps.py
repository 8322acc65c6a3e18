"""Equal steps granted by the broker, for ranks started by anything: plain processes with ``BatchStream(rank=,
size=)`` (no MPI imported) and mpiexec ranks, one broker or several, a slow rank, a journalled broker's restart,
a rank that dies and is started again, a group of another size at an epoch boundary.

Every test asserts the exact multiset of row ids: with the default remainder ("split") every row trained once and
none dropped; with ``remainder="drop"``, those trained plus those dropped to keep the ranks even.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sparkbus.feeder import feed

from harness import wait_for
from sources import staged_frame

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def frame(spark, rows, partitions):
    return spark.range(rows, numPartitions=partitions).selectExpr("id", "cast(id as float) as x")


def ids_of(group, ranks, epoch):
    parts = [group.epoch(r, epoch) for r in ranks]
    return (np.concatenate([p.get("id", np.zeros(0, np.int64)) for p in parts]),
            np.concatenate([p["dropped_id"] for p in parts]))


def assert_even_and_exact(summaries, group, epoch, rows, brokers=1, remainder="split"):
    steps = [s["epochs"][epoch]["batches"] for s in summaries]
    assert len(set(steps)) == 1, f"unequal steps in epoch {epoch}: {steps}"
    dropped = sum(s["epochs"][epoch]["dropped_batches"] for s in summaries)
    assert dropped <= brokers * (len(summaries) - 1)
    kept, lost = ids_of(group, range(len(summaries)), epoch)
    if remainder == "split":
        assert dropped == 0 and len(lost) == 0, "the default remainder drops no row"
        np.testing.assert_array_equal(np.sort(kept), np.arange(rows))
    np.testing.assert_array_equal(np.sort(np.concatenate([kept, lost])), np.arange(rows))
    return steps[0], dropped


def test_a_group_without_mpi_takes_equal_steps_and_every_row_once(spark, start_broker_process, start_group):
    broker = start_broker_process()
    group = start_group(3, broker.ranks, "--stream", "plain", "--epochs", "2")
    df = frame(spark, 10_007, 4)                   # batches of 37 rows, packed: pieces of packs at the ends
    for epoch in (0, 1):
        feed(df, broker.feed, stream="plain", epoch=epoch, batch_size=37, timeout=60)
    summaries = group.wait()
    epochs = broker.stats()["streams"]["plain"]["epochs"]
    for epoch in (0, 1):
        steps, dropped = assert_even_and_exact(summaries, group, epoch, 10_007)
        figures = epochs[str(epoch)]
        assert (figures["steps"], figures["dropped"], dropped) == (steps, 0, 0)
        assert steps * 3 == figures["batches_in"] - figures["cut"] + figures["pieces"]
        assert figures["pieces"] == (3 if figures["cut"] else 0) and figures["repeated"] == 0
        # a left-over batch given whole to one rank (the others' cut in two) is not a cut for that rank
        cut_steps = sum(s["epochs"][epoch]["cut_batches"] for s in summaries)
        assert figures["pieces"] - figures["cut"] <= cut_steps <= figures["pieces"]
    assert not any(s["imported_mpi4py"] for s in summaries)


def test_a_slow_rank_keeps_equal_steps_and_the_fast_one_is_not_given_its_share(spark, start_broker_process,
                                                                              start_group):
    broker = start_broker_process()
    group = start_group(2, broker.ranks, "--stream", "slow", "--slow-rank", "0", "--slow-seconds", "0.02",
                        "--prefetch", "2", "--prefetch-bytes", "0", "--remainder", "drop")
    feed(frame(spark, 2_100, 3), broker.feed, stream="slow", batch_size=100, timeout=60, pack_bytes=0)
    summaries = group.wait()
    steps, dropped = assert_even_and_exact(summaries, group, 0, 2_100, remainder="drop")
    assert (steps, dropped) == (10, 1)


def test_mpi_ranks_take_granted_steps_and_can_still_agree_over_mpi(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    granted = start_ranks(2, broker.ranks, "--stream", "granted", "--slow-rank", "1", "--slow-seconds", "0.01")
    agreed = start_ranks(2, broker.ranks, "--stream", "agreed", "--steps", "mpi")
    df = frame(spark, 3_300, 3)
    feed(df, broker.feed, stream="granted", batch_size=100, timeout=60, pack_bytes=0)
    feed(df, broker.feed, stream="agreed", batch_size=100, timeout=60)
    for ranks in (granted, agreed):
        summaries = ranks.wait()
        assert_even_and_exact(summaries, ranks, 0, 3_300)
    stats = broker.stats()["streams"]
    # 33 batches for 2 ranks: 16 each, and the one left over split by rows (50 each)
    assert stats["granted"]["epochs"]["0"]["steps"] == 17 and stats["agreed"]["epochs"]["0"]["steps"] == 0
    for ranks in (granted, agreed):
        assert [s["epochs"][0]["rows"] for s in ranks.wait()] == [1_650, 1_650]


def test_several_brokers_grant_their_own_steps(spark, start_broker_process, start_group):
    brokers = [start_broker_process(), start_broker_process()]
    group = start_group(2, ",".join(b.ranks for b in brokers), "--stream", "two")
    feed(frame(spark, 5_003, 6), [b.feed for b in brokers], stream="two", batch_size=50, timeout=60)
    summaries = group.wait()
    assert_even_and_exact(summaries, group, 0, 5_003, brokers=2)
    granted = [b.stats()["streams"]["two"]["epochs"]["0"]["steps"] for b in brokers]
    assert sum(granted) == summaries[0]["epochs"][0]["batches"] and min(granted) > 0


def test_a_journalled_broker_restarted_mid_epoch_keeps_the_steps_equal(spark, start_broker_process, start_group,
                                                                      tmp_path):
    broker = start_broker_process("--journal", str(tmp_path / "journal"), "--heartbeat", "200ms")
    group = start_group(2, broker.ranks, "--stream", "durable", "--slow-rank", "1", "--slow-seconds", "0.01",
                        "--timeout", "60")
    result = {}
    df = staged_frame(spark, 6_000, 3, slow=2, slow_seconds=0.1)
    feeding = threading.Thread(target=lambda: result.update(report=feed(
        df, broker.feed, stream="durable", batch_size=100, timeout=10, pack_bytes=0)))
    feeding.start()
    wait_for(lambda: broker.stats()["streams"].get("durable", {}).get("epochs", {}).get("0", {}).get("acked", 0)
             >= 10, 60, "some batches acknowledged")
    broker.proc.kill()
    broker.proc.wait(5)
    broker.restart()
    feeding.join(120)
    assert "report" in result, "feed() did not finish after the restart"
    summaries = group.wait(120)
    assert_even_and_exact(summaries, group, 0, 6_000)
    assert sum(s["epochs"][0]["batches"] for s in summaries) >= 58


def test_a_rank_that_dies_is_started_again_and_nothing_is_lost(spark, start_broker_process, start_group, tmp_path):
    broker = start_broker_process("--heartbeat", "200ms", "--rejoin-grace", "1s")
    out = tmp_path / "dies"
    out.mkdir()
    # windows of 4 batches (no byte window): the victim cannot hold its whole share, so it dies mid-epoch
    window = ("--prefetch", "4", "--prefetch-bytes", "0")
    first = start_group(2, broker.ranks, "--stream", "dies", "--stop-after", "4", *window, out=out, only=[1])
    survivor = start_group(2, broker.ranks, "--stream", "dies", *window, out=out, only=[0])
    feeding = threading.Thread(target=feed, args=(frame(spark, 3_000, 3), broker.feed),
                               kwargs=dict(stream="dies", batch_size=100, timeout=60, pack_bytes=0))
    feeding.start()
    wait_for(lambda: first.stopped(1), 60, "rank 1 to stop after four batches")
    victim = np.load(out / "rank1-epoch0.npz")["id"].copy()
    first.kill(1)
    again = start_group(2, broker.ranks, "--stream", "dies", *window, out=out, only=[1])
    feeding.join(90)
    [rank0] = survivor.wait(ranks=[0])
    [rank1] = again.wait(ranks=[1])
    assert len(victim) == 400
    kept, lost = ids_of(survivor, [0, 1], 0)          # rank1's files are the new process's now
    assert len(lost) == 0, "the default remainder drops no row"
    np.testing.assert_array_equal(np.sort(np.concatenate([victim, kept])), np.arange(3_000))
    # the share is taken over what the group has left: the batch the dead rank had in hand went to the others
    assert rank0["epochs"][0]["batches"] == rank1["epochs"][0]["batches"]


def test_a_group_of_another_size_joins_at_an_epoch_boundary(spark, start_broker_process, start_group):
    broker = start_broker_process("--heartbeat", "200ms")
    df = frame(spark, 2_000, 2)
    two = start_group(2, broker.ranks, "--stream", "resize")
    feed(df, broker.feed, stream="resize", epoch=0, batch_size=100, timeout=60, pack_bytes=0)
    summaries = two.wait()
    assert_even_and_exact(summaries, two, 0, 2_000)
    three = start_group(3, broker.ranks, "--stream", "resize", "--timeout", "30")
    feed(df, broker.feed, stream="resize", epoch=1, batch_size=100, timeout=60, pack_bytes=0)
    summaries = three.wait()
    steps = [s["epochs"][0]["batches"] for s in summaries]
    # 20 batches of 100 rows for 3 ranks: 6 each, and the 2 left over shared out by rows (50, 50 and 100)
    assert steps == [7, 7, 7] and sum(s["epochs"][0]["dropped_batches"] for s in summaries) == 0
    assert sorted(s["epochs"][0]["rows"] - 600 for s in summaries) == [50, 50, 100]
    kept, lost = ids_of(three, range(3), 0)
    assert len(lost) == 0
    np.testing.assert_array_equal(np.sort(kept), np.arange(2_000))


@pytest.mark.parametrize("size", [3, 7])
def test_every_row_once_in_equal_steps_whatever_the_group_size(spark, start_broker_process, start_group, size):
    broker = start_broker_process()
    group = start_group(size, broker.ranks, "--stream", f"rows-{size}")
    # 5 partitions of 469 rows: 25 batches (20 of 100 rows, 5 of 69); 3 ranks: 8 steps and 1 left over, 7 ranks:
    # 3 steps and 4 left over, shared out by rows as one more step on every rank
    feed(frame(spark, 2_345, 5), broker.feed, stream=f"rows-{size}", batch_size=100, timeout=60, pack_bytes=0)
    summaries = group.wait()
    steps, dropped = assert_even_and_exact(summaries, group, 0, 2_345)
    assert (steps, dropped) == (25 // size + 1, 0)
    figures = broker.stats()["streams"][f"rows-{size}"]["epochs"]["0"]
    assert (figures["cut"], figures["pieces"], figures["dropped"]) == (25 % size, size, 0)
    assert sum(s["epochs"][0]["rows"] for s in summaries) == 2_345


def test_pad_gives_every_rank_a_whole_last_batch_and_counts_the_repeats(spark, start_broker_process, start_group):
    broker = start_broker_process()
    group = start_group(3, broker.ranks, "--stream", "pad", "--remainder", "pad")
    feed(frame(spark, 2_345, 5), broker.feed, stream="pad", batch_size=100, timeout=60, pack_bytes=0)
    summaries = group.wait()
    assert [s["epochs"][0]["batches"] for s in summaries] == [9, 9, 9]
    kept, lost = ids_of(group, range(3), 0)
    repeated = sum(s["epochs"][0]["repeated_rows"] for s in summaries)
    assert len(lost) == 0 and sum(s["epochs"][0]["repeated_batches"] for s in summaries) == 2
    assert len(kept) == 2_345 + repeated and repeated in (2 * 69, 2 * 100)      # the one left over, twice again
    np.testing.assert_array_equal(np.unique(kept), np.arange(2_345))
    values, counts = np.unique(kept, return_counts=True)
    assert set(counts.tolist()) == {1, 3} and (counts == 3).sum() == repeated // 2
