"""Figure 6, Spark configurations as data suppliers: which Spark set-up feeds 2 ranks best.

As in "Spark as Data Supplier for MPI Deep Learning Processes" (IPSJ 2016-HPC-156), the same data is fed to the
same ranks by Spark set up in different ways:

* ``local``: the benchmark's own session, ``local[2]`` (driver and executor in one JVM, 2 task slots);
* a standalone cluster from the pyspark wheel (``launch.cluster``: a Master and two Workers on 127.0.0.1 and
  127.0.0.2, 2 cores and 2 GiB each), used by a driver of its own per configuration (``spark_driver.py``: a
  process holds one SparkContext): ``1x1`` one executor with 1 core, ``2x1`` two executors with 1 core each (one
  per Worker), ``1x2`` one executor with 2 cores;
* each with the DataFrame in 4 and in 16 partitions (feeding tasks per epoch).

Each (configuration, partitions) point builds the cached DataFrame of ``spark_data`` (``Sizes.spark_rows`` rows,
the same values everywhere) in that configuration's executors, warms it up (a scan, a small feed nobody reads),
then per repetition: the Arrow hand-off limit of that configuration (``mapInArrow``, dropped) and one epoch fed
by ``feeder.feed`` through one broker to ``mpiexec -n 2 rank_consumer.py`` ranks, started and ready beforehand.
Figures: rows/s to the ranks (all rows / time from the call of ``feed`` to the last batch at any rank) and the
time to the first batch at any rank; and, per configuration, the time from the driver's start to its executors
being up (``session start``).

The standalone cluster starts only after the local points are measured (its JVMs would compete with them); the
first driver starts while its Workers register. On a machine with 2 cores every configuration shares the same 2
cores with the broker and the ranks, so more executors or cores per executor mean more processes competing, not
more CPU.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import end_to_end
from common import HERE, ROOT, BenchError, Children, Sizes
from end_to_end import BATCH_SIZE, RANKS, Series
from launch.cluster import QUICK_START_JAVA_OPTS, StandaloneCluster
from launch.processes import ChildProcess, LaunchError, wait_for
from launch.spark import LOCAL_CONF

HOSTS = ("127.0.0.1", "127.0.0.2")        # two Workers on two loopback "hosts"
WORKER_CORES, WORKER_MEMORY = 2, "2g"
PARTITIONS = (4, 16)
MAX_BUFFER = "256MiB"
_streams = itertools.count()


@dataclass(frozen=True)
class Config:
    """One way of setting Spark up: local mode (``executors == 0``) or a standalone cluster's executors."""

    key: str
    executors: int
    cores: int

    @property
    def label(self) -> str:
        if not self.executors:
            return f"local[{self.cores}]"
        return (f"standalone, {self.executors} executor{'s' if self.executors > 1 else ''} x {self.cores} "
                f"core{'s' if self.cores > 1 else ''}")


CONFIGS = (Config("local", 0, 2), Config("1x1", 1, 1), Config("2x1", 2, 1), Config("1x2", 1, 2))


def parse_configs(text: str) -> tuple[Config, ...]:
    """``"local,2x1"`` -> those configurations, in the order of :data:`CONFIGS`.

    Raises:
        ValueError: an unknown key.
    """
    keys = {k.strip() for k in text.split(",") if k.strip()}
    unknown = keys - {c.key for c in CONFIGS}
    if unknown:
        raise ValueError(f"unknown Spark configurations {sorted(unknown)}; choose from "
                         f"{', '.join(c.key for c in CONFIGS)}")
    return tuple(c for c in CONFIGS if c.key in keys)


# ---- the driver of a standalone configuration --------------------------------------------------------------------

class DriverProcess:
    """``spark_driver.py`` as a child process, asked over ZeroMQ; the same methods as ``spark_driver.Driver``.

    ``cpus``: pin the driver (and so its JVM and Python workers) to these CPUs; ``conf``: more Spark settings.
    """

    def __init__(self, children: Children, config: Config, master_url: str, sizes: Sizes, work: Path, *,
                 cpus: tuple[int, ...] = (), conf: dict | None = None):
        self.config, self.children = config, children
        self.ready = work / f"driver-{config.key}.json"
        conf = {**LOCAL_CONF, "spark.master": master_url, "spark.app.name": f"sparkbus-bench-{config.key}",
                **({"spark.cores.max": str(config.executors * config.cores),
                    "spark.executor.cores": str(config.cores)} if config.executors else {}),
                "spark.executor.memory": sizes.spark_executor_memory,
                "spark.sql.shuffle.partitions": "4",
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
                "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s", **(conf or {})}
        self.timeout = max(120.0, sizes.timeout * 2)
        self.child = children.add(ChildProcess(
            f"driver-{config.key}",
            [sys.executable, str(HERE / "spark_driver.py"), "--ready", str(self.ready),
             "--executors", str(config.executors), "--slots", str(max(1, config.executors) * config.cores),
             "--timeout", str(self.timeout), *(f"--conf={k}={v}" for k, v in conf.items()),
             *(["--cpus", ",".join(map(str, cpus))] if cpus else [])],
            children.log(f"driver-{config.key}"), env={"SPARK_LOCAL_IP": "127.0.0.1"}, cwd=ROOT))
        self.control = ""

    def wait_ready(self) -> dict:
        """Once the driver's executors are up: ``{"executors": [...], "session_seconds": s}``."""
        wait_for(lambda: self.ready.exists() or self.child.returncode is not None, self.timeout,
                 f"the Spark driver of {self.config.label} and its executors", interval=0.1)
        if self.child.returncode is not None:
            raise BenchError(f"the Spark driver of {self.config.label} exited with {self.child.returncode}:\n"
                             f"{self.child.tail(30)}")
        info = json.loads(self.ready.read_text())
        self.control = info["control"]
        return info

    def request(self, message: dict, timeout: float) -> dict:
        import zmq

        with zmq.Context.instance().socket(zmq.REQ) as sock:     # a fresh REQ: a timed-out one is unusable
            sock.linger = 0
            sock.connect(self.control)
            sock.send(json.dumps(message).encode())
            deadline = time.monotonic() + timeout
            while not sock.poll(500):
                if self.child.returncode is not None:
                    raise BenchError(f"the Spark driver of {self.config.label} exited with "
                                     f"{self.child.returncode} during {message['cmd']}:\n{self.child.tail(30)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"the Spark driver of {self.config.label} did not answer {message['cmd']} "
                                     f"within {timeout:g} s:\n{self.child.tail(30)}")
            reply = json.loads(sock.recv())
        if "error" in reply:
            raise BenchError(f"the Spark driver of {self.config.label} failed in {message['cmd']}:\n{reply['error']}")
        return reply

    def prepare(self, rows: int, partitions: int, feed: str, kind: str = "fixed") -> dict:
        return self.request({"cmd": "prepare", "rows": rows, "partitions": partitions, "feed": feed, "kind": kind},
                            self.timeout)

    def limit(self) -> dict:
        return self.request({"cmd": "limit"}, self.timeout)

    def feed(self, feed: str, stream: str, batch_size: int, timeout: float, options: dict | None = None) -> dict:
        return self.request({"cmd": "feed", "feed": feed, "stream": stream, "batch_size": batch_size,
                             "timeout": timeout, "options": options or {}}, timeout + 30)

    def where(self) -> dict:
        return self.request({"cmd": "where"}, 60)

    def stop(self, polite: bool = True) -> None:
        """Ask the driver to stop its session (its executors end with the application) and wait for it to exit,
        if ``polite``; then stop the process and all it started, whatever is left (a busy driver cannot answer)."""
        try:
            if polite and self.control and self.child.returncode is None:
                self.request({"cmd": "stop"}, 30)
                self.child.wait(30)
        except (BenchError, LaunchError):
            pass                   # stopped below all the same
        finally:
            self.children.discard(self.child)


# ---- the figure ------------------------------------------------------------------------------------------------

def run(children: Children, spark: Any, session_seconds: float | None, sizes: Sizes, work: Path,
        configs: tuple[Config, ...] = CONFIGS, partitions: tuple[int, ...] = PARTITIONS, log=print,
        out: dict | None = None) -> dict:
    """Every (configuration, partitions) point; fills and returns ``out``:

    ``{"rows", "partitions", "configs": {key: {"label", "executors", "session_seconds"}},
    "points": {(key, P): Series}, "storage": {(key, P): how the cached DataFrame is stored}}``
    (filled as it goes, so that a failure part-way still leaves the points measured before it).
    """
    import spark_driver

    out = {} if out is None else out
    out.update(rows=sizes.spark_rows, partitions=list(partitions), configs={}, points={}, storage={})
    broker = children.broker(MAX_BUFFER)
    cluster = None
    try:
        for config in configs:
            if config.executors:
                continue
            out["configs"][config.key] = {"label": config.label, "executors": [], "session_seconds": session_seconds}
            source = spark_driver.Driver(spark)
            try:
                _points(children, broker, config, source, partitions, sizes, work, out, log)
            finally:
                source.close()
        standalone = [c for c in configs if c.executors]
        if standalone:
            cluster = children.add(StandaloneCluster(work / "cluster", HOSTS, cores=WORKER_CORES,
                                                     memory=WORKER_MEMORY, java_opts=QUICK_START_JAVA_OPTS))
            started = time.monotonic()
            cluster.start(timeout=120, wait=False)
            log(f"  standalone cluster: Master at {cluster.master_url}, Workers on {', '.join(HOSTS)} "
                f"({WORKER_CORES} cores each) starting")
        for i, config in enumerate(standalone):
            driver = DriverProcess(children, config, cluster.master_url, sizes, work)
            try:
                if i == 0:            # the first driver starts while the Workers register
                    cluster.wait_ready(120)
                    log(f"  standalone cluster up after {time.monotonic() - started:.1f} s")
                info = driver.wait_ready()
                out["configs"][config.key] = {"label": config.label, "executors": info["executors"],
                                              "session_seconds": info["session_seconds"]}
                log(f"  {config.label}: driver and executors up after {info['session_seconds']:.1f} s; executors "
                    + ", ".join(f"{e['executor']} on {e['host']} ({e['slots']} slot{'s' if e['slots'] > 1 else ''})"
                                for e in info["executors"]))
                _points(children, broker, config, driver, partitions, sizes, work, out, log)
            except BaseException:
                driver.stop(polite=False)
                raise
            driver.stop()
    finally:
        if cluster is not None:
            children.discard(cluster)
        children.discard(broker)
    best = best_points(out)
    if best:
        log(f"  best rows/s: {point_name(out, best['rows_per_s'])}; best time to first batch: "
            f"{point_name(out, best['first'])}")
    return out


def _points(children: Children, broker, config: Config, source: Any, partitions: tuple[int, ...], sizes: Sizes,
            work: Path, out: dict, log) -> None:
    for parts in partitions:
        started = time.monotonic()
        info = source.prepare(rows=sizes.spark_rows, partitions=parts, feed=broker.feed)
        log(f"  {config.label}, {parts} partitions: cached and warmed up in {time.monotonic() - started:.1f} s")
        out["storage"][config.key, parts] = info
        series = out["points"][config.key, parts] = Series(f"{config.label}, {parts} partitions")
        for rep in range(sizes.reps):
            limit = source.limit()
            stream = f"config-{config.key}-{parts}-{next(_streams)}"

            def start():
                fed = source.feed(feed=broker.feed, stream=stream, batch_size=BATCH_SIZE,
                                  timeout=min(sizes.timeout, 120.0))
                return fed["t0"], fed["t_fed"], fed["report"]

            run = end_to_end.run_fed_ranks(children, [broker], stream, start, info["rows"], RANKS, work,
                                           sizes.timeout)
            run["limit_rows_per_s"] = limit["rows"] / limit["seconds"]
            series.runs.append(run)
            log(f"  {config.label}, {parts} partitions, rep {rep + 1}/{sizes.reps}: {run['rows_per_s']:,.0f} rows/s "
                f"to the ranks, first batch {run['first']:.2f} s, last {run['last']:.2f} s; Spark alone "
                f"(mapInArrow) {run['limit_rows_per_s']:,.0f} rows/s")


def best_points(out: dict) -> dict:
    """The points with the most rows/s and with the earliest first batch (medians)."""
    points = {k: s for k, s in out.get("points", {}).items() if s.runs}
    if not points:
        return {}
    return {"rows_per_s": max(points, key=lambda k: points[k].med("rows_per_s")),
            "first": min(points, key=lambda k: points[k].med("first"))}


def point_name(out: dict, point: tuple[str, int]) -> str:
    """E.g. ``standalone, 2 executors x 1 core, 4 partitions``."""
    return f"{out['configs'][point[0]]['label']}, {point[1]} partitions"


__all__ = ["run", "Config", "CONFIGS", "PARTITIONS", "parse_configs", "best_points", "point_name"]
