"""A helper process on one host of a test network (tests/integration/test_hosts.py): it runs what the test process,
which stays in the root network namespace, cannot reach from there.

Run as ``python host_agent.py [--spark MASTER]``. It reads one JSON request per line on stdin and answers each
with one JSON line on stdout, ``{"id", "ok", "result" | "error", "type", "seconds"}``, each request in a thread
of its own so that a slow feed does not hold a stats request back:

* ``{"op": "ping"}``: answered once the agent is ready (its SparkSession started).
* ``{"op": "stats", "address": ...}``: the broker's figures (:func:`broker.client.fetch_stats`).
* ``{"op": "feed", "address": ..., "rows": N, "partitions": P, "stream": ..., "batch_size": B, "timeout": T,
  "pause": S}``: with ``--spark``, :func:`feeder.feed` of an RDD of rows ``{"id": i, "x": float32(i)}``,
  i in 0..N-1, whose tasks sleep S seconds after each batch's worth of rows (so a fault lands mid-partition).

:class:`HostAgent` is the test's end: it starts the program through :meth:`launch.netns.Network.popen`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


# ---- the test's end -------------------------------------------------------------------------------------------


class AgentError(AssertionError):
    """The agent answered a request with an error; ``type`` is the exception's class name."""

    def __init__(self, type_: str, message: str):
        super().__init__(f"{type_}: {message}")
        self.type, self.message = type_, message


class HostAgent:
    """Requests to a ``host_agent.py`` running on ``host`` of ``net``.

    Args:
        net: a :class:`launch.netns.Network`.
        log: file for the agent's stderr (Spark's logs, tracebacks).
        spark: a Spark master (``local[2,2]``) to start a SparkSession for ``feed`` requests.
    """

    def __init__(self, net: Any, host: str, log: Path, spark: str | None = None):
        self.host, self.log = host, log
        argv = [sys.executable, "-u", str(HERE / "host_agent.py"), *(["--spark", spark] if spark else [])]
        with open(log, "w") as err:
            self.proc = net.popen(host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self._ids = itertools.count(1)
        self._replies: dict[int, dict] = {}
        self._arrived = threading.Condition()
        threading.Thread(target=self._read, name=f"agent-{host}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self._arrived:
                self._replies[reply["id"]] = reply
                self._arrived.notify_all()
        with self._arrived:
            self._arrived.notify_all()

    def submit(self, op: str, **fields: Any) -> int:
        """Send a request; returns its id for :meth:`result`."""
        number = next(self._ids)
        self.proc.stdin.write(json.dumps({"id": number, "op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        return number

    def result(self, number: int, wait: float) -> Any:
        """The answer to request ``number``, waited for at most ``wait`` s.

        Raises:
            AgentError: the request failed (the exception's type and message).
            AssertionError: no answer in time, or the agent exited (with the end of its log).
        """
        deadline = time.monotonic() + wait
        with self._arrived:
            while number not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    state = "exited" if self.proc.poll() is not None else f"gave no answer within {wait:g} s"
                    raise AssertionError(f"the agent on {self.host} {state}; the end of its log:\n{self.tail()}")
                self._arrived.wait(min(left, 0.5))
            reply = self._replies[number]
        if not reply["ok"]:
            raise AgentError(reply["type"], reply["error"])
        return reply["result"]

    def request(self, op: str, wait: float, **fields: Any) -> Any:
        """:meth:`submit` and :meth:`result`."""
        return self.result(self.submit(op, **fields), wait)

    def done(self, number: int) -> bool:
        with self._arrived:
            return number in self._replies

    def seconds(self, number: int) -> float:
        """How long request ``number`` ran in the agent (once answered)."""
        with self._arrived:
            return self._replies[number]["seconds"]

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# ---- the agent ------------------------------------------------------------------------------------------------


def _session(master: str) -> Any:
    import os

    # Loopback inside this host for the driver and its executors; the venv's Python in the tasks.
    os.environ.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                      SPARK_LOCAL_IP="127.0.0.1")
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master(master).appName("sparkbus-host-agent")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    return session


def _rows(spark: Any, rows: int, partitions: int, batch_size: int, pause: float) -> Any:
    def produce(_: int, ids: Any) -> Any:
        import numpy as np

        for i, value in enumerate(ids):
            if pause and i and i % batch_size == 0:
                time.sleep(pause)
            yield {"id": value, "x": np.float32(value)}

    return spark.sparkContext.parallelize(range(rows), partitions).mapPartitionsWithIndex(produce)


def _feed(spark: Any, r: dict) -> dict:
    import inspect
    import warnings

    from sparkbus.feeder import feed

    # One message per batch: a feeder that packs small batches into one message would send a partition of
    # these whole, and a fault could not land between its batches.
    unpacked = {"pack_bytes": 0} if "pack_bytes" in inspect.signature(feed).parameters else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = feed(_rows(spark, r["rows"], r["partitions"], r["batch_size"], r.get("pause", 0.0)),
                      r["address"], stream=r["stream"], epoch=r.get("epoch", 0), batch_size=r["batch_size"],
                      timeout=r["timeout"], **unpacked)
    return {**report._asdict(), "warnings": [str(w.message) for w in caught]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spark", help="start a SparkSession with this master for feed requests")
    args = parser.parse_args()
    spark = _session(args.spark) if args.spark else None
    out = threading.Lock()

    def serve(request: dict) -> None:
        started = time.monotonic()
        try:
            if request["op"] == "ping":
                reply = {"ok": True, "result": "pong"}       # answered once the SparkSession is up
            elif request["op"] == "stats":
                from sparkbus.broker.client import fetch_stats
                reply = {"ok": True, "result": fetch_stats(request["address"], request.get("timeout", 5.0))}
            elif request["op"] == "feed" and spark is not None:
                reply = {"ok": True, "result": _feed(spark, request)}
            else:
                raise ValueError(f"unknown request {request['op']!r} (feed needs --spark)")
        except Exception as exc:       # answered, not fatal: the test decides
            reply = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
        reply.update(id=request["id"], seconds=time.monotonic() - started)
        with out:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()

    for line in sys.stdin:
        threading.Thread(target=serve, args=(json.loads(line),), daemon=True).start()
    if spark is not None:
        spark.stop()


if __name__ == "__main__":
    main()
