"""Several brokers serving one stream: partitions spread over them, every rank consumes from every broker."""

import json
import sys
import threading

import numpy as np
import pytest

from sparkbus.feeder import feed
from sparkbus.wire.errors import BrokerError

from harness import run_child, wait_for
from sources import Collector, check_values, labelled_frame, staged_frame, staged_rdd

pytestmark = pytest.mark.timeout(180)


def test_two_brokers_one_stream_every_row_once_with_equal_steps(spark, start_broker_process, start_ranks):
    brokers = [start_broker_process(), start_broker_process()]
    ranks = start_ranks(2, ",".join(b.ranks for b in brokers), "--stream", "pair", "--epochs", "2")
    feeds = [b.feed for b in brokers]
    df = labelled_frame(spark, rows=8_000, partitions=8)
    reports = [feed(df, feeds, stream="pair", epoch=0, batch_size=250, timeout=60),
               feed(df, ",".join(feeds), stream="pair", epoch=1, batch_size=250, timeout=60)]
    summaries = ranks.wait()
    for epoch, report in enumerate(reports):
        assert report.rows == 8_000 and sum(report.brokers) == 8
        assert min(report.brokers) >= 1, f"partitions were not spread: {report.brokers}"
        kept = np.concatenate([ranks.epoch(r, epoch)["id"] for r in range(2)])
        dropped = np.concatenate([ranks.epoch(r, epoch)["dropped_id"] for r in range(2)])
        np.testing.assert_array_equal(np.sort(np.concatenate([kept, dropped])), np.arange(8_000))
        counts = [s["epochs"][epoch]["batches"] for s in summaries]
        assert counts[0] == counts[1]
        assert sum(s["epochs"][epoch]["dropped_batches"] for s in summaries) <= 1
        for r in range(2):
            check_values(ranks.epoch(r, epoch))
    # each broker carried exactly the partitions the report says, and the ranks took batches from both
    for broker, share in zip(brokers, reports[0].brokers):
        epoch0 = broker.stats()["streams"]["pair"]["epochs"]["0"]
        assert epoch0["committed"] == share and epoch0["rows_in"] == 1_000 * share


def test_a_retried_task_goes_to_the_broker_its_first_attempt_chose(spark, start_broker_process, start_ranks):
    brokers = [start_broker_process(), start_broker_process()]
    ranks = start_ranks(0, ",".join(b.ranks for b in brokers), "--stream", "retry2")
    # 1,500 rows (15 batches, one per message) before the failure: more than the task's send queue holds
    report = feed(staged_rdd(spark, 8_000, 4, fail=1, seen_at=[b.control for b in brokers], stream="retry2"),
                  [b.feed for b in brokers], stream="retry2", batch_size=100, timeout=60, pack_bytes=0)
    (summary,) = ranks.wait()
    ids = ranks.epoch(ranks.name, 0)["id"]
    np.testing.assert_array_equal(np.sort(ids), np.arange(8_000))
    duplicates = sum(b.stats()["streams"]["retry2"]["epochs"]["0"]["duplicates"] for b in brokers)
    assert duplicates >= 1, "the retry's copies were not recognised as duplicates at one broker"
    assert report.rows == 8_000 and summary["epochs"][0]["rows"] == 8_000


@pytest.mark.filterwarnings("ignore::sparkbus.feeder.NoRanksWarning")     # no rank reads it, on purpose
def test_status_shows_each_broker_and_the_totals(spark, start_broker_process):
    brokers = [start_broker_process(), start_broker_process()]
    feed(labelled_frame(spark, rows=1_000, partitions=2), [b.feed for b in brokers], stream="st",
         batch_size=100, timeout=60)
    out = run_child([sys.executable, "-m", "sparkbus.broker.cli", "status", ",".join(b.control for b in brokers),
                     "--json"],
                    timeout=30, check=True).stdout
    figures = json.loads(out)
    assert set(figures["brokers"]) == {b.control for b in brokers}
    assert figures["totals"]["streams"]["st"]["rows_in"] == 1_000
    assert figures["totals"]["brokers"] == 2
    text = run_child([sys.executable, "-m", "sparkbus.broker.cli", "status", ",".join(b.control for b in brokers)],
                     timeout=30, check=True).stdout
    assert "all 2 brokers" in text and all(b.control in text for b in brokers)


def acked_at(broker, stream):
    return broker.stats()["streams"].get(stream, {}).get("epochs", {}).get("0", {}).get("acked", 0)


def test_one_of_two_brokers_killed_and_restarted_with_its_journal_loses_nothing(spark, small_arrow_batches,
                                                                                start_broker_process, tmp_path):
    steady = start_broker_process()
    durable = start_broker_process("--journal", str(tmp_path / "journal"), "--heartbeat", "200ms")
    consumer = Collector(f"{steady.ranks},{durable.ranks}", "durable2", timeout=60)
    result = {}
    frame = staged_frame(spark, 8_000, 4, slow=3, slow_seconds=0.1)     # partition 3 (the second broker's) is slow
    feeding = threading.Thread(target=lambda: result.update(report=feed(
        frame, [steady.feed, durable.feed], stream="durable2", batch_size=100, timeout=5, pack_bytes=0)))
    feeding.start()
    wait_for(lambda: acked_at(durable, "durable2") >= 20, 60, "some batches acknowledged by the second broker")
    durable.proc.kill()                                  # kill -9, mid-epoch
    durable.proc.wait(5)
    durable.restart()
    feeding.join(120)
    assert "report" in result, "feed() did not finish after the restart"
    assert result["report"].brokers == (2, 2)
    (ids,) = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(8_000))
    assert "journal replayed" in durable.log.read_text()


def test_one_of_two_brokers_restarted_without_journal_fails_a_feed_without_recovery_naming_it(
        spark, small_arrow_batches, start_broker_process, tmp_path):
    steady, volatile = start_broker_process(), start_broker_process()
    killed = tmp_path / "killed"
    frame = staged_frame(spark, 4_000, 4, slow=3, slow_seconds=0.2, gate=killed)    # 3 open until the restart
    errors = []

    def run():
        try:
            feed(frame, [steady.feed, volatile.feed], stream="volatile2", batch_size=100, timeout=3, pack_bytes=0,
                 recover=False)
        except Exception as exc:       # checked below
            errors.append(exc)

    feeding = threading.Thread(target=run)
    feeding.start()
    wait_for(lambda: volatile.stats()["streams"].get("volatile2", {}).get("epochs", {}).get("0", {}).get(
        "batches_in", 0) >= 5, 60, "some batches in at the second broker")
    volatile.proc.kill()
    volatile.proc.wait(5)
    volatile.restart()
    killed.touch()
    feeding.join(120)
    assert len(errors) == 1 and isinstance(errors[0], BrokerError), errors
    assert f"the broker at {volatile.control} restarted while stream 'volatile2' epoch 0" in str(errors[0])
    assert "without --journal" in str(errors[0])
