"""Several brokers serving one stream: partitions spread over them, every rank consumes from every broker."""

import json
import subprocess
import sys

import numpy as np
import pytest

from feeder import feed
from sources import check_values, labelled_frame, staged_rdd

pytestmark = pytest.mark.timeout(180)


def test_two_brokers_one_stream_every_row_once_with_equal_steps(spark, start_broker, start_ranks):
    brokers = [start_broker(), start_broker()]
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


def test_a_retried_task_goes_to_the_broker_its_first_attempt_chose(spark, start_broker, start_ranks):
    brokers = [start_broker(), start_broker()]
    ranks = start_ranks(0, ",".join(b.ranks for b in brokers), "--stream", "retry2")
    # 1,500 rows (15 batches, one per message) before the failure: more than the task's send queue holds
    report = feed(staged_rdd(spark, 8_000, 4, fail=1), [b.feed for b in brokers], stream="retry2",
                  batch_size=100, timeout=60, pack_bytes=0)
    (summary,) = ranks.wait()
    ids = ranks.epoch(ranks.name, 0)["id"]
    np.testing.assert_array_equal(np.sort(ids), np.arange(8_000))
    duplicates = sum(b.stats()["streams"]["retry2"]["epochs"]["0"]["duplicates"] for b in brokers)
    assert duplicates >= 1, "the retry's copies were not recognised as duplicates at one broker"
    assert report.rows == 8_000 and summary["epochs"][0]["rows"] == 8_000


def test_status_shows_each_broker_and_the_totals(spark, start_broker):
    brokers = [start_broker(), start_broker()]
    feed(labelled_frame(spark, rows=1_000, partitions=2), [b.feed for b in brokers], stream="st",
         batch_size=100, timeout=60)
    out = subprocess.run([sys.executable, "-m", "broker.cli", "status", ",".join(b.control for b in brokers),
                          "--json"], capture_output=True, text=True, timeout=30, check=True).stdout
    figures = json.loads(out)
    assert set(figures["brokers"]) == {b.control for b in brokers}
    assert figures["totals"]["streams"]["st"]["rows_in"] == 1_000
    assert figures["totals"]["brokers"] == 2
    text = subprocess.run([sys.executable, "-m", "broker.cli", "status", ",".join(b.control for b in brokers)],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    assert "all 2 brokers" in text and all(b.control in text for b in brokers)
