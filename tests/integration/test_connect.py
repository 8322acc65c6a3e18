"""Feeding from a Spark Connect session: no RDD, no SparkContext; the job is ``mapInArrow(...).collect()``.

The Connect client is a child process (``connect_driver.py``, once for the module): a classic session and a
Connect one do not share a process, and the suite's own session (``spark`` in conftest.py) is classic. It runs
``SparkSession.builder.remote("local[2,4]")``, a Connect server in that process from the pyspark wheel, which
retries a failed task (plain ``local[N]`` never does). Each test has its own broker and asserts the exact multiset
of row ids that arrived.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import zmq

from sparkbus.feeder import feed
from sparkbus.launch.processes import ChildProcess, LaunchError, wait_for
from sparkbus.wire.errors import FeedError

from harness import free_port_triple
from sources import Collector, check_values, failing_frame, labelled_frame

HERE = Path(__file__).parent
START_SECONDS = 120          # the Connect session's start: ~6-20 s here, more on a loaded machine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class ConnectDriver:
    """The Connect client process: ``request(...)`` sends one request and returns its answer."""

    def __init__(self, child: ChildProcess, control: str, started: float):
        self.child, self.control, self.started = child, control, started

    def request(self, message: dict, timeout: float = 120) -> dict:
        with zmq.Context.instance().socket(zmq.REQ) as sock:     # a fresh REQ: a timed-out one is unusable
            sock.linger = 0
            sock.connect(self.control)
            sock.send(json.dumps(message).encode())
            if not sock.poll(timeout * 1000):
                raise AssertionError(f"the Connect driver did not answer {message['cmd']} within {timeout:g} s; "
                                     f"the end of {self.child.log}:\n{self.child.tail(40)}")
            return json.loads(sock.recv())

    def feed(self, source: dict, address: str, **kwargs) -> dict:
        """``feeder.feed`` of ``source`` there; its FeedReport as a dict."""
        reply = self.request({"cmd": "feed", "source": source, "address": address, "kwargs": kwargs})
        assert "error" not in reply, f"{reply['error']}\nthe end of {self.child.log}:\n{self.child.tail(40)}"
        return reply["report"]


@pytest.fixture(scope="module")
def connect(tmp_path_factory):
    """The Connect client process, ready; stopped at the end of the module with everything it started (its
    Connect server's JVM and Python workers): one left running fails the module's last test."""
    home = tmp_path_factory.mktemp("connect")
    ready = home / "ready.json"
    child = ChildProcess("connect-driver", [sys.executable, str(HERE / "connect_driver.py"), "--ready", str(ready)],
                         home / "driver.log", cwd=home)
    try:
        wait_for(lambda: ready.exists() or child.returncode is not None, START_SECONDS,
                 "the Spark Connect session to start")
        if child.returncode is not None:
            raise LaunchError(f"the Connect driver exited with {child.returncode}:\n{child.tail(40)}")
        info = json.loads(ready.read_text())
        yield ConnectDriver(child, info["control"], info["started"])
        started = psutil.Process(child.pid).children(recursive=True)
        assert ConnectDriver(child, info["control"], 0).request({"cmd": "stop"}, 60) == {"stopped": True}
        assert child.wait(30) == 0, child.tail(40)
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, f"the Connect driver left {[p.pid for p in alive]} running"
    finally:
        child.stop()


def kept_and_dropped(ranks, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids the two ranks yielded in ``epoch``, and those they dropped to even their steps."""
    kept = [ranks.epoch(r, epoch).get("id", np.zeros(0, np.int64)) for r in range(2)]
    dropped = [ranks.epoch(r, epoch)["dropped_id"] for r in range(2)]
    return np.concatenate(kept), np.concatenate(dropped)


def test_feed_epochs_delivers_every_row_once_over_two_epochs_with_equal_steps(connect, start_broker_process,
                                                                               start_ranks):
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "connect", "--epochs", "2")
    reply = connect.request({"cmd": "feed_epochs", "address": broker.feed, "epochs": 2,
                             "source": {"kind": "labelled", "rows": 12_000, "partitions": 3},
                             "kwargs": {"stream": "connect", "batch_size": 500, "shuffle_seed": 7, "key": ["id"],
                                        "timeout": 60}})
    assert "error" not in reply, reply["error"]
    summaries = ranks.wait()
    # no partitions given: a Connect DataFrame does not tell its own, so each epoch has spark.sql.shuffle.partitions
    assert [(r["partitions"], r["rows"]) for r in reply["reports"]] == [(4, 12_000), (4, 12_000)]
    epochs = broker.stats()["streams"]["connect"]["epochs"]
    for epoch in (0, 1):
        # the broker learnt the count at EPOCH_CLOSE, from the job's reports
        assert epochs[str(epoch)]["partitions"] == epochs[str(epoch)]["committed"] == 4
        kept, dropped = kept_and_dropped(ranks, epoch)
        np.testing.assert_array_equal(np.sort(np.concatenate([kept, dropped])), np.arange(12_000))
        steps = [s["epochs"][epoch]["batches"] for s in summaries]
        assert steps[0] == steps[1] and sum(steps) == reply["reports"][epoch]["batches"] - sum(
            s["epochs"][epoch]["dropped_batches"] for s in summaries)
        assert sum(s["epochs"][epoch]["dropped_batches"] for s in summaries) <= 1
        for r in range(2):
            if steps[r]:
                check_values(ranks.epoch(r, epoch))
            assert summaries[r]["epochs"][epoch]["dtypes"] == {
                "id": "int64", "x": "float32", "y": "int32", "flag": "bool", "w": "float64", "v": "float64"}


def test_empty_partitions_are_counted_from_the_jobs_reports(connect, start_broker_process):
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "sparse", timeout=60)
    # ids 0, 1, 2 in 5 partitions: two of them are empty, and their tasks report (and commit) all the same
    report = connect.feed({"kind": "failing", "rows": 3, "partitions": 5, "fail": -1, "fail_after": 0,
                           "control": broker.control, "stream": "sparse", "wait_rows": 0},
                          broker.feed, stream="sparse", columns=["id", "x"], timeout=30)
    [ids] = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), [0, 1, 2])
    assert (report["partitions"], report["rows"], report["batches"]) == (5, 3, 3)
    epoch = broker.stats()["streams"]["sparse"]["epochs"]["0"]
    assert (epoch["partitions"], epoch["committed"], epoch["rows_in"]) == (5, 5, 3)


def test_a_task_retried_mid_partition_still_delivers_every_row_once(connect, start_broker_process):
    # No rank reads at first and the broker holds 512 KiB: each feeding task, part-way through its partition, waits
    # for room longer than its timeout and fails (FeedTimeout); once Spark has lost the first attempt, a consumer
    # starts, and the retries send the batches the broker already holds again
    broker = start_broker_process("--max-buffer", "512KiB")
    lost = connect.child.log.read_text().count("Lost task")
    source = {"kind": "failing", "rows": 3_000, "partitions": 2, "fail": -1, "fail_after": 0,
              "control": broker.control, "stream": "retried", "wait_rows": 0}
    with ThreadPoolExecutor(1) as pool:
        feeding = pool.submit(connect.feed, source, broker.feed, stream="retried", batch_size=100,
                              arrow_batch_rows=100, pack_bytes=0, timeout=3)
        wait_for(lambda: connect.child.log.read_text().count("Lost task") > lost or feeding.done(), 60,
                 "Spark to lose a feeding task")
        consumer = Collector(broker.ranks, "retried", timeout=60)
        report = feeding.result(90)
    [ids] = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(3_000))
    assert (report["partitions"], report["rows"], report["diverged"]) == (2, 3_000, [])
    epoch = broker.stats()["streams"]["retried"]["epochs"]["0"]
    assert epoch["rows_in"] == 3_000 and epoch["committed"] == 2
    assert epoch["duplicates"] >= 1, "the failed attempts' batches should have reached the broker first"


def test_a_broker_restarted_without_journal_is_recovered_from_lineage_on_spark_connect(connect,
                                                                                     start_broker_process, tmp_path):
    # Spark Connect has no runJob: the recovery job runs over every partition, those not to feed again sending
    # nothing; the partition count is learned from its reports when the first job was cancelled before any
    broker = start_broker_process("--heartbeat", "200ms")
    consumer = Collector(broker.ranks, "lineage", timeout=60)
    killed = tmp_path / "killed"           # partition 2 (slow) stops after 5 batches until the broker is back
    source = {"kind": "staged", "rows": 6_000, "partitions": 3, "slow": 2, "slow_seconds": 0.3, "gate": str(killed)}
    with ThreadPoolExecutor(1) as pool:
        feeding = pool.submit(connect.feed, source, broker.feed, stream="lineage", batch_size=100, pack_bytes=0,
                              timeout=5)
        wait_for(lambda: broker.stats()["streams"].get("lineage", {}).get("epochs", {}).get("0", {}).get(
            "acked", 0) >= 20 or feeding.done(), 90, "some batches consumed")
        assert not feeding.done(), "precondition: the kill lands while the feed runs"
        broker.proc.kill()                              # no journal: its state is gone
        broker.proc.wait(5)
        broker.restart()
        killed.touch()
        report = feeding.result(150)
    [ids] = consumer.result(150)
    np.testing.assert_array_equal(np.sort(ids), np.arange(6_000))
    assert (report["partitions"], report["rows"], report["diverged"]) == (3, 6_000, [])
    epoch = broker.stats()["streams"]["lineage"]["epochs"]["0"]
    assert epoch["adopted"] >= 20 - 4 and epoch["committed"] == 3, epoch


def test_a_failure_upstream_of_the_feed_in_the_same_task_loses_no_row(connect, start_broker_process):
    # A stage before the feed (a Python UDF here) fails part-way through partition 1 on its first attempt, after
    # the broker holds partition 0 and 500 rows of partition 1. Spark ends the feeding task's input as if it were
    # complete, and that attempt ends what it had: the broker holds it as complete, not committed. Spark's retry
    # streams the whole partition, its later batches are taken, and the driver commits the retry, the attempt
    # Spark declared successful (here from the job's streamed results: Spark Connect has no accumulators).
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "cut", timeout=60)
    reply = connect.request({"cmd": "feed", "address": broker.feed,
                             "source": {"kind": "failing", "rows": 6_000, "partitions": 2, "fail": 1,
                                        "fail_after": 1_500, "control": broker.control, "stream": "cut",
                                        "wait_rows": 3_500},
                             "kwargs": {"stream": "cut", "batch_size": 100, "arrow_batch_rows": 100,
                                        "pack_bytes": 0, "timeout": 60}})
    assert "error" not in reply, reply
    assert (reply["report"]["rows"], reply["report"]["diverged"]) == (6_000, [])
    [ids] = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(6_000))
    epoch = broker.stats()["streams"]["cut"]["epochs"]["0"]
    # the cut attempt ended (complete with its prefix) and was not committed: it proves the input was cut short
    assert (epoch["superseded"], epoch["committed"], epoch["rows_in"]) == (1, 2, 6_000), epoch


def test_on_a_classic_session_too_a_failure_upstream_of_the_feed_loses_no_row(spark, start_broker_process):
    broker = start_broker_process()
    consumer = Collector(broker.ranks, "cut", timeout=60)
    data = failing_frame(spark, 6_000, 2, fail=1, fail_after=1_500, control=broker.control, stream="cut",
                         wait_rows=3_500)
    report = feed(data, broker.feed, stream="cut", batch_size=100, arrow_batch_rows=100, pack_bytes=0, timeout=60)
    assert (report.rows, report.diverged) == (6_000, ())
    [ids] = consumer.result()
    np.testing.assert_array_equal(np.sort(ids), np.arange(6_000))
    epoch = broker.stats()["streams"]["cut"]["epochs"]["0"]
    assert (epoch["superseded"], epoch["committed"], epoch["rows_in"]) == (1, 2, 6_000), epoch


def test_an_executor_side_error_is_explained_as_on_a_classic_session(connect, spark, start_broker_process):
    # the executors cannot reach the broker's feed port, the driver reaches its control port: each task's
    # commit goes unanswered, Spark retries it three times, and feed() says why in the executors' words
    broker = start_broker_process()
    unreachable = f"tcp://127.0.0.1:{free_port_triple()}"
    settings = dict(control=broker.control, timeout=1, columns=["id", "x"])
    reply = connect.request({"cmd": "feed", "address": unreachable, "kwargs": {"stream": "lost", **settings},
                             "source": {"kind": "failing", "rows": 10, "partitions": 1, "fail": -1,
                                        "fail_after": 0, "control": broker.control, "stream": "lost",
                                        "wait_rows": 0}})
    error = reply["error"]
    assert (error["type"], error["cause_module"]) == ("FeedError", "pyspark.errors.exceptions.connect"), error
    assert error["message"].startswith(
        f"the Spark job feeding stream 'lost' epoch 0 failed: sparkbus.wire.errors.BrokerError: no reply from the "
        f"sparkbus broker at {broker.control} to PARTITION_END within 1 s"), error["message"]
    with pytest.raises(FeedError) as classic:
        feed(labelled_frame(spark, 10, 1), unreachable, stream="lost", epoch=1, **settings)
    assert error["message"].replace("epoch 0", "epoch 1") == str(classic.value)


def test_something_else_than_a_dataframe_or_an_rdd_is_refused_saying_rdds_need_a_classic_session():
    with pytest.raises(TypeError, match=r"an RDD \(of a classic session only: Spark Connect has no RDDs; make a "
                                        r"DataFrame of the rows, e.g. spark.createDataFrame\), not list"):
        feed([{"id": 1}], "tcp://127.0.0.1:1")
