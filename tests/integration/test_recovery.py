"""A broker lost without its journal costs a recomputation from Spark's lineage, not the job (issue 18 §1); a job
resumed from a mid-epoch checkpoint trains exactly what the checkpointed model has not seen (§3).

Real pieces: the broker through its CLI, Spark in local mode, ranks under ``mpiexec -n 2`` or started without MPI
(``--group``). Every test asserts the exact multiset of row ids the ranks trained on: each row once (none dropped at
the epoch's end, the default remainder), none twice while the ranks live, and equal steps on every rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings

import numpy as np
import pytest

from sparkbus.feeder import DivergedPartitionsWarning, feed, feed_epochs

from harness import wait_for
from sources import staged_frame

pytestmark = pytest.mark.timeout(300)


def epoch_figures(broker, stream: str, epoch: int = 0) -> dict:
    return broker.stats()["streams"].get(stream, {}).get("epochs", {}).get(str(epoch), {})


def assert_each_row_once(ids: np.ndarray, rows: int) -> None:
    values, counts = np.unique(ids, return_counts=True)
    twice = values[counts > 1]
    lost = np.setdiff1d(np.arange(rows), values)
    assert not len(twice) and not len(lost), (f"{len(twice)} rows trained twice (e.g. {twice[:10].tolist()}), "
                                              f"{len(lost)} lost (e.g. {lost[:10].tolist()})")
    assert len(ids) == rows


def trained(job, ranks: int = 2, epoch: int = 0) -> np.ndarray:
    """Every id the ranks trained on in ``epoch`` (none is dropped: the default remainder shares the leftovers out
    by rows)."""
    epochs = [job.epoch(r, epoch) for r in range(ranks)]
    for data in epochs:
        np.testing.assert_array_equal(data["x"], data["id"].astype(np.float32))
        assert len(data["dropped_id"]) == 0, "a row dropped at the epoch's end"
    return np.concatenate([d["id"] for d in epochs])


def equal_steps(summaries: list[dict]) -> None:
    steps = [s["epochs"][0]["batches"] for s in summaries]
    assert len(set(steps)) == 1, f"unequal steps: {steps}"


def feeding(target) -> tuple[threading.Thread, dict]:
    """``target()`` in a thread; its result or exception in the dict (``report`` / ``error``)."""
    result: dict = {}

    def run():
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result["report"] = target()
            result["warnings"] = caught
        except BaseException as exc:        # checked by the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def finished(thread: threading.Thread, result: dict, timeout: float = 200):
    thread.join(timeout)
    assert not thread.is_alive(), "feed() did not finish"
    if "error" in result:
        raise result["error"]
    return result["report"]


# ---- §1: a broker lost ------------------------------------------------------------------------------------------

def test_a_broker_killed_mid_epoch_and_restarted_without_journal_costs_a_recomputation(
        spark, small_arrow_batches, start_broker_process, start_ranks, tmp_path):
    broker = start_broker_process("--heartbeat", "200ms")
    ranks = start_ranks(2, broker.ranks, "--stream", "lineage")
    killed = tmp_path / "killed"
    # partition 2 takes ~6 s, every job, and its first job stops after 5 batches until the broker is back
    frame = staged_frame(spark, 6_000, 3, slow=2, slow_seconds=0.3, gate=killed)
    thread, result = feeding(lambda: feed(frame, broker.feed, stream="lineage", batch_size=100, timeout=5,
                                          pack_bytes=0))
    wait_for(lambda: epoch_figures(broker, "lineage").get("acked", 0) >= 20, 60, "some batches trained")
    broker.proc.kill()                                   # kill -9, mid-epoch, no journal: its state is gone
    broker.proc.wait(5)
    broker.restart()
    killed.touch()
    report = finished(thread, result)
    summaries = ranks.wait(150)
    assert report.rows == 6_000 and report.diverged == ()
    assert_each_row_once(trained(ranks), 6_000)
    equal_steps(summaries)
    end = epoch_figures(broker, "lineage")
    assert end["adopted"] >= 20 - 2, end       # what the ranks had trained before the kill was not sent again


def kill_one_of_two_mid_epoch(spark, start_broker_process, start_group, tmp_path, stream, run, *flags):
    """Two brokers and a group of 2 reading both; ``run(frame, feeds)`` in a thread; the second broker SIGKILLed
    for good once the ranks trained some of its batches, and before its epoch 0 is all committed.

    The frame has 8 partitions of 10 batches, one pack each (the default); the doomed broker is home to 1, 3, 5
    and 7. The ranks use its batches once both hold some of them (its grant is the smaller share), and partition 7,
    Spark's last, stops after 5 batches until the kill. Returns ``(steady, group, run's result)``."""
    steady, doomed = start_broker_process("--heartbeat", "200ms"), start_broker_process("--heartbeat", "200ms")
    # A window of one message a rank: one rank cannot take all three of the doomed broker's packs that come before
    # partition 7 (it did, now and then: the other rank then held none, its grant stayed 0, and nothing was used)
    group = start_group(2, f"{steady.ranks},{doomed.ranks}", "--stream", stream, "--timeout", "10", "--prefetch",
                        "1", "--prefetch-bytes", "1", *flags)
    killed = tmp_path / "killed"
    frame = staged_frame(spark, 8_000, 8, slow=7, gate=killed)
    thread, result = feeding(lambda: run(frame, [steady.feed, doomed.feed]))
    wait_for(lambda: epoch_figures(doomed, stream).get("acked", 0) >= 10, 60,
             "some batches of the doomed broker trained")
    assert epoch_figures(doomed, stream).get("committed", 0) < 4, "precondition: partition 7 not committed"
    doomed.proc.kill()                                   # for good
    doomed.proc.wait(5)
    killed.touch()
    return steady, group, finished(thread, result)


def test_one_of_two_brokers_killed_for_good_leaves_its_partitions_to_the_other(
        spark, small_arrow_batches, start_broker_process, start_group, tmp_path):
    steady, group, report = kill_one_of_two_mid_epoch(
        spark, start_broker_process, start_group, tmp_path, "survive",
        lambda frame, feeds: feed(frame, feeds, stream="survive", batch_size=100, timeout=4))
    summaries = group.wait(150)
    assert report.rows == 8_000
    assert_each_row_once(trained(group), 8_000)
    equal_steps(summaries)
    end = epoch_figures(steady, "survive")
    assert end["committed"] == 8 and end["adopted"] >= 10, end


def test_feed_epochs_goes_on_without_a_broker_lost_for_good(spark, small_arrow_batches, start_broker_process,
                                                           start_group, tmp_path):
    """One of two brokers killed for good in epoch 0: that epoch is recovered through the other, and the next epochs
    are opened and fed at the survivor only (the ranks read it alone from then on)."""
    steady, group, reports = kill_one_of_two_mid_epoch(
        spark, start_broker_process, start_group, tmp_path, "onward",
        lambda frame, feeds: feed_epochs(frame, feeds, epochs=2, stream="onward", shuffle=False, batch_size=100,
                                         timeout=4), "--epochs", "2")
    summaries = group.wait(150)
    assert [r.rows for r in reports] == [8_000, 8_000] and reports[1].brokers == (8, 0), reports
    assert epoch_figures(steady, "onward")["committed"] == 8
    for epoch in range(2):
        assert_each_row_once(trained(group, epoch=epoch), 8_000)
        assert len({s["epochs"][epoch]["batches"] for s in summaries}) == 1, summaries


def test_a_second_kill_during_the_recovery_is_recovered_too(spark, small_arrow_batches, start_broker_process,
                                                            start_ranks, tmp_path):
    broker = start_broker_process("--heartbeat", "200ms")
    ranks = start_ranks(2, broker.ranks, "--stream", "twice")
    killed = tmp_path / "killed"
    frame = staged_frame(spark, 6_000, 3, slow=2, slow_seconds=0.3, gate=killed)
    thread, result = feeding(lambda: feed(frame, broker.feed, stream="twice", batch_size=100, timeout=5,
                                          pack_bytes=0))
    wait_for(lambda: epoch_figures(broker, "twice").get("acked", 0) >= 15, 60, "some batches trained")
    broker.proc.kill()
    broker.proc.wait(5)
    first_incarnation_log = broker.log.read_text()
    broker.restart()
    killed.touch()
    # the recovery job streams to the restarted broker: partition 2 (slow) is not committed yet
    wait_for(lambda: (lambda e: e.get("rows_in", 0) >= 1_000 and e.get("committed", 3) < 3)(
        epoch_figures(broker, "twice")), 90, "the recovery job under way")
    broker.proc.kill()                                   # again, during the recovery
    broker.proc.wait(5)
    broker.restart()
    report = finished(thread, result)
    summaries = ranks.wait(150)
    assert report.rows == 6_000
    assert_each_row_once(trained(ranks), 6_000)
    equal_steps(summaries)
    assert len(broker.log.read_text()) > len(first_incarnation_log)


def test_a_recomputation_that_comes_out_differently_is_detected_and_reported(spark, start_broker_process,
                                                                            start_ranks, tmp_path):
    broker = start_broker_process("--heartbeat", "200ms")
    ranks = start_ranks(2, broker.ranks, "--stream", "fickle")
    flipped = tmp_path / "flipped"

    def produce(part, ids):         # computed in another order once the flag exists: not deterministic
        ids = list(ids)
        if os.path.exists(str(flipped)):
            ids.reverse()
        for value in ids:
            time.sleep(0.002)
            yield {"id": value, "x": np.float32(value)}

    rdd = spark.sparkContext.parallelize(range(6_000), 3).mapPartitionsWithIndex(produce)
    thread, result = feeding(lambda: feed(rdd, broker.feed, stream="fickle", batch_size=100, timeout=5,
                                          pack_bytes=0))
    wait_for(lambda: epoch_figures(broker, "fickle").get("acked", 0) >= 10, 60, "some batches trained")
    broker.proc.kill()
    broker.proc.wait(5)
    flipped.touch()
    broker.restart()
    report = finished(thread, result)
    summaries = ranks.wait(150)
    assert report.diverged and set(report.diverged) <= {0, 1, 2}, report
    caught = [w for w in result["warnings"] if issubclass(w.category, DivergedPartitionsWarning)]
    assert caught and str(list(report.diverged)) in str(caught[0].message)
    everything = trained(ranks)
    assert len(everything) == 6_000          # the rows of a diverged partition may be off; their count is not
    equal_steps(summaries)


def test_a_stream_whose_only_broker_stays_away_fails_the_feed_saying_what_to_do(spark, small_arrow_batches,
                                                                              start_broker_process, tmp_path):
    broker = start_broker_process("--heartbeat", "200ms")
    killed = tmp_path / "killed"
    frame = staged_frame(spark, 3_000, 3, slow=2, gate=killed)          # partition 2 open until the kill
    thread, result = feeding(lambda: feed(frame, broker.feed, stream="alone", batch_size=100, timeout=3))
    wait_for(lambda: epoch_figures(broker, "alone").get("batches_in", 0) >= 5, 60, "some batches in")
    broker.proc.kill()
    broker.proc.wait(5)
    killed.touch()
    thread.join(120)
    assert not thread.is_alive()
    error = result.get("error")
    assert error is not None and "--journal" in str(error), result


# ---- §3: exact resume from a mid-epoch checkpoint --------------------------------------------------------------

@pytest.mark.parametrize("old, new, restart, brokers", [(2, 3, False, 1), (2, 3, True, 1), (3, 2, False, 1),
                                                        (3, 2, True, 1), (3, 2, False, 2)],
                         ids=["2-on-3-broker-kept-running", "2-on-3-everything-restarted", "3-on-2",
                              "3-on-2-everything-restarted", "3-on-2-brokers"])
def test_a_checkpoint_resumes_on_another_number_of_ranks_exactly(spark, start_broker_process, start_ranks, old,
                                                                  new, restart, brokers):
    """``old`` ranks checkpoint after 5 steps and die after 9; ``new`` ranks resume from all their states
    (``resume=[...]``, each the same list) and ``feed_epochs(resume=[...])``: what the checkpointed model had used
    is not delivered again, the rest goes to the new group with equal steps, and no row is dropped."""
    every = [start_broker_process("--heartbeat", "200ms") for _ in range(brokers)]
    broker = every[0]
    ranks_address = ",".join(b.ranks for b in every)
    feed_address = [b.feed for b in every] if brokers > 1 else broker.feed
    first = start_ranks(old, ranks_address, "--stream", "elastic", "--checkpoint-at", "5", "--stop-after", "9")
    frame = staged_frame(spark, 4_000, 2)
    options = dict(stream="elastic", epochs=1, shuffle=False, batch_size=100, timeout=30, pack_bytes=0)
    feed_epochs(frame, feed_address, **options)
    first.wait_stopped([f"rank{r}" for r in range(old)])
    first.kill()
    if restart:
        broker.proc.kill()
        broker.proc.wait(5)
        broker.restart()
    states = [json.loads((first.out / f"rank{r}-state.json").read_text()) for r in range(old)]
    assert [(s["rank"], s["size"], s["epoch"], s["steps"]) for s in states] == [(r, old, 0, 5) for r in range(old)]
    second = start_ranks(new, ranks_address, "--stream", "elastic", "--resume-all", str(first.out))
    feed_epochs(frame, feed_address, resume=states, **options)
    summaries = second.wait(150)
    before = []
    for r in range(old):
        with np.load(first.out / f"rank{r}-checkpoint.npz") as data:
            before.append(data["id"])
    assert sum(len(b) for b in before) == old * 500
    assert_each_row_once(np.concatenate([*before, trained(second, ranks=new)]), 4_000)
    equal_steps(summaries)
    if brokers == 1:      # 40 batches less the checkpoint's 5 a rank, shared out (the one left over by rows)
        left = 40 - 5 * old
        assert [s["epochs"][0]["batches"] for s in summaries] == [left // new + (1 if left % new else 0)] * new


@pytest.mark.parametrize("restart, packs, epochs, stop_after", [
    (False, False, 1, 9), (True, False, 1, 9), (False, True, 1, 9), (False, False, 2, 30)],
    ids=["broker-kept-running", "everything-restarted", "inside-packs", "killed-in-the-next-epoch"])
def test_a_job_resumed_from_a_mid_epoch_checkpoint_trains_exactly_the_rest(spark, start_broker_process,
                                                                           start_ranks, restart, packs, epochs,
                                                                           stop_after):
    broker = start_broker_process("--heartbeat", "200ms")
    # checkpoint after 5 steps of epoch 0, killed after 9 (holding its 10th): steps 6..9 are trained again after the
    # resume; with packs (20 batches of 100 rows a partition, one message each) both positions are inside a pack;
    # killed in the next epoch (after 30 steps: 20 an epoch), what it trained of epoch 1 is trained again too
    first = start_ranks(2, broker.ranks, "--stream", "ckpt", "--epochs", str(epochs), "--checkpoint-at", "5",
                        "--stop-after", str(stop_after))
    frame = staged_frame(spark, 4_000, 2)
    options = dict(stream="ckpt", epochs=epochs, shuffle=False, batch_size=100, timeout=30,
                   **({} if packs else {"pack_bytes": 0}))
    feed_epochs(frame, broker.feed, **options)
    first.wait_stopped(["rank0", "rank1"])
    first.kill()
    if restart:
        broker.proc.kill()                               # no journal: the broker remembers nothing
        broker.proc.wait(5)
        broker.restart()
    states = [json.loads((first.out / f"rank{r}-state.json").read_text()) for r in range(2)]
    assert [s["epoch"] for s in states] == [0, 0] and [s["steps"] for s in states] == [5, 5], states
    if packs:          # the positions are inside packs: entries name a range of a message's batches
        assert all(any(e[3] - e[2] > 1 for e in st["used"]) for st in states), states
    second = start_ranks(2, broker.ranks, "--stream", "ckpt", "--epochs", str(epochs), "--resume", str(first.out))
    reports = feed_epochs(frame, broker.feed, resume=states[0], **options)
    summaries = second.wait(150)
    before = []
    for r in range(2):
        with np.load(first.out / f"rank{r}-checkpoint.npz") as data:
            before.append(data["id"])
    assert sum(len(b) for b in before) == 1_000
    assert_each_row_once(np.concatenate([*before, trained(second)]), 4_000)
    equal_steps(summaries)
    for epoch in range(1, epochs):     # an epoch after the checkpoint: whole, once
        assert_each_row_once(trained(second, epoch=epoch), 4_000)
        assert len({s["epochs"][epoch]["batches"] for s in summaries}) == 1
    assert [r.rows for r in reports] == [4_000] * epochs
