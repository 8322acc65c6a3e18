"""Spark as a real cluster: a standalone Master and two Workers on two loopback hosts, one core each.

The cluster starts once for the module (``launch.cluster``); its driver is a child process
(``cluster_driver.py``: the suite's own SparkContext is in local mode, and a process holds one) that feeds on
request. Each test has its own broker and ``mpiexec -n 2`` ranks and asserts the exact multiset of row ids the
ranks received. Which executor ran which task attempt, and whether Spark launched it as a speculative copy,
comes from Spark's event log; what the attempts saw comes from the markers they write.

The fault tests at the end (issue 23) cut a partition's first attempt mid-partition, with a Python UDF upstream of
the feed: an executor JVM SIGKILLed, a Worker host lost, the UDF failing once, a shuffle's map output lost with
its executor. Each asserts every id once, and that the truncated attempt had streamed batches to the broker and
ended them without being committed (the broker's ``superseded``): Spark's word commits a partition (protocol 7).
They share the cluster: a killed executor is replaced by its Worker, a killed Worker is restarted after its test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq

from sparkbus.launch.cluster import QUICK_START_JAVA_OPTS, StandaloneCluster
from sparkbus.launch.cluster import held_workers as live_held_workers
from sparkbus.launch.processes import ChildProcess, LaunchError, wait_for

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
# task's retry off the executor where it failed; only within its stage, though: an executor that failed two tasks
# of successful stages would be excluded from the application for an hour, and the next feed's warm-up, a barrier
# stage that needs both executors, would wait for ever. The driver waits for both executors before its first job.
DRIVER_CONF = {
    "spark.speculation": "true",
    "spark.speculation.multiplier": "1.5",
    "spark.speculation.quantile": "0.5",
    "spark.speculation.interval": "100ms",
    "spark.speculation.minTaskRuntime": "1s",
    "spark.excludeOnFailure.enabled": "true",
    "spark.excludeOnFailure.application.maxFailedTasksPerExecutor": "1000",
    "spark.excludeOnFailure.application.maxFailedExecutorsPerNode": "1000",
    "spark.task.maxFailures": "4",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
    "spark.executor.extraJavaOptions": " ".join(QUICK_START_JAVA_OPTS),
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
}


@pytest.fixture(scope="module")
def held_workers(tmp_path_factory):
    """Where held Python workers record themselves (launch/held_workers/sitecustomize.py): those still running
    once the cluster has stopped are killed."""
    base = tmp_path_factory.mktemp("held")
    yield base
    release_held(base)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, held_workers):
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
             timeout: float = 150, rows: int | None = None, batch_size: int = BATCH, **options) -> dict:
        """``options``: more fields of the request (cluster_driver.py), e.g. ``delivery``, ``cut``, ``hold``."""
        reply = self.request({"cmd": "feed", "feed": broker.feed, "stream": stream, "source": source,
                              "rows": rows or partitions * ROWS_PER_PARTITION, "partitions": partitions,
                              "batch_size": batch_size, "markers": markers and str(markers), "fail": fail,
                              "slow": slow, **options}, timeout)
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


def received(ranks, n: int = 2, width: int = 64) -> np.ndarray:
    """Every id the ranks took or dropped (even steps), sorted, after checking that the steps were equal."""
    summaries = ranks.wait(120)
    assert len({s["epochs"][0]["batches"] for s in summaries}) == 1, f"unequal steps: {summaries}"
    epochs = [ranks.epoch(r, 0) for r in range(n)]
    for epoch in epochs:
        np.testing.assert_array_equal(epoch["x"], np.repeat(epoch["id"][:, None], width, axis=1).astype(np.float32))
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
    # the partitions were streamed by both executors, from both hosts (the executors of now: a test that kills
    # one has it replaced). Attempts, not successes: this cluster speculates, and on a loaded machine a slow task's
    # copy on the other executor may win, leaving one host without a successful task though it streamed
    assert {t["host"] for t in reply["tasks"]} == set(HOSTS), reply["tasks"]
    assert {t["executor"] for t in reply["tasks"]} == set(reply["executors"]), reply["tasks"]
    assert {t["partition"] for t in reply["tasks"] if t["reason"] == "Success"} == {0, 1, 2, 3}, reply["tasks"]


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


# ---- faults on the cluster: an executor or a host lost mid-partition, a UDF upstream failing, a shuffle lost ----
#
# The feed's input comes from a Python UDF of its own upstream (cluster_driver.py's "gate", in another Python
# worker, as in a user's pipeline): rows of 1 KiB in Arrow batches of SMALL rows, each batch one message to the
# broker. The gate cuts partition 0's first attempt after CUT_AFTER batches, once the broker holds them, while the
# other partition's first attempt waits for the cut: what the broker holds before the cut is partition 0's alone.
#
# An executor JVM SIGKILLed closes its Python worker's input socket. The gate was stalled, so the feeding worker
# was waiting on an empty socket: it reads EOF at an Arrow message boundary, which pyarrow takes for the end of
# the partition. Whether the worker then streams its prefix and ends it (PARTITION_END) before the pyspark daemon's
# SIGHUP kills it is a race that an idle machine mostly loses; launch/held_workers/sitecustomize.py ("hold") makes the
# worker ignore that SIGHUP, so the truncated attempt certainly ends, as it did on the loaded cluster of issue 23.
# The broker counts it in "superseded": complete, never committed, because Spark declared another attempt
# successful. Every id must still arrive exactly once.

WIDE = 256                          # float32s a row: rows of 1 KiB
SMALL = 64                          # rows a batch and an Arrow batch (64 KiB): the kill lands between batches
WIDE_PARTITION = 40 * SMALL         # 2,560 rows a partition
CUT_AFTER = 8                       # batches the cut attempt streams (the broker holds them) before the cut
WIDE_BATCH_BYTES = SMALL * (8 + 4 * WIDE)      # a batch's payload
FAULT_TIMEOUT = 150


def release_held(directory: Path, orphans_only: bool = False) -> list[int]:
    """SIGKILL the held Python workers recorded under ``directory`` that still run (``orphans_only``: those whose
    pyspark daemon is gone, i.e. whose executor was killed); returns their pids."""
    killed = []
    for worker in live_held_workers(directory):
        if orphans_only and worker["ppid"] == worker["parent"]:
            continue                    # still its daemon's: a live executor's worker
        try:
            os.kill(worker["pid"], signal.SIGKILL)
            killed.append(worker["pid"])
        except ProcessLookupError:
            pass
    return killed


@pytest.fixture
def held(held_workers, request):
    """A directory for one feed's held Python workers; those orphaned (their executor killed) and still running at
    the end of the test are killed."""
    directory = held_workers / request.node.name.replace("[", "-").replace("]", "")
    directory.mkdir()
    yield directory
    release_held(directory, orphans_only=True)


def gate_marker(markers: Path, event: str, partition: int = 0) -> dict:
    """The gate's marker ``event`` of partition ``partition`` (of the one attempt that writes it), or {}."""
    found = sorted(markers.glob(f"p{partition}-t*-{event}.json"))
    assert len(found) <= 1, found
    return json.loads(found[0].read_text()) if found else {}


def gated_feed(driver, broker, stream: str, markers: Path, **options) -> dict:
    """Feed two partitions of WIDE_PARTITION rows of 1 KiB through the gate (``options``: the request's source,
    delivery, cut, ...)."""
    return driver.feed(broker, stream, 2, markers=markers, rows=2 * WIDE_PARTITION, batch_size=SMALL,
                       arrow_batch_rows=SMALL, width=WIDE, timeout=FAULT_TIMEOUT, delay=0.01, **options)


@contextmanager
def feeding(driver, broker, stream: str, markers: Path, **options):
    """:func:`gated_feed` running in a thread while the test acts: yields a future of the driver's reply. Whatever
    happens, the gates are let go on (``markers/cut``) and the feed is waited for (boundedly) on the way out."""
    markers.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(gated_feed, driver, broker, stream, markers, **options)
        try:
            yield future
        finally:
            (markers / "cut").touch()
            future.exception(FAULT_TIMEOUT + 10)


def wait_for_stall(future, markers: Path) -> dict:
    """The cut attempt's ``stall`` marker, once it has streamed CUT_AFTER batches and stalled."""
    found = wait_for(lambda: future.done() or gate_marker(markers, "stall"), 120, "partition 0 to stall")
    if future.done():
        future.result()                 # the feed failed (raises) or ended without the stall
        raise AssertionError("the feed ended before partition 0 stalled")
    return found


def tally(ids: np.ndarray, rows: int) -> dict:
    """Rows lost and rows received twice (or more), of ids ``0..rows-1``."""
    counts = np.bincount(ids[(ids >= 0) & (ids < rows)], minlength=rows)
    return {"lost": int((counts == 0).sum()), "twice": int((counts > 1).sum() + ((ids < 0) | (ids >= rows)).sum())}


def check_cut_attempt(reply: dict, epoch: dict, stall: dict, delivery: str, ids: np.ndarray, what: str,
                      diverged: tuple[int, ...] = ()) -> None:
    """The common assertions: every id once, the cut attempt had streamed CUT_AFTER batches to the broker before
    the cut and ended them (superseded), and Spark's successful attempt of partition 0 is another one. ``diverged``:
    the partitions whose attempts may have cut different batches (atomic delivery: exact all the same)."""
    rows = 2 * WIDE_PARTITION
    print(f"\n{what} ({delivery}): {tally(ids, rows)}, superseded {epoch.get('superseded')}, duplicates "
          f"{epoch['duplicates']}, diverged {epoch['diverged']}, cut after {stall.get('batches')} batches yielded, "
          f"broker then {stall.get('broker')}, fed in {reply['report']['seconds']:.1f} s")
    np.testing.assert_array_equal(ids, np.arange(rows))
    assert reply["report"]["rows"] == rows and set(reply["report"]["diverged"]) <= set(diverged), reply["report"]
    assert set(epoch["diverged"]) <= set(diverged), epoch
    assert epoch["commit"] == "driver" and epoch["delivery"] == delivery
    # before the cut the broker held the cut attempt's first batches (only partition 0 was streaming): in stream
    # delivery taken; in atomic delivery held until a commit
    assert "timed_out" not in stall["broker"], stall
    if delivery == "stream":
        assert stall["broker"]["batches_in"] >= CUT_AFTER, stall
        assert epoch["duplicates"] >= stall["broker"]["batches_in"]        # the retry sent them again
    else:
        assert stall["broker"]["buffered_bytes"] >= CUT_AFTER * WIDE_BATCH_BYTES, stall
    # the truncated attempt reached its end of input and said so (PARTITION_END), and was not committed
    assert epoch["superseded"] >= 1, epoch
    assert epoch["batches_in"] == reply["report"]["batches"] and epoch["committed"] == 2


@pytest.mark.timeout(200)
@pytest.mark.parametrize("delivery", ["stream", "atomic"])
def test_an_executor_killed_mid_partition_its_truncated_attempt_never_commits(
        driver, cluster, start_broker_process, start_ranks, tmp_path, held, delivery):
    """The executor JVM running partition 0's first attempt SIGKILLed once the broker holds its first batches: the
    attempt's held feeding worker ends the prefix it had (superseded), Spark runs the task again elsewhere, and
    only that attempt is committed. Its Worker starts a new executor, which the next test waits for."""
    broker = start_broker_process()
    stream = f"lost-executor-{delivery}"
    ranks = start_ranks(2, broker.ranks, "--stream", stream, "--timeout", "150")
    markers = tmp_path / "markers"
    with feeding(driver, broker, stream, markers, source="generated", delivery=delivery, hold=str(held),
                 cut={"partition": 0, "after": CUT_AFTER, "how": "stall"}) as future:
        stall = wait_for_stall(future, markers)
        worker = cluster.worker_index(stall["host"])
        assert stall["jvm"] in cluster.executor_pids(worker), (stall, cluster.executor_pids(worker))
        killed = cluster.kill_executors(worker)
        killed_at = time.time()
    reply = future.result()
    ids = received(ranks, width=WIDE)
    epoch = broker.stats()["streams"][stream]["epochs"]["0"]
    check_cut_attempt(reply, epoch, stall, delivery, ids, f"executor {killed} killed")

    # Spark lost attempt 0 of partition 0 with its executor and ran it again, on another executor
    attempts = [t for t in reply["tasks"] if t["partition"] == 0 and t.get("type", "ResultTask") == "ResultTask"]
    first = next(t for t in attempts if t["task"] == stall["task"])
    assert first["reason"] == "ExecutorLostFailure" and first["host"] == stall["host"], attempts
    winner = [t for t in attempts if t["reason"] == "Success"]
    assert len(winner) == 1 and winner[0]["executor"] != first["executor"], attempts
    assert winner[0]["launch"] >= killed_at - 1, attempts


@pytest.mark.timeout(240)
def test_a_worker_host_lost_mid_partition_the_feed_finishes_on_the_other(
        driver, cluster, start_broker_process, start_ranks, tmp_path, held):
    """The Worker JVM and its executor SIGKILLed at once, as if the host had gone: the Master drops the Worker, and it
    is not restarted until the feed is over, so the rest of the feed runs on the other Worker."""
    broker = start_broker_process()
    stream, delivery = "lost-host", "stream"
    ranks = start_ranks(2, broker.ranks, "--stream", stream, "--timeout", "150")
    markers = tmp_path / "markers"
    worker = None
    try:
        with feeding(driver, broker, stream, markers, source="generated", delivery=delivery, hold=str(held),
                     cut={"partition": 0, "after": CUT_AFTER, "how": "stall"}) as future:
            stall = wait_for_stall(future, markers)
            worker = cluster.worker_index(stall["host"])
            assert stall["jvm"] in cluster.executor_pids(worker), (stall, cluster.executor_pids(worker))
            killed = cluster.kill_worker(worker)
            killed_at = time.time()
        reply = future.result()
        ids = received(ranks, width=WIDE)
        # the Master lost the Worker (its connection closed), and no Worker runs on that host any more
        wait_for(lambda: stall["host"] not in [w["host"] for w in cluster.status()["workers"] if w["state"] == "ALIVE"],
                 60, f"the Master to drop the Worker on {stall['host']}")
        epoch = broker.stats()["streams"][stream]["epochs"]["0"]
        check_cut_attempt(reply, epoch, stall, delivery, ids, f"worker and executor {killed} killed")
        attempts = [t for t in reply["tasks"] if t["partition"] == 0]
        first = next(t for t in attempts if t["task"] == stall["task"])
        assert first["reason"] == "ExecutorLostFailure" and first["host"] == stall["host"], attempts
        # every task launched after the kill ran on the other host
        later = [t for t in reply["tasks"] if t["launch"] > killed_at]
        assert later and {t["host"] for t in later} == set(HOSTS) - {stall["host"]}, reply["tasks"]
        assert [t["reason"] for t in later] == ["Success"] * len(later), later
    finally:
        if worker is not None:           # the tests after this one need both Workers again
            cluster.restart_worker(worker, 120)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("delivery", ["stream", "atomic"])
def test_a_udf_upstream_of_the_feed_failing_once_mid_partition(driver, start_broker_process, start_ranks, tmp_path,
                                                                 delivery):
    """A Python UDF upstream of the feed (in its own Python worker) raises on partition 0's first attempt, once the
    broker holds the first CUT_AFTER batches that attempt fed. Spark retries the task on the other executor.

    No worker is held here, and none needs to be: Spark ends the feeding worker's input when the iterator upstream
    raises, and reads that worker's output to its end before it fails the task, so the cut attempt streams its
    prefix and ends it every time (superseded >= 1 in every run so far)."""
    broker = start_broker_process()
    stream = f"udf-fails-{delivery}"
    ranks = start_ranks(2, broker.ranks, "--stream", stream, "--timeout", "150")
    markers = tmp_path / "markers"
    reply = gated_feed(driver, broker, stream, markers, source="generated", delivery=delivery,
                       cut={"partition": 0, "after": CUT_AFTER, "how": "fail"})
    ids = received(ranks, width=WIDE)
    epoch = broker.stats()["streams"][stream]["epochs"]["0"]
    failed = gate_marker(markers, "fail")
    check_cut_attempt(reply, epoch, failed, delivery, ids, "UDF upstream failed")
    attempts = [t for t in reply["tasks"] if t["partition"] == 0]
    first = next(t for t in attempts if t["task"] == failed["task"])
    assert first["reason"] == "ExceptionFailure", attempts
    winner = [t for t in attempts if t["reason"] == "Success"]
    assert len(winner) == 1 and winner[0]["executor"] != first["executor"], attempts


@pytest.mark.timeout(240)
@pytest.mark.parametrize("delivery, ordered", [("atomic", False), ("stream", True), ("stream", False)],
                         ids=["atomic", "stream-sorted", "stream-unsorted"])
def test_a_shuffle_upstream_lost_with_its_executor_is_recomputed(driver, cluster, start_broker_process, start_ranks,
                                                                 tmp_path, held, delivery, ordered):
    """``repartition(2, "id")`` upstream of the feed: its map outputs live on both executors. The executor running
    partition 0's first attempt is SIGKILLed mid-partition: its map output goes with it, so the retry's shuffle read
    fails (FetchFailed) and Spark resubmits the map stage, then the reduce tasks.

    The reduce side reads its blocks in the order they arrive, so a recomputed partition may hold its rows in another
    order: then its attempts cut different batches. Atomic delivery forwards only the committed attempt's batches:
    exact whatever the order. Stream delivery forwarded the truncated attempt's first batches already: exact when
    the order is fixed (``sortWithinPartitions("id")``: deterministic upstream); unsorted, the rows are exact only if
    the retry happened to read in the same order, and otherwise the broker saw the checksums differ and the feed
    names the partition in ``FeedReport.diverged`` (its rows may be lost or twice: what delivery="atomic" is for)."""
    broker = start_broker_process()
    stream = f"lost-shuffle-{delivery}-{'sorted' if ordered else 'unsorted'}"
    ranks = start_ranks(2, broker.ranks, "--stream", stream, "--timeout", "150")
    markers = tmp_path / "markers"
    with feeding(driver, broker, stream, markers, source="shuffle", sorted=ordered, delivery=delivery,
                 hold=str(held), cut={"partition": 0, "after": CUT_AFTER, "how": "stall"}) as future:
        stall = wait_for_stall(future, markers)
        worker = cluster.worker_index(stall["host"])
        assert stall["jvm"] in cluster.executor_pids(worker), (stall, cluster.executor_pids(worker))
        killed = cluster.kill_executors(worker)
    reply = future.result()
    ids = received(ranks, width=WIDE)
    epoch = broker.stats()["streams"][stream]["epochs"]["0"]
    rows = 2 * WIDE_PARTITION

    # Spark: the map stage ran on both hosts (the killed executor held map output), a shuffle read failed, and the
    # map stage was run again (a second attempt of its stage)
    maps = [t for t in reply["tasks"] if t.get("type") == "ShuffleMapTask"]
    assert {t["host"] for t in maps if t["stage_attempt"] == 0} == set(HOSTS), reply["tasks"]
    assert "FetchFailed" in {t["reason"] for t in reply["tasks"]}, reply["tasks"]
    assert any(t["stage_attempt"] >= 1 and t["reason"] == "Success" for t in maps), reply["tasks"]
    assert any(s["attempt"] >= 1 for s in reply["stages"]), reply["stages"]

    # Partition 0 was cut; partition 1's first attempt, released by the cut, may also have read its local blocks,
    # streamed them, then failed to fetch the killed executor's (under load it had not fetched them before the
    # kill): then it is recomputed too. Unsorted, a partition that Spark ran more than once (an attempt of the result
    # stage's first run that did not succeed: failed, lost or a killed speculative copy) may diverge; no other can.
    failed = {t["partition"] for t in reply["tasks"] if t["stage"] not in {m["stage"] for m in maps}
              and t["stage_attempt"] == 0 and t["reason"] != "Success"}
    assert 0 in failed, reply["tasks"]
    if delivery == "stream" and not ordered and list(reply["report"]["diverged"]):
        counted = tally(ids, rows)
        print(f"\nshuffle lost with executor {killed} ({delivery}, unsorted): {counted}, diverged "
              f"{reply['report']['diverged']}, superseded {epoch.get('superseded')}, duplicates {epoch['duplicates']}")
        # named, and the damage bounded by the batches the truncated attempts had streamed (the first copy of each
        # seq is the one forwarded): as many rows arrive as Spark produced, some of a diverged partition's twice, as
        # many of its others not at all
        diverged = sorted(reply["report"]["diverged"])
        assert set(diverged) <= failed and sorted(epoch["diverged"]) == diverged, (failed, reply["report"], epoch)
        assert len(ids) == rows and counted["lost"] <= epoch["duplicates"] * SMALL, (counted, epoch)
        assert epoch["superseded"] >= 1, epoch
        return
    check_cut_attempt(reply, epoch, stall, delivery, ids,
                      f"shuffle lost with executor {killed} ({'sorted' if ordered else 'unsorted'})",
                      diverged=() if ordered else tuple(failed))
