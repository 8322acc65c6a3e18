"""The Spark driver of the fault table (``benchmarks/faults.py``): a local SparkSession that feeds on request.

    python benchmarks/faults_feeder.py --dir DIR [--master local[2,4]]

Starts a SparkSession (``local[2,4]`` by default: two task slots, and a failed task is retried up to 3 times, as a
cluster would), touches ``DIR/ready``, then answers requests given as files: ``DIR/req-N.json`` is answered by
``DIR/res-N.json`` (written whole, by a rename), each request in a thread of its own. It leaves when
``DIR/stop`` exists (or its parent dies). Files, not a socket, so that the section can drive a driver that runs in
a network namespace of its own.

A request ``{"rows": R, "partitions": P, "batch_size": B, "pause": S, "address": ..., "stream": ..., "timeout":
T, "pack_bytes": 0}`` runs :func:`feeder.feed` of an RDD of rows ``{"id": i, "x": float32(i)}``, i in 0..R-1, whose
tasks sleep S seconds after each batch's worth of rows (so the feed lasts and a fault lands mid-partition). Each
task attempt writes ``DIR/pids/<stream>-p<partition>-a<attempt>.pid`` (the pid of the Python worker running it:
the process to kill for an executor fault) when it starts and a ``.end`` beside it once it has produced its
rows. The answer is ``{"ok": true, "report": FeedReport as a dict, "seconds"}`` or ``{"ok": false, "type",
"error", "seconds"}``.
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


def _feed(spark: Any, r: dict, pids: str) -> dict:
    import warnings

    from feeder import feed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = feed(_rows(spark, r, pids), r["address"], stream=r["stream"], batch_size=r["batch_size"],
                      timeout=r["timeout"], pack_bytes=r.get("pack_bytes", 0))
    return {**report._asdict(), "warnings": [str(w.message) for w in caught]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--master", default="local[2,4]")
    args = parser.parse_args()
    sys.path[0] = str(Path(__file__).resolve().parent.parent)      # the checkout's root (launch/)
    from launch.spark import local_session

    pids = args.dir / "pids"
    pids.mkdir(parents=True, exist_ok=True)
    spark = local_session(args.master, "sparkbus-bench-faults")
    # a first job: the Python workers' start and imports, off the clock of the first feed
    spark.sparkContext.parallelize(range(4), 2).map(lambda x: __import__("numpy").float32(x)).collect()
    (args.dir / "ready").touch()
    handled: set[Path] = set()

    def serve(path: Path) -> None:
        started = time.monotonic()
        try:
            reply = {"ok": True, "report": _feed(spark, json.loads(path.read_text()), str(pids))}
        except Exception as exc:        # answered, not fatal: the section reports it
            reply = {"ok": False, "type": type(exc).__name__, "error": str(exc),
                     "traceback": traceback.format_exc()}
        reply["seconds"] = time.monotonic() - started
        answer = path.with_name(path.name.replace("req-", "res-"))
        answer.with_suffix(".tmp").write_text(json.dumps(reply))
        answer.with_suffix(".tmp").rename(answer)

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
