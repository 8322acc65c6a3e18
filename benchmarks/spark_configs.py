"""Figure 6, Spark set-ups as data suppliers (as IPSJ 2016-HPC-156 evaluates Spark): the same cached data fed
through one broker to 2 ranks by ``local[2]`` and by a standalone cluster (``launch.cluster``) with 1x1, 2x1 and
1x2 executors x cores, each driven by a driver process of its own (``spark_driver.py``), in 4 and 16 partitions;
per point Spark's own hand-off in that set-up beside it. benchmarks/README.md, section 6, says more."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.cluster import QUICK_START_JAVA_OPTS, StandaloneCluster

from . import end_to_end
from .common import Children, DriverProcess, Sizes
from .end_to_end import BATCH_SIZE, RANKS, Series
from .sections import Context, Run, Section

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


CONFIGS = (Config("local", 0, 2), Config("1x1", 1, 1), Config("2x1", 2, 1), Config("1x2", 1, 2))


def parse_configs(text: str) -> tuple[Config, ...]:
    """``"local,2x1"`` -> those configurations, in the order of :data:`CONFIGS`; ValueError for an unknown key."""
    keys = {k.strip() for k in text.split(",") if k.strip()}
    unknown = keys - {c.key for c in CONFIGS}
    if unknown:
        raise ValueError(f"unknown Spark configurations {sorted(unknown)}; choose from "
                         f"{', '.join(c.key for c in CONFIGS)}")
    return tuple(c for c in CONFIGS if c.key in keys)


# ---- the figure ------------------------------------------------------------------------------------------------

@dataclass
class SparkSetups:
    """Figure 6, filled as it goes (a failure keeps what was measured)."""

    session_seconds: dict[str, float] = field(default_factory=dict)    # key -> from its start to its executors up
    points: dict[tuple[str, int], Series] = field(default_factory=dict)     # (config key, partitions)
    storage: dict[tuple[str, int], dict] = field(default_factory=dict)      # how its cached DataFrame is stored

def run(children: Children, spark: Any, session_seconds: float | None, sizes: Sizes, work: Path,
        configs: tuple[Config, ...] = CONFIGS, partitions: tuple[int, ...] = PARTITIONS, log=print,
        out: SparkSetups | None = None) -> SparkSetups:
    """Every (configuration, partitions) point, filled into ``out`` as it goes (a new record if None), so that a
    failure part-way still leaves the points measured before it."""
    from . import spark_driver

    out = SparkSetups() if out is None else out
    broker = children.broker(MAX_BUFFER)
    cluster = None
    try:
        for config in configs:
            if config.executors:
                continue
            if session_seconds is not None:
                out.session_seconds[config.key] = session_seconds
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
            assert cluster is not None
            driver = DriverProcess(children, work / f"driver-{config.key}", f"driver-{config.key}", {
                "spark.master": cluster.master_url, "spark.app.name": f"sparkbus-bench-{config.key}",
                "spark.cores.max": str(config.executors * config.cores), "spark.executor.cores": str(config.cores),
                "spark.executor.memory": sizes.spark_executor_memory,
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
                "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s"}, executors=config.executors,
                slots=config.executors * config.cores, env={"SPARK_LOCAL_IP": HOSTS[0]},
                timeout=max(120.0, sizes.timeout * 2))
            try:
                if i == 0:            # the first driver starts while the Workers register
                    cluster.wait_ready(120)
                    log(f"  standalone cluster up after {time.monotonic() - started:.1f} s")
                info = driver.ready()
                out.session_seconds[config.key] = info["session_seconds"]
                log(f"  {config.key}: driver and executors up after {info['session_seconds']:.1f} s; executors "
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
    return out


def _points(children: Children, broker, config: Config, source: Any, partitions: tuple[int, ...], sizes: Sizes,
            work: Path, out: SparkSetups, log) -> None:
    for parts in partitions:
        started = time.monotonic()
        info = source.prepare(rows=sizes.spark_rows, partitions=parts, feed=broker.feed)
        log(f"  {config.key}, {parts} partitions: cached and warmed up in {time.monotonic() - started:.1f} s")
        out.storage[config.key, parts] = info
        series = out.points[config.key, parts] = Series(f"{config.key}, {parts} partitions")
        for rep in range(sizes.reps):
            limit = source.limit()
            stream = f"config-{config.key}-{parts}-{next(_streams)}"

            def start(stream: str = stream) -> tuple:
                fed = source.feed(feed=broker.feed, stream=stream, batch_size=BATCH_SIZE,
                                  timeout=min(sizes.timeout, 120.0))
                return fed["t0"], fed["t_fed"], fed["report"]

            run = end_to_end.run_fed_ranks(children, [broker], stream, start, info["rows"], RANKS, work,
                                           sizes.timeout)
            run["limit_rows_per_s"] = limit["rows"] / limit["seconds"]
            series.runs.append(run)
            log(f"  {config.key}, {parts} partitions, rep {rep + 1}/{sizes.reps}: {run['rows_per_s']:,.0f} rows/s "
                f"to the ranks, first batch {run['first']:.2f} s, last {run['last']:.2f} s; Spark alone "
                f"(mapInArrow) {run['limit_rows_per_s']:,.0f} rows/s")


# ---- the section ------------------------------------------------------------------------------------------

class SparkSection(Section[SparkSetups]):
    """Figure 6: Spark set-ups as data suppliers (no target: it compares set-ups)."""

    name, title, figure = "spark", "6. Spark configurations", "6"

    def needs(self, args) -> str:
        """The benchmark's session only for ``local``: a standalone set-up has a driver process of its own."""
        return "session" if any(not c.executors for c in parse_configs(args.spark_configs)) else ""

    def measure(self, ctx: Context) -> SparkSetups:
        partitions = ctx.args.spark_partitions
        out = ctx.results[self.name] = SparkSetups()
        run(ctx.children, ctx.spark, ctx.session_seconds, ctx.sizes, ctx.work,
            parse_configs(ctx.args.spark_configs), partitions, ctx.log, out=out)
        spilled = [f"{key} at {parts} partitions" for (key, parts), stored in out.storage.items()
                   if stored.get("cached_disk_bytes")]
        if spilled:
            ctx.notes.append(f"Spark set-ups whose cached data spilled to disk: {', '.join(spilled)} "
                             "(raise the executors' memory)")
        return out

    def figures(self, run: Run, result: SparkSetups) -> list[Figure]:
        """Per set-up and partitions: rows/s to the ranks against Spark alone in the same set-up; the first batch;
        per set-up, its session's start (to its executors up)."""
        out = [figure("spark", f"session start, {key}", [seconds], "s")
               for key, seconds in result.session_seconds.items()]
        for (key, parts), s in result.points.items():
            if s.runs:
                what = f"{key}, {parts} partitions"
                alone = s.figure("spark", f"Spark alone, {what}", "limit_rows_per_s", "rows/s")
                out += [alone, s.figure("spark", f"to the ranks, {what}", "rows_per_s", "rows/s", alone),
                        s.figure("spark", f"first batch, {what}", "first", "s")]
        return out
