"""Starting, stopping and failing clearly: SIGTERM, unreachable brokers, refused input, RDDs, status."""

import signal
import sys
import threading
import time

import numpy as np
import pytest

from sparkbus.feeder import feed
from sparkbus.wire.errors import BrokerError
from sparkbus.worker import BatchStream

from harness import free_port_triple, run_child
from sources import labelled_frame

pytestmark = pytest.mark.timeout(120)


def test_sigterm_stops_the_broker_promptly_without_a_traceback(start_broker_process):
    broker = start_broker_process()
    rank = BatchStream(broker.ranks, stream="s", timeout=10)     # a connected rank does not hold it up
    try:
        started = time.monotonic()
        broker.proc.send_signal(signal.SIGTERM)
        assert broker.proc.wait(5) == 0
        assert time.monotonic() - started < 2.0
    finally:
        rank.close()
    log = broker.log.read_text()
    assert "Traceback" not in log
    assert "broker stopped" in log


def test_a_port_in_use_is_a_clear_error(start_broker_process, tmp_path):
    broker = start_broker_process()
    port = int(broker.feed.rsplit(":", 1)[1])
    result = run_child([sys.executable, "-m", "sparkbus.broker", "--feed", f"tcp://127.0.0.1:{port}",
                        "--ranks", f"tcp://127.0.0.1:{free_port_triple()}"], timeout=20)
    assert result.returncode == 2
    assert f"cannot bind the feed socket to tcp://127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr


def test_feed_to_an_unreachable_broker_fails_within_its_timeout(spark):
    address = f"tcp://127.0.0.1:{free_port_triple()}"
    started = time.monotonic()
    with pytest.raises(BrokerError, match="no reply from the sparkbus broker"):
        feed(labelled_frame(spark, 10, 1), address, timeout=2)
    assert time.monotonic() - started < 10


def test_a_rank_with_an_unreachable_broker_fails_within_its_timeout():
    started = time.monotonic()
    with pytest.raises(BrokerError, match="no answer from a sparkbus broker"):
        BatchStream(f"tcp://127.0.0.1:{free_port_triple()}", timeout=1)
    assert time.monotonic() - started < 5


def test_a_rank_notices_its_broker_has_gone(start_broker_process):
    broker = start_broker_process()
    stream = BatchStream(broker.ranks, stream="s", timeout=2, heartbeat=0.2)
    broker.proc.kill()
    broker.proc.wait(5)
    started = time.monotonic()
    with pytest.raises(BrokerError, match="has been silent"):
        next(iter(stream.epoch()))
    assert time.monotonic() - started < 5
    stream.close()


def test_unsupported_columns_are_refused_by_name_before_any_job(spark, start_broker_process):
    broker = start_broker_process()
    df = spark.createDataFrame([(1, {"a": 1})], "id long, label map<string, int>")
    with pytest.raises(TypeError, match="column 'label' is a map"):
        feed(df, broker.feed)
    with pytest.raises(TypeError, match="column 'nope' is not in the DataFrame"):
        feed(df, broker.feed, columns=["id", "nope"])
    assert broker.stats()["streams"] == {}


def test_rdds_of_dicts_and_tuples_are_fed(spark, start_broker_process):
    broker = start_broker_process()
    sc = spark.sparkContext
    dicts = sc.parallelize(range(1_000), 4).map(lambda i: {"id": i, "x": np.full(3, i, np.float32)})
    tuples = sc.parallelize(range(500), 2).map(lambda i: (i, float(i) / 2))
    got = {"dicts": [], "tuples": []}
    with BatchStream(broker.ranks, stream="rdd", timeout=30) as stream:
        def consume():
            for name in ("dicts", "tuples"):
                got[name] = [{k: v.copy() for k, v in b.items()} for b in stream.epoch()]
        consumer = threading.Thread(target=consume)
        consumer.start()
        assert feed(dicts, broker.feed, stream="rdd", epoch=0, batch_size=128).rows == 1_000
        assert feed(tuples, broker.feed, stream="rdd", epoch=1, batch_size=128).rows == 500
        consumer.join(60)
    ids = np.concatenate([b["id"] for b in got["dicts"]])
    np.testing.assert_array_equal(np.sort(ids), np.arange(1_000))
    xs = np.concatenate([b["x"] for b in got["dicts"]])
    assert xs.dtype == np.float32 and xs.shape == (1_000, 3)
    np.testing.assert_array_equal(xs[:, 2], ids)
    firsts = np.concatenate([b["_1"] for b in got["tuples"]])
    seconds = np.concatenate([b["_2"] for b in got["tuples"]])
    np.testing.assert_array_equal(np.sort(firsts), np.arange(500))
    np.testing.assert_array_equal(seconds, firsts / 2)


def test_status_prints_live_figures(spark, start_broker_process):
    broker = start_broker_process()
    with BatchStream(broker.ranks, stream="st", timeout=30, prefetch=3) as stream:
        consumer = threading.Thread(target=lambda: sum(1 for _ in stream.epoch()))
        consumer.start()
        feed(labelled_frame(spark, 1_000, 2), broker.feed, stream="st", batch_size=100)
        consumer.join(30)
        result = run_child([sys.executable, "-m", "sparkbus.broker.cli", "status", broker.control], timeout=30)
    assert result.returncode == 0, result.stderr
    assert "stream 'st': 1 of 1 ranks" in result.stdout
    assert "epoch 0 (ended): partitions 2/2, in 10 batches" in result.stdout
    assert "rank 0/1: window 3 / 8.0 MiB, in flight 0, batches 10" in result.stdout
    unreachable = run_child([sys.executable, "-m", "sparkbus.broker.cli", "status", f"tcp://127.0.0.1:{free_port_triple()}",
                             "--timeout", "1s"], timeout=30)
    assert unreachable.returncode == 1 and "no reply from the sparkbus broker" in unreachable.stderr
