"""A Spark driver process of its own, answering the benchmark's requests (figure 6's standalone set-ups, 2b's local[1]).

A process holds one SparkContext: this one answers JSON requests on a loopback ZeroMQ REP socket.

    python benchmarks/spark_driver.py --ready FILE --executors N --slots S [--cpus 0] --conf k=v ...

Once ``N`` executors are up and warm it writes ``FILE`` (``{"control", "executors", "session_seconds"}``) and
answers, one at a time, with a dict or ``{"error": text}``: ``prepare`` (``rows``, ``partitions``, ``feed``,
``kind``: the cached DataFrame of ``spark_data``, warmed up), ``limit`` (its Arrow hand-off: ``seconds``, ``rows``),
``feed`` (``feed``, ``stream``, ``batch_size``, ``timeout``, ``options``: ``t0``, ``t_fed``, ``report``), ``where``
(the sparkbus a Python worker imports, its CPUs) and ``stop``. ``--cpus`` pins it before the session starts; it
exits by itself after ``--idle`` seconds without a request.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

import zmq

from sparkbus.bench.e2e import hand_off
from sparkbus.launch.processes import announce_ready

try:                                  # a module of the benchmarks package (the local[2] set-up of figure 6)
    from . import spark_data
except ImportError:                   # run as a script: its own directory is on sys.path
    import spark_data  # type: ignore[no-redef]

log = logging.getLogger("sparkbus.bench.spark_driver")


class Driver:
    """The session and the DataFrame it measures."""

    def __init__(self, spark):
        self.spark = spark
        self.df = None
        self.rows = 0
        self.prepared = 0             # frames prepared so far: each warm-up feed has a stream of its own

    def prepare(self, rows: int, partitions: int, feed: str, kind: str = "fixed") -> dict:
        if self.df is not None:
            self.df.unpersist(blocking=True)
            self.df = None
        self.df, info = spark_data.kind_frame(self.spark, kind, rows, partitions)
        self.rows = info["rows"]
        started = time.monotonic()
        hand_off(self.df)             # the first full scan of a cache is slower than later ones
        scanned = time.monotonic()
        self.prepared += 1
        spark_data.warm_up_feed(self.df, self.rows, feed, f"warm-up-{os.getpid()}-{self.prepared}")
        info["warm_up_seconds"] = time.monotonic() - started
        log.info("cached %d rows in %d partitions in %.1f s; warm-up: scans %.1f s, feed %.1f s", self.rows,
                 partitions, info["build_seconds"], scanned - started, time.monotonic() - scanned)
        return info

    def close(self) -> None:
        if self.df is not None:
            self.df.unpersist()
            self.df = None

    def limit(self) -> dict:
        seconds, rows = hand_off(self.df)
        return {"seconds": seconds, "rows": rows}

    def feed(self, feed: str, stream: str, batch_size: int, timeout: float, options: dict | None = None) -> dict:
        t0, t_fed, report = spark_data.timed_feed(self.df, feed, stream, batch_size, timeout, **(options or {}))
        return {"t0": t0, "t_fed": t_fed, "report": report}

    def where(self) -> dict:
        return where_tasks_run(self.spark)


def where_tasks_run(spark) -> dict:
    """Which sparkbus a Spark Python worker imports and which CPUs it may use (one task)."""
    def where(_):
        import os

        from sparkbus import broker, feeder

        yield os.path.dirname(feeder.__file__), os.path.dirname(broker.__file__), sorted(os.sched_getaffinity(0))

    (feeder_dir, broker_dir, cpus), = spark.sparkContext.parallelize([0], 1).mapPartitions(where).collect()
    return {"feeder": feeder_dir, "broker": broker_dir, "affinity": cpus}


def wait_for_executors(spark, n: int, slots: int, timeout: float) -> list[dict]:
    """Wait until ``n`` executors have registered, then run one task per slot at once (a barrier stage) to see
    where they are: ``[{"executor", "host", "slots"}]``."""
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    deadline = time.monotonic() + timeout
    while len(tracker.getExecutorInfos()) <= n:          # the driver is listed too
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} executors did not register within {timeout:g} s")
        time.sleep(0.1)

    def where(_):
        # a standalone Worker runs each executor in a work directory of its own: .../app-id/executor-id
        yield os.path.basename(os.getcwd()), os.environ.get("SPARK_LOCAL_IP", "?")

    log.info("%d executors registered", n)
    found: dict[tuple[str, str], int] = {}
    for place in spark.sparkContext.parallelize(range(slots), slots).barrier().mapPartitions(where).collect():
        found[place] = found.get(place, 0) + 1
    return [{"executor": e, "host": h, "slots": k} for (e, h), k in sorted(found.items())]


def serve(driver: Driver, control: zmq.Socket, idle: float) -> None:
    last = time.monotonic()
    while True:
        if not control.poll(1000):
            if time.monotonic() - last > idle:
                raise TimeoutError(f"no request for {idle:g} s")
            continue
        request = json.loads(control.recv())
        last = time.monotonic()
        cmd = request.pop("cmd")
        if cmd == "stop":
            control.send(json.dumps({"stopped": True}).encode())
            return
        started = time.monotonic()
        try:
            reply = getattr(driver, cmd)(**request)
        except Exception:
            log.exception("%s failed", cmd)
            reply = {"error": traceback.format_exc()}
        log.info("%s took %.2f s", cmd, time.monotonic() - started)
        control.send(json.dumps(reply).encode())
        last = time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ready", required=True, help="write the control endpoint here once serving")
    parser.add_argument("--conf", action="append", default=[], help="a Spark setting, key=value")
    parser.add_argument("--executors", type=int, required=True, help="executors to wait for before serving")
    parser.add_argument("--slots", type=int, required=True, help="task slots in all (executors x cores)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the executors")
    parser.add_argument("--idle", type=float, default=600.0, help="exit after this long without a request")
    parser.add_argument("--cpus", help="comma-separated CPUs to pin the driver, its JVM and their Python workers to")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.cpus:
        # before the session: the JVM it starts, and the JVM's Python workers, inherit the affinity
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    started = time.monotonic()
    os.environ["PYSPARK_PYTHON"] = sys.executable       # the executors' Python: this one, with sparkbus
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("sparkbus-bench-driver")
    for key, value in (item.split("=", 1) for item in args.conf):
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    log.info("session %s started after %.1f s", spark.sparkContext.applicationId, time.monotonic() - started)
    context = zmq.Context()
    control = context.socket(zmq.REP)
    control.linger = 0
    try:
        found = wait_for_executors(spark, args.executors, args.slots, args.timeout)
        session_seconds = time.monotonic() - started
        log.info("executors %s ready after %.1f s", found, session_seconds)
        port = control.bind_to_random_port("tcp://127.0.0.1")
        announce_ready(args.ready, control=f"tcp://127.0.0.1:{port}", executors=found,
                       session_seconds=session_seconds)
        serve(Driver(spark), control, args.idle)
    finally:
        control.close(0)
        context.term()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
