"""The Spark driver of the fault table (``faults.py``): a SparkSession that feeds on requests given as files.

    python benchmarks/faults_feeder.py --dir DIR [--master local[2,4]] [--conf KEY=VALUE ...] [--executors N]

``local[2,4]`` by default (a failed task retried), or a standalone cluster's URL, waiting for N executors. Touches
``DIR/ready``; answers ``DIR/req-N.json`` with ``DIR/res-N.json`` (written by a rename), each in a thread; leaves
when ``DIR/stop`` exists. Files, not a socket, so that it can run in a network namespace of its own.

* ``{"rows", "partitions", "batch_size", "pause", "address", "stream", "timeout", "pack_bytes", "delivery",
  "source"}``: ``feeder.feed`` of ids 0..rows-1, each task pausing after each batch. ``source="rows"``: made in the
  task's Python worker, which writes ``DIR/pids/<stream>-p<partition>-a<attempt>.pid`` (and ``.end``);
  ``source="dataframe"``: ``spark.range`` with ``x`` the id as ``width`` float32s, made and paused in the
  executor's JVM, so that a JVM killed mid-partition cuts its Python worker's input at a batch boundary. Answers
  ``{"ok": true, "report", "seconds"}`` or ``{"ok": false, "type", "error", "seconds"}``.
* ``{"cmd": "warm", "executors": N, "timeout": T}``: a task on every slot of N executors; answers their ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# Thread.sleep before every batch's first row, in the JVM (reflect answers "null": the filter keeps every row)
PACE = "reflect('java.lang.Thread', 'sleep', if(id % {batch} = 0, {ms}L, 0L)) != 'never'"


def _rows(spark: Any, r: dict, pids: str) -> Any:
    rows, batch, pause, stream = r["rows"], r["batch_size"], r.get("pause", 0.0), r["stream"]

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

    return spark.sparkContext.parallelize(range(rows), r["partitions"]).mapPartitionsWithIndex(produce)


def _frame(spark: Any, r: dict) -> Any:
    """ids 0..rows-1 made in the JVM, ``x`` the id ``width`` times, paced by a sleep in the JVM before each batch."""
    frame = spark.range(0, r["rows"], numPartitions=r["partitions"])
    if r.get("pause"):
        frame = frame.where(PACE.format(batch=r["batch_size"], ms=round(r["pause"] * 1000)))
    return frame.selectExpr("id", f"array_repeat(cast(id as float), {r.get('width', 256)}) as x")


def _feed(spark: Any, r: dict, pids: str) -> dict:
    import warnings

    from sparkbus.feeder import feed

    if r.get("source", "rows") == "dataframe":
        data, more = _frame(spark, r), {"arrow_batch_rows": r["batch_size"]}
    else:
        data, more = _rows(spark, r, pids), {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = feed(data, r["address"], stream=r["stream"], batch_size=r["batch_size"], timeout=r["timeout"],
                      pack_bytes=r.get("pack_bytes", 0), delivery=r.get("delivery", "stream"), **more)
    return {**report._asdict(), "warnings": [str(w.message) for w in caught]}


def warm(spark: Any, wanted: int, timeout: float) -> list[str]:
    """Wait for ``wanted`` executors, then run a task on each at once (a barrier stage: one per slot, never
    speculated), through ``mapInArrow`` as a feed does, importing the feeder (numpy, pyarrow, zmq) in its Python
    worker: a cold worker would take seconds on the first task of a feed. Returns the executors' ids."""
    context = spark.sparkContext._jsc.sc()
    deadline = time.monotonic() + timeout
    while context.getExecutorIds().size() < wanted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{wanted} executors did not register within {timeout:g} s "
                               f"({context.getExecutorIds().size()} did)")
        time.sleep(0.2)

    def executor_of(batches: Any) -> Any:
        import importlib

        import pyarrow as pa

        importlib.import_module("sparkbus.feeder")
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"executor": [os.path.basename(os.getcwd())]})

    found = [row.executor for row in spark.range(0, wanted, numPartitions=wanted)
             .mapInArrow(executor_of, "executor string", barrier=True).collect()]
    if len(set(found)) != wanted:
        raise RuntimeError(f"the warm-up's {wanted} tasks ran on executors {found}")
    return sorted(found)


def answer(spark: Any, r: dict, pids: str) -> dict:
    command = r.get("cmd", "feed")
    if command == "warm":
        return {"executors": warm(spark, r["executors"], r.get("timeout", 120.0))}
    return {"report": _feed(spark, r, pids)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--master", default="local[2,4]")
    parser.add_argument("--conf", action="append", default=[], help="a Spark setting, KEY=VALUE")
    parser.add_argument("--executors", type=int, default=0, help="executors to wait for and warm before ready")
    args = parser.parse_args()
    sys.path[0] = str(Path(__file__).resolve().parent.parent)      # the checkout's root (launch/)
    from sparkbus.launch.spark import local_session

    pids = args.dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    spark = local_session(args.master, "sparkbus-bench-faults", dict(item.split("=", 1) for item in args.conf))
    if args.executors:
        warm(spark, args.executors, 180.0)
    else:
        # a first job: the Python workers' start and imports, off the clock of the first feed
        spark.sparkContext.parallelize(range(4), 2).map(lambda x: __import__("numpy").float32(x)).collect()
    (args.dir / "ready").touch()
    handled: set[Path] = set()

    def serve(path: Path) -> None:
        started = time.monotonic()
        try:
            reply = {"ok": True, **answer(spark, json.loads(path.read_text()), str(pids))}
        except Exception as exc:        # answered, not fatal: the section reports it
            reply = {"ok": False, "type": type(exc).__name__, "error": str(exc),
                     "traceback": traceback.format_exc()}
        reply["seconds"] = time.monotonic() - started
        answer_path = path.with_name(path.name.replace("req-", "res-"))
        answer_path.with_suffix(".tmp").write_text(json.dumps(reply))
        answer_path.with_suffix(".tmp").rename(answer_path)

    try:
        while not (args.dir / "stop").exists():
            for path in sorted(args.dir.glob("req-*.json")):
                if path not in handled:
                    handled.add(path)
                    threading.Thread(target=serve, args=(path,), daemon=True).start()
            time.sleep(0.05)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
