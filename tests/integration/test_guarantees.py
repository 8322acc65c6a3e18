"""Nothing lost, nothing twice: Spark retries and speculation, consumers and MPI jobs dying, broker restarts.

Every test asserts the exact multiset of row ids the consumers received.
"""

import threading
import time
import warnings

import numpy as np
import pytest

from sparkbus.broker.client import ControlClient
from sparkbus.feeder import DivergedPartitionsWarning, feed, stream_partition
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.protocol import Kind

from harness import wait_for
from sources import Collector, staged_frame, staged_rdd

pytestmark = pytest.mark.timeout(180)


def test_a_task_failing_midway_is_retried_and_each_row_arrives_once(spark, start_broker_process):
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "retry")
    # pack_bytes=0: these 1.2 kB batches go one per message, so part of the partition is on the wire when it fails
    report = feed(staged_rdd(spark, 4_000, 2, fail=1, seen_at=[broker.control], stream="retry"), broker.feed,
                  stream="retry", batch_size=100, timeout=30, pack_bytes=0)
    (ids,) = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(4_000))
    assert report.rows == 4_000 and report.diverged == ()
    epoch = broker.stats()["streams"]["retry"]["epochs"]["0"]
    # the failed attempt pushed 15 batches through a send queue of 8 before it died: some reached the broker
    assert epoch["duplicates"] >= 1, "the failed attempt's batches should have reached the broker first"
    assert epoch["batches_in"] == 40


def test_a_task_failing_midway_through_packs_is_retried_and_each_row_arrives_once(spark, start_broker_process):
    """Small batches travel in packs of 64; the failed attempt sent whole packs, the retry sends the same packs."""
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "packs")
    report = feed(staged_rdd(spark, 20_000, 2, fail=1, fail_after=9_500, seen_at=[broker.control], stream="packs"),
                  broker.feed, stream="packs", batch_size=100, timeout=30)
    (ids,) = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(20_000))
    assert report.rows == 20_000 and report.batches == 200 and report.diverged == ()
    epoch = broker.stats()["streams"]["packs"]["epochs"]["0"]
    assert epoch["batches_in"] == 200, "the broker counts the batches in its packs"
    assert epoch["rows_in"] == 20_000
    assert epoch["duplicates"] >= 1, "the failed attempt's first pack (6,400 rows) reached the broker first"


def test_speculative_copies_stream_at_once_and_each_row_arrives_once(start_broker_process):
    """Two attempts of one partition push at once, as a speculative copy does. Spark does not speculate in
    local mode (and did not in local-cluster mode here), so the two attempts are the feeder's real task code
    (``stream_partition``) run side by side, the driver's part done through the control socket."""
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "spec")
    with ControlClient(broker.control, 10) as driver:
        driver.request(Kind.EPOCH_OPEN, stream="spec", epoch=0, partitions=1, delivery="stream")

        def arrived():
            epoch = broker.stats()["streams"]["spec"]["epochs"]["0"]
            return epoch["batches_in"] + epoch["duplicates"]

        def batches(slow):
            for start in range(0, 2_000, 100):
                if slow:
                    time.sleep(0.05)
                ids = np.arange(start, start + 100)
                yield {"id": ids, "x": ids.astype(np.float32)}
            if slow:
                # The losing attempt's PARTITION_END is answered at once (the partition is committed), and what is
                # still in its socket then is dropped: its last batch may never reach the broker to be counted.
                wait_for(lambda: arrived() == 40, 30, "both attempts' 40 batches at the broker")

        reports = {}
        attempts = [threading.Thread(target=lambda a=a: reports.update({a: stream_partition(
            batches(slow=a == 0), broker.feed, broker.control, "spec", 0, 0, a, 30, pack_bytes=0)}))
            for a in (0, 1)]
        for t in attempts:
            t.start()
        for t in attempts:
            t.join(60)
        assert reports[0].batches == reports[1].batches == 20       # both attempts completed and committed
        driver.request(Kind.EPOCH_CLOSE, stream="spec", epoch=0, partitions=1)
    (ids,) = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(2_000))
    epoch = broker.stats()["streams"]["spec"]["epochs"]["0"]
    assert epoch["duplicates"] == 20 and epoch["batches_in"] == 20 and epoch["diverged"] == []


def test_a_retry_in_another_order_is_reported_in_stream_delivery(spark, start_broker_process):
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "reorder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = feed(staged_rdd(spark, 4_000, 2, fail=1, reverse_on_retry=True, seen_at=[broker.control],
                                 stream="reorder"), broker.feed, stream="reorder", batch_size=100, timeout=30,
                      pack_bytes=0)
    (ids,) = consumer.result()
    assert report.diverged == (1,)
    assert any(issubclass(w.category, DivergedPartitionsWarning) and "partitions [1]" in str(w.message)
               for w in caught)
    # what stream delivery does here, and why the warning is loud: partition 1's first five batches came from
    # the first attempt and the rest from the retry, so some rows came twice and others never
    assert len(ids) == 4_000
    assert len(np.unique(ids)) < 4_000


def test_atomic_delivery_is_exactly_once_even_when_a_retry_reorders(spark, start_broker_process):
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "atomic")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        report = feed(staged_rdd(spark, 4_000, 2, fail=1, reverse_on_retry=True, seen_at=[broker.control],
                                 stream="atomic"), broker.feed, stream="atomic", batch_size=100, timeout=30,
                      delivery="atomic", pack_bytes=0)
    (ids,) = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(4_000))
    assert report.diverged == (1,)
    assert broker.stats()["broker"]["buffered_bytes"] == 0


def test_a_consumer_killed_mid_epoch_leaves_its_batches_to_the_other(spark, start_broker_process, start_ranks):
    broker = start_broker_process("--heartbeat", "200ms")
    victim = start_ranks(0, broker.ranks, "--stream", "kill1", "--stop-after", "5", "--prefetch", "4")
    survivor = start_ranks(0, broker.ranks, "--stream", "kill1", "--slow-rank", "0", "--slow-seconds", "0.02")
    # both joined before the feed: a survivor alone could take the whole epoch before a late victim's first batch
    wait_for(lambda: len(broker.stats()["streams"].get("kill1", {}).get("ranks", [])) == 2, 60, "both consumers")
    # one batch a message (pack_bytes=0): the victim dies between batches, not inside a pack
    feeding = threading.Thread(target=feed, args=(staged_frame(spark, 6_000, 2), broker.feed),
                               kwargs=dict(stream="kill1", batch_size=100, timeout=60, pack_bytes=0))
    feeding.start()
    wait_for(lambda: victim.stopped(victim.name), 60, "the victim to stop after five batches")
    wait_for(lambda: any(r["acked"] == 5 and r["inflight"] > 0
                         for r in broker.stats()["streams"]["kill1"]["ranks"]), 10, "five acks from the victim")
    victim.kill()
    feeding.join(90)
    survivor.wait()
    taken = victim.epoch(victim.name, 0)["id"]
    assert len(taken) == 500
    both = np.concatenate([taken, survivor.epoch(survivor.name, 0)["id"]])
    np.testing.assert_array_equal(np.sort(both), np.arange(6_000))


def test_a_consumer_killed_inside_a_pack_costs_at_most_a_batch_window_again(spark, start_broker_process,
                                                                            killed_inside_a_pack):
    """Small batches travel in packs of 64. A consumer says how far it got in a pack every batch window (4): one
    that dies inside a pack has only the rest of it redelivered, so the survivor trains again what the victim used
    since it last said so, at most a window: here its fifth batch."""
    broker = start_broker_process("--heartbeat", "200ms", "--rejoin-grace", "1s")
    # there are only 4 packs, which a consumer alone could take in its window
    victim, survivor = killed_inside_a_pack(broker, "kill2", lambda: staged_frame(spark, 25_600, 2))
    taken = victim.epoch(victim.name, 0)["id"]
    kept = survivor.epoch(survivor.name, 0)["id"]
    np.testing.assert_array_equal(np.sort(np.concatenate([taken, kept])),
                                  np.sort(np.concatenate([np.arange(25_600), taken[400:]])))
    assert len(taken) == 500 and len(kept) == 25_200, "every row once, but the victim's fifth batch twice"
    assert np.ptp(taken) < 64 * 100, "the five batches the victim trained lie in one pack"
    epoch = broker.stats()["streams"]["kill2"]["epochs"]["0"]
    assert epoch["redelivered"] % 64 == 60, "the pack's unused 60 batches went again (and whole packs it held)"


def test_an_mpi_job_killed_inside_packs_trains_at_most_a_window_again(spark, start_broker_process, start_ranks):
    """The regression of issue 18: 200-row batches in packs, prefetch=4, both ranks stop after 30 batches and the
    job is SIGKILLed; the job started after it trains again at most each rank's window plus the batch in hand."""
    broker = start_broker_process("--heartbeat", "200ms", "--rejoin-grace", "1s")
    first = start_ranks(2, broker.ranks, "--stream", "packs", "--stop-after", "30", "--prefetch", "4")
    feed(staged_frame(spark, 20_000, 2), broker.feed, stream="packs", batch_size=200, timeout=60)
    wait_for(lambda: first.stopped("rank0") and first.stopped("rank1"), 60, "both ranks to stop after 30 steps")
    wait_for(lambda: sum(r["acked"] for r in broker.stats()["streams"]["packs"]["ranks"]) >= 56, 10,
             "the ranks' progress to reach the broker")
    first.kill()
    second = start_ranks(2, broker.ranks, "--stream", "packs")
    second.wait()
    before = np.concatenate([first.epoch(r, 0)["id"] for r in range(2)])
    after = np.concatenate([second.epoch(r, 0)[key] for r in range(2) for key in ("id", "dropped_id")])
    assert len(before) == 2 * 30 * 200
    np.testing.assert_array_equal(np.unique(np.concatenate([before, after])), np.arange(20_000))
    twice = np.intersect1d(before, after)
    assert len(twice) <= 2 * (4 + 1) * 200, f"{len(twice)} rows trained again"


def test_an_mpi_job_killed_and_restarted_resumes_the_stream(spark, start_broker_process, start_ranks):
    broker = start_broker_process("--heartbeat", "200ms")
    first = start_ranks(2, broker.ranks, "--stream", "job", "--stop-after", "3")
    report = feed(staged_frame(spark, 4_000, 2), broker.feed, stream="job", batch_size=100, timeout=60,
                  pack_bytes=0)     # one batch a message: the ranks stop between batches
    wait_for(lambda: first.stopped("rank0") and first.stopped("rank1"), 60, "both ranks to stop after 3 steps")
    seen = {}

    def six_acks():
        seen.update(broker.stats()["streams"]["job"])
        return sum(r["acked"] for r in seen["ranks"]) == 6

    try:
        wait_for(six_acks, 10, "six acks")
    except TimeoutError:
        raise AssertionError(f"not six acks: {seen['ranks']}, epochs {seen['epochs']}") from None
    first.kill()
    wait_for(lambda: not broker.stats()["streams"]["job"]["ranks"], 10, "the broker to notice the dead job")
    second = start_ranks(2, broker.ranks, "--stream", "job")           # Spark is not run again
    second.wait()
    before = np.concatenate([first.epoch(r, 0)["id"] for r in range(2)])
    after = [second.epoch(r, 0) for r in range(2)]
    assert len(before) == 600 and len(after[0]["id"]) == len(after[1]["id"])
    everything = np.concatenate([before, *(a["id"] for a in after), *(a["dropped_id"] for a in after)])
    np.testing.assert_array_equal(np.sort(everything), np.arange(4_000))
    assert report.rows == 4_000


def test_a_broker_killed_and_restarted_with_its_journal_loses_nothing(spark, small_arrow_batches, start_broker_process,
                                                                      tmp_path):
    broker = start_broker_process("--journal", str(tmp_path / "journal"), "--heartbeat", "200ms")
    consumer = Collector(broker.ranks, "durable", timeout=60)
    result = {}
    frame = staged_frame(spark, 6_000, 3, slow=2, slow_seconds=0.1)     # partition 2 takes ~2 s
    feeding = threading.Thread(target=lambda: result.update(report=feed(
        frame, broker.feed, stream="durable", batch_size=100, timeout=5)))
    feeding.start()
    wait_for(lambda: broker.stats()["streams"].get("durable", {}).get("epochs", {}).get("0", {}).get("acked", 0)
             >= 20, 60, "some batches acknowledged")
    broker.proc.kill()                                   # kill -9, mid-epoch
    broker.proc.wait(5)
    broker.restart()
    feeding.join(120)
    assert "report" in result, "feed() did not finish after the restart"
    (ids,) = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(6_000))
    assert "journal replayed" in broker.log.read_text()


def test_a_broker_restart_without_journal_fails_the_feed_loudly_with_recover_false(spark, small_arrow_batches,
                                                                                   start_broker_process, tmp_path):
    broker = start_broker_process()
    killed = tmp_path / "killed"
    frame = staged_frame(spark, 3_000, 3, slow=2, slow_seconds=0.2, gate=killed)    # 2 open until the restart
    errors = []

    def run():
        try:
            feed(frame, broker.feed, stream="volatile", batch_size=100, timeout=3, recover=False)
        except Exception as exc:       # checked below
            errors.append(exc)

    feeding = threading.Thread(target=run)
    feeding.start()
    wait_for(lambda: broker.stats()["streams"].get("volatile", {}).get("epochs", {}).get("0", {}).get(
        "batches_in", 0) >= 5, 60, "some batches in")
    broker.proc.kill()
    broker.proc.wait(5)
    broker.restart()
    killed.touch()
    feeding.join(120)
    assert len(errors) == 1
    assert isinstance(errors[0], BrokerError)
    assert "restarted while stream 'volatile' epoch 0 was being fed" in str(errors[0])
    assert "without --journal" in str(errors[0])


def test_a_rank_that_raises_aborts_the_job_instead_of_hanging_its_peers(spark, start_broker_process, start_ranks):
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "boom", "--raise-rank", "1", "--raise-after", "2")
    feed(staged_frame(spark, 2_000, 2), broker.feed, stream="boom", batch_size=100, timeout=60)
    started = time.monotonic()
    _, err = ranks.proc.communicate(timeout=60)
    assert ranks.proc.returncode != 0
    assert time.monotonic() - started < 30
    assert "rank 1 fails on purpose" in err
    assert "aborting the MPI job so the other ranks do not wait forever" in err
