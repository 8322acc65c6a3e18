"""A Spark driver against a standalone cluster that feeds on request: the test module's second SparkContext.

A Python process holds one SparkContext, and the suite's own (``spark`` in conftest.py) is in local mode, so
tests/integration/test_cluster.py runs this script as a child process, once for the module:

    python cluster_driver.py --ready FILE --events DIR --conf spark.master=spark://127.0.0.1:P --conf k=v ...

It starts a SparkSession with those settings and Spark's event log in ``DIR``, waits until both executors have
run a task (warm Python workers), writes ``FILE`` (``{"control": "tcp://127.0.0.1:N", "executors": [...]}``)
and answers JSON requests on a ZeroMQ REP socket at ``control``:

* ``{"cmd": "feed", "feed": ADDRESS, "stream": S, "rows": N, "partitions": P, "batch_size": B, "source":
  "dataframe" | "rdd", "markers": DIR, "fail": {"partition": p, "after": rows} | null, "slow": {...} | null}``
  feeds ids ``0..N-1`` (columns ``id`` and ``x``, the id as ``W`` float32s, ``"width": W``, default 64) with
  ``feeder.feed`` as epoch 0 of stream S,
  and answers ``{"report": FeedReport, "tasks": [...]}``, the feed job's tasks as Spark's event log has them
  (partition, attempt, executor, host, speculative, launch and finish times, end reason), or ``{"error": ...}``.
  Optional: ``"delivery"`` (feed()'s, default ``"stream"``), ``"arrow_batch_rows"`` (feed()'s), ``"hold": DIR``
  (the feed's Python workers outlive their daemon: launch/held_workers/sitecustomize.py, recorded in ``DIR``), and for
  the ``generated`` and ``shuffle`` sources ``"delay"`` (seconds per batch) and ``"cut"`` (below).
  The answer also has ``"executors"`` (those the warm-up found) and ``"stages"`` (each stage attempt of the feed's
  jobs: stage, attempt, name, tasks).
* ``{"cmd": "stop"}`` stops the session and the process.

``dataframe`` is ``spark.range`` (rows made in the JVM, the feeder's ``mapInArrow`` the only Python). ``rdd`` makes
the rows in Python, in the same Python worker as the feeder's task code (PySpark chains the two functions), so
that a task can misbehave part-way through its partition, on its first attempt, after ``after`` rows:

* ``fail``: raise. Spark retries the task (``spark.excludeOnFailure.enabled`` keeps it off the executor where it
  failed).
* ``slow``: stall until a second attempt of the partition (a speculative copy) has started, produced all its rows
  and committed the partition at the broker; then go on, so both attempts stream the partition to the broker.

Before it fails or stalls, the attempt waits until the broker holds its first ``after`` rows, so that the batches
a retry or a copy sends again are certainly duplicates there. (The broker counts an epoch's rows, not a
partition's, so the attempt waits for every other partition too.) A DataFrame source could not do this: the
misbehaving code would run in a Python worker of its own, whose output PySpark buffers (64 KiB), so "after N rows"
would not mean that N rows had reached the feeder.

Every attempt writes markers ``DIR/p{partition}-a{attempt}-{event}.json`` (``start``, ``fail``, ``stall``,
``saw-copy``, ``resume``, ``done``) with its executor id (its working directory, which the standalone Worker makes
per executor), its host (``SPARK_LOCAL_IP``, inherited from the Worker) and the time.

``generated`` and ``shuffle`` put a Python UDF upstream of the feed, in a Python worker of its own (a
``mapInArrow`` of its own, ``gate``), as a user's pipeline would: ``generated`` makes each partition's ids there
(rows of ``width`` float32s, 1 KiB at 256, in Arrow batches of ``arrow_batch_rows``); ``shuffle`` makes the rows in
the JVM (``spark.range``, two map partitions), shuffles them (``repartition(partitions, "id")``, then, with
``"sorted": true``, ``sortWithinPartitions("id")``, so that every attempt of a reducer sees its rows in one order)
and the gate passes them on. The gate sleeps ``delay`` seconds a batch, and ``cut`` ``{"partition": p, "after": K,
"how": "stall" | "fail"}`` cuts the first attempt of partition ``p`` (if not cut yet) after ``K``
batches, once the broker holds ``K`` batches (the feeding task sent them): ``fail`` raises (marker ``fail``);
``stall`` (marker ``stall``, with the executor JVM's pid) waits until the file ``DIR/cut`` exists, which the test
writes once it has killed that executor. The first attempts of the other partitions wait for ``DIR/cut`` before
their first batch, so that until the cut what the broker holds is partition ``p``'s alone. Gate markers are
``p{partition}-t{task attempt id}-{event}.json`` (a stage resubmitted numbers its attempts from 0 again).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import zmq

from sparkbus.feeder import feed
from sparkbus.launch.cluster import HELD_WORKERS_SITE, HOLD_WORKERS_ENV
from sparkbus.launch.processes import announce_ready
from sparkbus.wire.address import control_address

log = logging.getLogger("sparkbus.tests.cluster_driver")
WAIT_LIMIT = 60.0         # seconds a misbehaving attempt waits for the broker or for its copy before going on
LAG = 4                   # batches the gate yields past a cut's ``after`` before it waits for the broker to hold them


def mark(markers: str, info: dict, event: str, **more) -> None:
    """Record one event of a task attempt as a small JSON file, written whole."""
    name = f"t{info['task']}" if info.get("gate") else f"a{info['attempt']}"
    path = Path(markers) / f"p{info['partition']}-{name}-{event}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**info, "event": event, "time": time.time(), **more}))
    tmp.rename(path)


def poll(condition, timeout: float):
    """``condition()`` once it is truthy, or its last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def epoch_stats(broker: dict) -> dict:
    from sparkbus.broker.client import fetch_stats

    stream = fetch_stats(broker["control"], 5.0)["streams"].get(broker["stream"], {})
    return stream.get("epochs", {}).get("0", {})


def faulty_rdd(sc, rows: int, partitions: int, width: int, markers: str, broker: dict, fail: dict | None = None,
               slow: dict | None = None):
    """ids ``0..rows-1`` as rows ``{"id", "x"}`` in equal partitions, misbehaving as ``fail`` and ``slow`` say."""
    per_partition = rows // partitions

    def produce(part, ids):
        import numpy as np
        from pyspark import TaskContext

        task = TaskContext.get()
        attempt = task.attemptNumber()
        info = {"partition": part, "attempt": attempt, "stage": task.stageId(), "task": task.taskAttemptId(),
                "executor": os.path.basename(os.getcwd()), "host": os.environ.get("SPARK_LOCAL_IP", "?"),
                "pid": os.getpid()}
        mark(markers, info, "start")
        for seen, value in enumerate(ids):
            if attempt == 0 and fail and part == fail["partition"] and seen == fail["after"]:
                mark(markers, info, "fail", rows=seen, broker_rows=in_broker(seen))
                raise RuntimeError(f"injected failure in partition {part} after {seen} rows")
            if attempt == 0 and slow and part == slow["partition"] and seen == slow["after"]:
                stall(info, seen)
            yield {"id": value, "x": np.full(width, value, np.float32)}
        mark(markers, info, "done", rows=per_partition)

    def in_broker(seen: int) -> int:
        # the feeder has sent every full batch of the rows so far: wait until the broker holds them, and say what
        # it held then (a second look could already count a speculative copy's rows, started meanwhile)
        need = rows - per_partition + seen
        held = poll(lambda: (n := epoch_stats(broker).get("rows_in", 0)) >= need and n, WAIT_LIMIT)
        return held or epoch_stats(broker).get("rows_in", 0)

    def stall(info: dict, seen: int) -> None:
        mark(markers, info, "stall", rows=seen, broker_rows=in_broker(seen))
        pattern = f"p{info['partition']}-a[1-9]*-start.json"
        copy = poll(lambda: sorted(Path(markers).glob(pattern)), WAIT_LIMIT)
        if not copy:
            mark(markers, info, "no-copy")
            return
        attempt = json.loads(copy[0].read_text())["attempt"]
        mark(markers, info, "saw-copy", copy_attempt=attempt)
        done = poll(lambda: Path(markers, f"p{info['partition']}-a{attempt}-done.json").exists(), WAIT_LIMIT)
        committed = poll(lambda: epoch_stats(broker).get("committed", 0) == partitions, WAIT_LIMIT)
        mark(markers, info, "resume", copy_done=bool(done), all_committed=bool(committed))

    if rows % partitions:
        raise ValueError("rows must split into equal partitions")
    return sc.parallelize(range(rows), partitions).mapPartitionsWithIndex(produce)


def id_frame(spark, rows: int, partitions: int, width: int):
    """ids ``0..rows-1`` as ``id long, x array<float>`` (the id ``width`` times), made in the JVM."""
    from pyspark.sql import functions as F

    return spark.range(rows, numPartitions=partitions).select(
        "id", F.array_repeat(F.col("id").cast("float"), width).alias("x"))


def broker_figures(broker: dict) -> dict:
    """What the broker holds of the epoch: batches taken (first copies; in atomic delivery only at a commit) and
    the bytes it buffers (atomic: every attempt's batches, held until its commit)."""
    from sparkbus.broker.client import fetch_stats

    stats = fetch_stats(broker["control"], 5.0)
    epoch = stats["streams"].get(broker["stream"], {}).get("epochs", {}).get("0", {})
    return {"batches_in": epoch.get("batches_in", 0), "rows_in": epoch.get("rows_in", 0),
            "buffered_bytes": stats["broker"]["buffered_bytes"]}


def holds(broker: dict, delivery: str, batches: int, batch_bytes: int) -> dict | None:
    """The broker's figures once it holds ``batches`` batches of the one partition streaming, else None."""
    figures = broker_figures(broker)
    if delivery == "atomic":
        return figures if figures["buffered_bytes"] >= batches * batch_bytes else None
    return figures if figures["batches_in"] >= batches else None


def gated_frame(spark, request: dict, broker: dict):
    """The ``generated`` or ``shuffle`` source: rows through the ``gate`` UDF (see the module's docstring)."""
    import pyarrow as pa

    rows, partitions, width = request["rows"], request["partitions"], request.get("width", 64)
    batch, markers, delay = request["arrow_batch_rows"], request["markers"], request.get("delay", 0.0)
    delivery, cut = request.get("delivery", "stream"), request.get("cut") or {}
    per_partition = rows // partitions
    batch_bytes = batch * (8 + 4 * width)        # a batch's payload: the ids and the floats

    def generated(part: int):
        import numpy as np

        for start in range(part * per_partition, (part + 1) * per_partition, batch):
            ids = np.arange(start, min(start + batch, (part + 1) * per_partition), dtype=np.int64)
            values = pa.array(np.repeat(ids.astype(np.float32), width))
            offsets = pa.array(np.arange(0, (len(ids) + 1) * width, width, dtype=np.int32))
            yield pa.RecordBatch.from_arrays([pa.array(ids), pa.ListArray.from_arrays(offsets, values)],
                                             ["id", "x"])

    def gate(batches):
        from pyspark import TaskContext

        task = TaskContext.get()
        part = task.partitionId()
        daemon = os.getppid()
        info = {"gate": True, "partition": part, "attempt": task.attemptNumber(), "stage": task.stageId(),
                "task": task.taskAttemptId(), "executor": os.path.basename(os.getcwd()),
                "host": os.environ.get("SPARK_LOCAL_IP", "?"), "pid": os.getpid(), "daemon": daemon,
                "jvm": parent_of(daemon)}
        mark(markers, info, "start")
        # Before the cut only: a stage resubmitted after a fetch failure numbers its attempts from 0 again
        cut_file = Path(markers, "cut")
        first = task.attemptNumber() == 0 and bool(cut) and not cut_file.exists()
        victim = first and part == cut["partition"]
        if first and not victim:
            # until the victim's attempt is cut: what the broker holds until then is the victim's alone
            mark(markers, info, "wait", cut=poll(cut_file.exists, WAIT_LIMIT))
        if request["source"] == "generated":
            for _ in batches:           # the one row of spark.range: read to its end (the worker is reused)
                pass
            batches = generated(part)
        sent = 0
        for record_batch in batches:
            # Cut once the broker holds ``after`` batches. Batches yielded are not all there yet: the last ones
            # may wait in this worker's output buffer or in the JVM, so go on yielding (a few) while none of the
            # partition's batches waits on the feeding worker's input, then wait
            held = None
            if victim and sent >= cut["after"]:
                held = holds(broker, delivery, cut["after"], batch_bytes) if sent < cut["after"] + LAG else \
                    poll(lambda: holds(broker, delivery, cut["after"], batch_bytes), WAIT_LIMIT) or \
                    {"timed_out": True, **broker_figures(broker)}
            if held is not None:
                victim = False
                if cut["how"] == "fail":
                    mark(markers, info, "fail", batches=sent, broker=held)
                    cut_file.touch()
                    raise RuntimeError(f"injected failure upstream of the feed in partition {part} after {sent} "
                                       f"batches")
                mark(markers, info, "stall", batches=sent, broker=held)
                poll(cut_file.exists, WAIT_LIMIT)       # the test kills this executor meanwhile
                mark(markers, info, "resume")
            if delay:
                time.sleep(delay)
            yield record_batch
            sent += 1
        mark(markers, info, "done", batches=sent)

    schema = "id long, x array<float>"
    if request["source"] == "generated":
        return spark.range(partitions, numPartitions=partitions).mapInArrow(gate, schema)
    shuffled = id_frame(spark, rows, 2, width).repartition(partitions, "id")
    if request.get("sorted"):
        shuffled = shuffled.sortWithinPartitions("id")
    return shuffled.mapInArrow(gate, schema)


def parent_of(pid: int) -> int:
    """The parent of ``pid`` (/proc), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return 0
    return int(text[text.rindex(")") + 2:].split()[1])


def warm_up(spark, source: str, executors: int) -> list[str]:
    """Run one task of the feed's kind on every executor, importing the feeder; return the executors' ids.

    A cold Python worker (forked, then numpy, pyarrow, zmq and sparkbus imported) takes seconds here: its first
    task would look slow and be speculated for the wrong reason. The warm-up is a barrier stage, one task per
    slot at once, which Spark never speculates: a warm-up task killed in favour of a copy would leave its
    executor as cold as before (a killed task's Python worker is not reused).
    """
    def executor_of() -> str:
        importlib.import_module("sparkbus.feeder")          # numpy, pyarrow, zmq and sparkbus, once per Python worker
        return os.path.basename(os.getcwd())

    def arrow_executor(batches):
        import pyarrow as pa

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"executor": [executor_of()]})

    def passed_on(batches):
        importlib.import_module("sparkbus.feeder")
        yield from batches

    if source == "rdd":
        rdd = spark.sparkContext.parallelize(range(executors), executors).barrier()
        found = rdd.mapPartitions(lambda _: [executor_of()]).collect()
    else:
        frame = id_frame(spark, 100 * executors, executors, 1)
        if source in ("generated", "shuffle"):      # two Python workers a task: the gate's and the feed's
            frame = frame.mapInArrow(passed_on, frame.schema)
        found = [row.executor for row in
                 frame.mapInArrow(arrow_executor, "executor string", barrier=True).collect()]
    if len(set(found)) != executors:
        raise RuntimeError(f"the warm-up's {executors} tasks ran on executors {found}")
    return sorted(set(found))


def wait_for_executors(spark, executors: int, timeout: float) -> None:
    """Wait until ``executors`` executors have registered (a barrier stage needs all its slots at once)."""
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    if not poll(lambda: len(tracker.getExecutorInfos()) > executors, timeout):      # the driver is listed too
        raise TimeoutError(f"{executors} executors did not register within {timeout:g} s")


def task_records(events: Path, group: str, timeout: float) -> list[dict]:
    """The tasks of the jobs of ``group``, from Spark's event log once the last job's end is in it (the log is
    flushed at each job's end; a task killed after that, such as a losing speculative attempt, has no end yet)."""
    deadline = time.monotonic() + timeout
    while True:
        jobs, stages, ended, tasks = set(), set(), set(), {}
        for line in events.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:           # the line being written
                continue
            kind = event["Event"]
            if kind == "SparkListenerJobStart" and event.get("Properties", {}).get("spark.jobGroup.id") == group:
                jobs.add(event["Job ID"])
                stages.update(event["Stage IDs"])
            elif kind == "SparkListenerJobEnd" and event["Job ID"] in jobs:
                ended.add(event["Job ID"])
            elif kind in ("SparkListenerTaskStart", "SparkListenerTaskEnd") and event["Stage ID"] in stages:
                info = event["Task Info"]
                record = tasks.setdefault(info["Task ID"], {"reason": None})
                record.update(stage=event["Stage ID"], stage_attempt=event["Stage Attempt ID"],
                              partition=info["Index"], attempt=info["Attempt"], task=info["Task ID"],
                              executor=info["Executor ID"], host=info["Host"], speculative=info["Speculative"],
                              launch=info["Launch Time"] / 1000, finish=info["Finish Time"] / 1000 or None)
                if kind == "SparkListenerTaskEnd":
                    record["reason"] = event["Task End Reason"]["Reason"]
                    record["type"] = event["Task Type"]
        if (jobs and ended == jobs) or time.monotonic() > deadline:
            return sorted(tasks.values(), key=lambda t: (t["stage"], t["stage_attempt"], t["partition"],
                                                         t["attempt"]))
        time.sleep(0.1)


def run_feed(spark, request: dict, events: Path, executors: int) -> dict:
    """One ``feed`` request (see the module's docstring)."""
    source, stream, width = request.get("source", "dataframe"), request["stream"], request.get("width", 64)
    context = spark.sparkContext
    # an executor killed by an earlier test is replaced by its Worker: wait for it (the warm-up needs every slot)
    wait_for_executors(spark, executors, 120.0)
    environment = dict(context.environment)
    if request.get("hold"):
        # Python functions made from here on carry these variables; Spark starts a pyspark daemon of their own
        context.environment.update({"PYTHONPATH": str(HELD_WORKERS_SITE), HOLD_WORKERS_ENV: request["hold"]})
    group = f"feed-{stream}"
    try:
        found = warm_up(spark, source, executors)     # a Python worker idle for a minute is ended: warm them again
        if request.get("markers"):
            Path(request["markers"]).mkdir(parents=True, exist_ok=True)
        broker = {"control": control_address(request["feed"]), "stream": stream}
        if source == "rdd":
            data = faulty_rdd(context, request["rows"], request["partitions"], width, request["markers"], broker,
                              request.get("fail"), request.get("slow"))
        elif request.get("fail") or request.get("slow"):
            raise ValueError("fail and slow need the rdd source")
        elif source in ("generated", "shuffle"):
            data = gated_frame(spark, request, broker)
        else:
            data = id_frame(spark, request["rows"], request["partitions"], width)
        context.setJobGroup(group, f"feed stream {stream}")
        # one batch a message (no packs): the tests count what the broker holds, and its duplicates, in batches
        report = feed(data, request["feed"], stream=stream, batch_size=request["batch_size"],
                      timeout=request.get("timeout", 30.0), pack_bytes=0,
                      delivery=request.get("delivery", "stream"), arrow_batch_rows=request.get("arrow_batch_rows"))
    finally:
        context.setJobGroup("", "")
        context.environment.clear()
        context.environment.update(environment)
    return {"report": report._asdict(), "tasks": task_records(events, group, 30.0), "executors": found,
            "stages": stage_records(events, group)}


def stage_records(events: Path, group: str) -> list[dict]:
    """Each attempt of each stage of the jobs of ``group`` (read after :func:`task_records` found them ended)."""
    jobs, stages, found = set(), set(), {}
    for line in events.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event["Event"]
        if kind == "SparkListenerJobStart" and event.get("Properties", {}).get("spark.jobGroup.id") == group:
            jobs.add(event["Job ID"])
            stages.update(event["Stage IDs"])
        elif kind in ("SparkListenerStageSubmitted", "SparkListenerStageCompleted"):
            info = event["Stage Info"]
            if info["Stage ID"] in stages:
                found[info["Stage ID"], info["Stage Attempt ID"]] = {
                    "stage": info["Stage ID"], "attempt": info["Stage Attempt ID"], "name": info["Stage Name"],
                    "tasks": info["Number of Tasks"],
                    "failure": (info.get("Failure Reason") or "").split("\n", 1)[0] or None}
    return [found[key] for key in sorted(found)]


def serve(spark, control: zmq.Socket, events: Path, executors: int) -> None:
    """Answer requests until ``stop``; a failed feed is answered with its error, for the test to fail on."""
    while True:
        if not control.poll(1000):
            continue
        request = json.loads(control.recv())
        if request["cmd"] == "stop":
            control.send(json.dumps({"stopped": True}).encode())
            return
        started = time.monotonic()
        try:
            reply = run_feed(spark, request, events, executors)
        except Exception as exc:
            log.exception("the feed of stream %r failed", request.get("stream"))
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        log.info("fed stream %r in %.1f s", request.get("stream"), time.monotonic() - started)
        control.send(json.dumps(reply).encode())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ready", required=True, help="write the control endpoint here once serving")
    parser.add_argument("--events", required=True, help="Spark's event log directory")
    parser.add_argument("--conf", action="append", default=[], help="a Spark setting, key=value")
    parser.add_argument("--executors", type=int, default=2, help="executors to wait for before serving")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the executors")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    started = time.monotonic()
    os.environ["PYSPARK_PYTHON"] = sys.executable       # the executors' Python: the venv's, with sparkbus
    from pyspark.sql import SparkSession

    settings = dict(item.split("=", 1) for item in args.conf)
    settings.update({"spark.eventLog.enabled": "true", "spark.eventLog.dir": Path(args.events).as_uri(),
                     "spark.eventLog.compress": "false", "spark.eventLog.rolling.enabled": "false"})
    builder = SparkSession.builder.appName("sparkbus-cluster-tests")
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    log.info("session %s started after %.1f s", spark.sparkContext.applicationId, time.monotonic() - started)
    context = zmq.Context()
    control = context.socket(zmq.REP)
    control.linger = 0
    try:
        wait_for_executors(spark, args.executors, args.timeout)
        log.info("%d executors registered after %.1f s", args.executors, time.monotonic() - started)
        executors = warm_up(spark, "rdd", args.executors)
        log.info("warmed up after %.1f s: serving", time.monotonic() - started)
        port = control.bind_to_random_port("tcp://127.0.0.1")
        announce_ready(args.ready, control=f"tcp://127.0.0.1:{port}", executors=executors)
        events = Path(args.events) / f"{spark.sparkContext.applicationId}.inprogress"
        serve(spark, control, events, args.executors)
    finally:
        control.close(0)
        context.term()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
