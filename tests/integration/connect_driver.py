"""A Spark Connect client that feeds on request: tests/integration/test_connect.py runs it as a child process.

A classic SparkSession and a Spark Connect one do not share a process: ``remote(...)`` refuses while a
SparkContext is active, and once a Connect session exists pyspark's functions (``F.col``, ``vector_to_array``)
build Connect columns for every caller (``SPARK_CONNECT_MODE_ENABLED``), which breaks the classic session that
the suite keeps in its own process (``spark`` in conftest.py). So this process does what a user would:

    python connect_driver.py --ready FILE [--master local[2,4]]

starts ``SparkSession.builder.remote(MASTER)`` (a Connect server in this process, from the pyspark wheel, with
the venv's Python on its executors), writes ``FILE`` (``{"control": "tcp://127.0.0.1:N", "started": seconds}``)
and answers JSON requests on a ZeroMQ REP socket at ``control``:

* ``{"cmd": "feed", "source": SOURCE, "address": FEED, "kwargs": {...}}``: ``feeder.feed(data, FEED, **kwargs)``,
  answered with ``{"report": FeedReport, "seconds": s}``;
* ``{"cmd": "feed_epochs", "source": SOURCE, "address": FEED, "epochs": n, "kwargs": {...}}``:
  ``feeder.feed_epochs``, answered with ``{"reports": [FeedReport, ...], "seconds": s}``;
* ``{"cmd": "stop"}``: stops the session and the process.

A failed request is answered with ``{"error": {"type", "message", "cause", "cause_module"}}``: the exception
``feed`` raised and the one it was raised from. ``SOURCE`` is ``{"kind": "labelled" | "range" | "failing" |
"staged", ...}``: ``labelled_frame``, ``spark.range``, ``failing_frame`` or ``staged_frame`` of sources.py with the
other keys as arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import zmq

from sparkbus.launch.processes import announce_ready
from sparkbus.launch.spark import LOCAL_CONF, local_env

HERE = Path(__file__).parent
log = logging.getLogger("sparkbus.tests.connect_driver")


def source(spark, spec: dict):
    """The DataFrame a request names (see the module's docstring)."""
    from sources import failing_frame, labelled_frame, staged_frame

    spec = dict(spec)
    kind = spec.pop("kind")
    if kind == "labelled":
        return labelled_frame(spark, **spec)
    if kind == "range":
        return spark.range(spec["rows"], numPartitions=spec["partitions"])
    if kind == "failing":
        return failing_frame(spark, **spec)
    if kind == "staged":
        return staged_frame(spark, **spec)
    raise ValueError(f"no source {kind!r}")


def answer(spark, request: dict) -> dict:
    from sparkbus.feeder import feed, feed_epochs

    started = time.monotonic()
    data = source(spark, request["source"])
    if request["cmd"] == "feed":
        report = feed(data, request["address"], **request.get("kwargs", {}))
        return {"report": report._asdict(), "seconds": time.monotonic() - started}
    if request["cmd"] == "feed_epochs":
        reports = feed_epochs(data, request["address"], request["epochs"], **request.get("kwargs", {}))
        return {"reports": [r._asdict() for r in reports], "seconds": time.monotonic() - started}
    raise ValueError(f"no command {request['cmd']!r}")


def serve(spark, control: zmq.Socket) -> None:
    """Answer requests until ``stop``; a failed one is answered with its error, for the test to check."""
    while True:
        if not control.poll(1000):
            continue
        request = json.loads(control.recv())
        if request["cmd"] == "stop":
            control.send(json.dumps({"stopped": True}).encode())
            return
        try:
            reply = answer(spark, request)
        except Exception as exc:
            log.info("request %s failed: %s: %s", request["cmd"], type(exc).__name__, exc)
            cause = exc.__cause__
            reply = {"error": {"type": type(exc).__name__, "message": str(exc),
                               "cause": type(cause).__name__ if cause else None,
                               "cause_module": type(cause).__module__ if cause else None}}
        control.send(json.dumps(reply).encode())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ready", required=True, help="write the control endpoint here once serving")
    parser.add_argument("--master", default="local[2,4]", help="the local master of the Connect server")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    started = time.monotonic()
    # The executors' Python: the venv's, which imports sparkbus, and sources.py for the UDFs defined there
    os.environ.update(local_env())
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.remote(args.master)
    for key, value in {**LOCAL_CONF, "spark.sql.shuffle.partitions": "4"}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    seconds = time.monotonic() - started
    log.info("Spark Connect session (%s) started after %.1f s", type(spark).__module__, seconds)
    context = zmq.Context()
    control = context.socket(zmq.REP)
    control.linger = 0
    try:
        port = control.bind_to_random_port("tcp://127.0.0.1")
        announce_ready(args.ready, control=f"tcp://127.0.0.1:{port}", started=seconds)
        serve(spark, control)
    finally:
        control.close(0)
        context.term()
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
