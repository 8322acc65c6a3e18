"""Spark as a real cluster: a standalone Master and two Workers on two loopback hosts, one core each.

The cluster starts once for the module (``launch.cluster``); its driver is a child process
(``cluster_driver.py``: the suite's own SparkContext is in local mode, and a process holds one) that feeds on
request. Each test has its own broker and ``mpiexec -n 2`` ranks and asserts the exact multiset of row ids the
ranks received. Which executor ran which task attempt, and whether Spark launched it as a speculative copy,
comes from Spark's event log; what the attempts saw comes from the markers they write.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq

from launch.cluster import QUICK_START_JAVA_OPTS, StandaloneCluster
from launch.processes import ChildProcess, LaunchError, wait_for

HERE = Path(__file__).parent
HOSTS = ("127.0.0.1", "127.0.0.2")      # two hosts to Spark's scheduler: a speculative copy needs another one
# The feeder's default batch, 1,024 rows of 64 float32 (256 KiB): each batch travels as a message of its own, so
# a task that fails or stalls after five batches has sent five messages.
BATCH = 1024
ROWS_PER_PARTITION = 10 * BATCH
AFTER = 5 * BATCH

pytestmark = pytest.mark.timeout(240)

# Speculation as eager as Spark allows, on for the whole application (a SparkContext's settings are fixed, and a
# second driver would cost half a minute): a copy of a task that happens to be slow elsewhere is harmless, since
# every test asserts each row once, and only the speculation test waits for one. excludeOnFailure keeps a failed
# task's retry off the executor where it failed. The driver waits for both executors before its first job.
DRIVER_CONF = {
    "spark.speculation": "true",
    "spark.speculation.multiplier": "1.5",
    "spark.speculation.quantile": "0.5",
    "spark.speculation.interval": "100ms",
    "spark.speculation.minTaskRuntime": "1s",
    "spark.excludeOnFailure.enabled": "true",
    "spark.task.maxFailures": "4",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
    "spark.executor.extraJavaOptions": " ".join(QUICK_START_JAVA_OPTS),
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The Master is up and the Workers are starting: the driver fixture waits for them, while its JVM starts."""
    running = StandaloneCluster(tmp_path_factory.mktemp("cluster"), hosts=HOSTS, cores=1, memory="1g",
                                java_opts=QUICK_START_JAVA_OPTS)
    try:
        running.start(timeout=60, wait=False)
        yield running
    finally:
        running.stop()


class ClusterDriver:
    """The driver process: ``feed(...)`` asks it to run one feed and returns its answer."""

    def __init__(self, child: ChildProcess, control: str, executors: list[str]):
        self.child, self.control, self.executors = child, control, executors

    def request(self, message: dict, timeout: float) -> dict:
        with zmq.Context.instance().socket(zmq.REQ) as sock:     # a fresh REQ: a timed-out one is unusable
            sock.linger = 0
            sock.connect(self.control)
            sock.send(json.dumps(message).encode())
            if not sock.poll(timeout * 1000):
                raise AssertionError(f"the cluster driver did not answer {message.get('cmd')} within {timeout:g} "
                                     f"s; the end of {self.child.log}:\n{self.child.tail(40)}")
            return json.loads(sock.recv())

    def feed(self, broker, stream: str, partitions: int = 4, *, source: str = "dataframe",
             markers: Path | None = None, fail: dict | None = None, slow: dict | None = None,
             timeout: float = 150) -> dict:
        reply = self.request({"cmd": "feed", "feed": broker.feed, "stream": stream, "source": source,
                              "rows": partitions * ROWS_PER_PARTITION, "partitions": partitions,
                              "batch_size": BATCH, "markers": markers and str(markers), "fail": fail,
                              "slow": slow}, timeout)
        assert "error" not in reply, f"{reply['error']}\nthe end of {self.child.log}:\n{self.child.tail(40)}"
        return reply


@pytest.fixture(scope="module")
def driver(cluster, tmp_path_factory):
    home = tmp_path_factory.mktemp("driver")
    events, ready = home / "events", home / "ready.json"
    events.mkdir()
    conf = {**cluster.app_conf(executor_memory="512m"), **DRIVER_CONF}
    child = ChildProcess("cluster-driver", [sys.executable, str(HERE / "cluster_driver.py"), "--ready", str(ready),
                                            "--events", str(events), *(f"--conf={k}={v}" for k, v in conf.items())],
                         home / "driver.log", env={"SPARK_LOCAL_IP": "127.0.0.1"}, cwd=home)
    try:
        cluster.wait_ready(60)
        wait_for(lambda: ready.exists() or child.returncode is not None, 150, "the cluster driver to be ready")
        if child.returncode is not None:
            raise LaunchError(f"the cluster driver exited with {child.returncode}:\n{child.tail(40)}")
        info = json.loads(ready.read_text())
        running = ClusterDriver(child, info["control"], info["executors"])
        yield running
        running.request({"cmd": "stop"}, 60)      # spark.stop(): the executors end, the event log is closed
        child.wait(30)
    finally:
        child.stop()


def received(ranks, n: int = 2) -> np.ndarray:
    """Every id the ranks took or dropped (even steps), sorted, after checking that the steps were equal."""
    summaries = ranks.wait(120)
    assert len({s["epochs"][0]["batches"] for s in summaries}) == 1, f"unequal steps: {summaries}"
    epochs = [ranks.epoch(r, 0) for r in range(n)]
    for epoch in epochs:
        np.testing.assert_array_equal(epoch["x"], np.repeat(epoch["id"][:, None], 64, axis=1).astype(np.float32))
    return np.sort(np.concatenate([e[key] for e in epochs for key in ("id", "dropped_id")]))


def markers(directory: Path) -> dict[tuple[int, int, str], dict]:
    """The task attempts' markers by (partition, attempt, event)."""
    found = {}
    for path in directory.glob("*.json"):
        mark = json.loads(path.read_text())
        found[mark["partition"], mark["attempt"], mark["event"]] = mark
    return found


def test_every_row_once_across_two_ranks_fed_by_two_executors(driver, start_broker_process, start_ranks):
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "cluster")
    reply = driver.feed(broker, "cluster")                       # a DataFrame: spark.range, through mapInArrow
    np.testing.assert_array_equal(received(ranks), np.arange(4 * ROWS_PER_PARTITION))
    assert reply["report"]["rows"] == 4 * ROWS_PER_PARTITION
    # the partitions were streamed by both executors, from both hosts
    done = [t for t in reply["tasks"] if t["reason"] == "Success"]
    assert {t["host"] for t in done} == set(HOSTS), reply["tasks"]
    assert {t["executor"] for t in done} == set(driver.executors), reply["tasks"]


def test_a_task_failing_midway_is_retried_on_the_other_executor(driver, start_broker_process, start_ranks, tmp_path):
    """One partition, so that nothing else runs and Spark cannot speculate (it needs finished tasks to compare)."""
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "retry")
    reply = driver.feed(broker, "retry", 1, source="rdd", markers=tmp_path / "markers",
                        fail={"partition": 0, "after": AFTER})
    np.testing.assert_array_equal(received(ranks), np.arange(ROWS_PER_PARTITION))

    failed, retry = reply["tasks"]
    assert (failed["attempt"], failed["reason"]) == (0, "ExceptionFailure"), reply["tasks"]
    assert (retry["attempt"], retry["reason"]) == (1, "Success"), reply["tasks"]
    assert retry["host"] != failed["host"] and retry["executor"] != failed["executor"]
    seen = markers(tmp_path / "markers")
    assert seen[0, 0, "fail"]["host"] == failed["host"] and seen[0, 1, "done"]["host"] == retry["host"]
    # it failed once the broker held its first five batches; the retry sent those again
    assert seen[0, 0, "fail"]["broker_rows"] == AFTER
    epoch = broker.stats()["streams"]["retry"]["epochs"]["0"]
    assert (epoch["batches_in"], epoch["duplicates"], epoch["diverged"]) == (10, 5, [])


def test_spark_speculates_a_slow_partition_and_each_row_arrives_once(driver, start_broker_process, start_ranks,
                                                                     tmp_path):
    broker = start_broker_process()
    ranks = start_ranks(2, broker.ranks, "--stream", "spec")
    reply = driver.feed(broker, "spec", 4, source="rdd", markers=tmp_path / "markers",
                        slow={"partition": 0, "after": AFTER})
    np.testing.assert_array_equal(received(ranks), np.arange(4 * ROWS_PER_PARTITION))

    # Spark itself launched a copy of partition 0 as a speculative task, on the other host
    attempts = [t for t in reply["tasks"] if t["partition"] == 0]
    first = next(t for t in attempts if t["attempt"] == 0)
    copies = [t for t in attempts if t["speculative"]]
    assert len(copies) == 1 and not first["speculative"], attempts
    copy = copies[0]
    assert copy["host"] != first["host"] and copy["executor"] != first["executor"], attempts
    # ... while the first attempt was running: it had streamed five batches (the broker held them), stalled, and
    # saw the copy start; it went on after the copy had streamed the whole partition and the broker had committed
    # it, so both streamed the partition. Which of the two Spark then records as the winner is a race (the loser
    # is killed and has no end in the event log), so the test asks for one success, not the copy's.
    seen = markers(tmp_path / "markers")
    assert seen[0, copy["attempt"], "done"]["rows"] == ROWS_PER_PARTITION
    assert seen[0, 0, "resume"]["copy_done"] and seen[0, 0, "resume"]["all_committed"]
    assert "Success" in (first["reason"], copy["reason"]), attempts
    assert seen[0, 0, "stall"]["rows"] == AFTER
    assert seen[0, 0, "stall"]["broker_rows"] == 3 * ROWS_PER_PARTITION + AFTER
    assert seen[0, 0, "saw-copy"]["copy_attempt"] == copy["attempt"]
    assert seen[0, copy["attempt"], "start"]["host"] == copy["host"]
    assert seen[0, copy["attempt"], "start"]["time"] < seen[0, 0, "saw-copy"]["time"]
    # the broker kept one copy of each batch and refused the other attempt's copies of the first five at least
    epoch = broker.stats()["streams"]["spec"]["epochs"]["0"]
    assert epoch["batches_in"] == 4 * ROWS_PER_PARTITION // BATCH
    assert epoch["duplicates"] >= 5 and epoch["diverged"] == []
    assert reply["report"]["diverged"] == []
