"""A Spark driver process of its own (figure 6's standalone set-ups, 2b's pinned ``local[1]``, the fault table's
drivers), answering the benchmark's requests given as files (``common.DriverProcess``), so that one can run in a
network namespace. Once ``--executors`` are up and a task has run on each of the ``--slots`` at once, it writes
``DIR/ready``; then it answers each ``DIR/req-<n>.json`` (``{"cmd", ...}``: a :class:`Driver` method, or ``stop``)
with ``DIR/res-<n>.json``, one at a time. ``--cpus`` pins it (its JVM and their Python workers with it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

try:                                  # a module of the benchmarks package (the local[2] set-up of figure 6)
    from . import spark_data
except ImportError:                   # run as a script: its own directory is on sys.path
    import spark_data  # type: ignore[no-redef]

log = logging.getLogger("sparkbus.bench.spark_driver")
# Thread.sleep before every batch's first row, in the JVM (reflect answers "null": the filter keeps every row)
PACE = "reflect('java.lang.Thread', 'sleep', if(id % {batch} = 0, {ms}L, 0L)) != 'never'"


class Driver:
    """The session, the DataFrame it measures, and the fault table's feeds of ids (their tasks' pids in ``pids``)."""

    def __init__(self, spark: Any, pids: Path | None = None):
        self.spark, self.pids = spark, pids
        self.df: Any = None
        self.rows = 0
        self.prepared = 0             # frames prepared so far: each warm-up feed has a stream of its own

    def prepare(self, rows: int, partitions: int, feed: str, kind: str = "fixed") -> dict:
        """Cache ``kind``'s frame (``spark_data``), scan it and warm a feed up; how it is stored."""
        from sparkbus.bench.e2e import hand_off

        self.close()
        self.df, info = spark_data.kind_frame(self.spark, kind, rows, partitions)
        self.rows = info["rows"]
        started = time.monotonic()
        hand_off(self.df)             # the first full scan of a cache is slower than later ones
        self.prepared += 1
        spark_data.warm_up_feed(self.df, self.rows, feed, f"warm-up-{os.getpid()}-{self.prepared}")
        info["warm_up_seconds"] = time.monotonic() - started
        return info

    def close(self) -> None:
        if self.df is not None:
            self.df.unpersist(blocking=True)
            self.df = None

    def limit(self) -> dict:
        """Spark's own Arrow hand-off of the prepared frame."""
        from sparkbus.bench.e2e import hand_off

        seconds, rows = hand_off(self.df)
        return {"seconds": seconds, "rows": rows}

    def feed(self, feed: str, stream: str, batch_size: int, timeout: float, options: dict | None = None) -> tuple:
        """A timed feed of the prepared frame (``spark_data.timed_feed``)."""
        return spark_data.timed_feed(self.df, feed, stream, batch_size, timeout, **(options or {}))

    def warm(self, executors: int, slots: int, timeout: float = 180.0) -> list[dict]:
        """Wait for ``executors`` executors, then run a task on every slot at once (a barrier stage: never
        speculated) that imports the feeder, as a feed's first task would; where they ran: ``[{"executor", "host",
        "feeder" (the folder it imported), "affinity" (its CPUs), "slots"}]``."""
        context = self.spark.sparkContext._jsc.sc()
        deadline = time.monotonic() + timeout
        while context.getExecutorIds().size() < executors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{executors} executors did not register within {timeout:g} s "
                                   f"({context.getExecutorIds().size()} did)")
            time.sleep(0.2)

        def where(_):
            import os

            from sparkbus import feeder

            # a standalone Worker runs each executor in a work directory of its own: .../app-id/executor-id
            yield (os.path.basename(os.getcwd()), os.environ.get("SPARK_LOCAL_IP", "?"),
                   os.path.dirname(feeder.__file__), tuple(sorted(os.sched_getaffinity(0))))

        found: dict[tuple, int] = {}
        for place in self.spark.sparkContext.parallelize(range(slots), slots).barrier().mapPartitions(where).collect():
            found[place] = found.get(place, 0) + 1
        if executors and len({e for e, *_ in found}) != executors:
            raise RuntimeError(f"the warm-up's {slots} tasks ran on executors {sorted(found)}")
        return [{"executor": e, "host": h, "feeder": f, "affinity": list(a), "slots": k}
                for (e, h, f, a), k in sorted(found.items())]

    def feed_ids(self, rows: int, partitions: int, batch_size: int, address: str, stream: str, timeout: float,
                 pause: float = 0.0, pack_bytes: int = 0, delivery: str = "stream", source: str = "rows",
                 width: int = 256) -> dict:
        """The fault table's feed of ids 0..rows-1, each task pausing ``pause`` s after each batch: made in the
        task's Python worker (``source="rows"``; it writes ``pids/<stream>-p<partition>-a<attempt>.pid`` and
        ``.end``), or in the executor's JVM (``"dataframe"``, ``x`` the id as ``width`` float32s), so that a JVM
        killed mid-partition cuts its Python worker's input at a batch boundary. The report and its warnings."""
        import warnings

        from sparkbus.feeder import feed

        if source == "dataframe":
            data: Any = self.spark.range(0, rows, numPartitions=partitions)
            if pause:
                data = data.where(PACE.format(batch=batch_size, ms=round(pause * 1000)))
            data, more = data.selectExpr("id", f"array_repeat(cast(id as float), {width}) as x"), {
                "arrow_batch_rows": batch_size}
        else:
            data, more = self.spark.sparkContext.parallelize(range(rows), partitions).mapPartitionsWithIndex(
                _paced_rows(str(self.pids), stream, batch_size, pause)), {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = feed(data, address, stream=stream, batch_size=batch_size, timeout=timeout,
                          pack_bytes=pack_bytes, delivery=delivery, **more)
        return {**report._asdict(), "warnings": [str(w.message) for w in caught]}


def _paced_rows(pids: str, stream: str, batch: int, pause: float) -> Any:
    def produce(part: int, ids: Any) -> Any:
        import numpy as np
        from pyspark import TaskContext

        mark = os.path.join(pids, f"{stream}-p{part}-a{TaskContext.get().attemptNumber()}")
        with open(mark + ".pid", "w") as f:
            f.write(str(os.getpid()))
        for i, value in enumerate(ids):
            if pause and i and i % batch == 0:
                time.sleep(pause)
            yield {"id": value, "x": np.float32(value)}
        open(mark + ".end", "w").close()

    return produce


def serve(driver: Driver, folder: Path) -> None:
    """Answer ``req-1.json``, ``req-2.json``, ... in turn until ``stop``."""
    for number in range(1, sys.maxsize):
        path = folder / f"req-{number}.json"
        while not path.exists():
            time.sleep(0.02)
        request = json.loads(path.read_text())
        cmd, started = request.pop("cmd"), time.monotonic()
        try:
            reply = {"ok": True, "value": None if cmd == "stop" else getattr(driver, cmd)(**request)}
        except Exception as exc:        # answered, not fatal: the section reports it
            log.exception("%s failed", cmd)
            reply = {"ok": False, "type": type(exc).__name__, "error": str(exc), "traceback": traceback.format_exc()}
        reply["seconds"] = time.monotonic() - started
        log.info("%s took %.2f s", cmd, reply["seconds"])
        answer = folder / f"res-{number}.json"
        answer.with_suffix(".tmp").write_text(json.dumps(reply))
        answer.with_suffix(".tmp").rename(answer)
        if cmd == "stop":
            return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="requests, answers and the ready file")
    parser.add_argument("--conf", action="append", default=[], help="a Spark setting, key=value")
    parser.add_argument("--executors", type=int, default=0, help="executors to wait for before serving")
    parser.add_argument("--slots", type=int, default=1, help="task slots in all to warm (executors x cores)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the executors")
    parser.add_argument("--cpus", help="comma-separated CPUs to pin the driver, its JVM and their Python workers to")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.cpus:
        # before the session: the JVM it starts, and the JVM's Python workers, inherit the affinity
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    from sparkbus.launch.processes import announce_ready
    from sparkbus.launch.spark import local_session

    started = time.monotonic()
    conf = dict(item.split("=", 1) for item in args.conf)
    spark = local_session(conf.pop("spark.master", "local[2,4]"), conf.pop("spark.app.name", "sparkbus-bench"), conf)
    (args.dir / "pids").mkdir(parents=True, exist_ok=True)
    driver = Driver(spark, args.dir / "pids")
    try:
        executors = driver.warm(args.executors, args.slots, args.timeout)
        log.info("executors %s ready after %.1f s", executors, time.monotonic() - started)
        announce_ready(args.dir / "ready", executors=executors, session_seconds=time.monotonic() - started)
        serve(driver, args.dir)
    finally:
        driver.close()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
