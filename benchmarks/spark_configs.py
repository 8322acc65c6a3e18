"""Figure 6, Spark set-ups as data suppliers (as IPSJ 2016-HPC-156 evaluates Spark): the same cached data fed
through one broker to 2 ranks by ``local[2]`` and by a standalone cluster (``launch.cluster``) with 1x1, 2x1 and
1x2 executors x cores, each driven by a driver process of its own (``spark_driver.py``), in 4 and 16 partitions;
per point Spark's own hand-off in that set-up beside it. benchmarks/README.md, section 6, says more."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.cluster import QUICK_START_JAVA_OPTS, StandaloneCluster

from .common import DriverProcess
from .end_to_end import BATCH_SIZE, RANKS, Series, run_fed_ranks
from .sections import Context, Run, Section

HOSTS = ("127.0.0.1", "127.0.0.2")        # two Workers on two loopback "hosts"
WORKER_CORES, WORKER_MEMORY = 2, "2g"
# key -> (executors, cores): local mode (no executors) or a standalone cluster's executors
CONFIGS = {"local": (0, 2), "1x1": (1, 1), "2x1": (2, 1), "1x2": (1, 2)}
_streams = itertools.count()


def parse_configs(text: str) -> list[str]:
    """``"local,2x1"`` -> those keys, in the order of :data:`CONFIGS`; ValueError for an unknown key."""
    keys = {k.strip() for k in text.split(",") if k.strip()}
    if keys - set(CONFIGS):
        raise ValueError(f"unknown Spark configurations {sorted(keys - set(CONFIGS))}; choose from "
                         f"{', '.join(CONFIGS)}")
    return [key for key in CONFIGS if key in keys]


@dataclass
class SparkSetups:
    """Figure 6, filled as it goes (a failure keeps what was measured)."""

    session_seconds: dict[str, float] = field(default_factory=dict)    # key -> from its start to its executors up
    points: dict[tuple[str, int], Series] = field(default_factory=dict)     # (config key, partitions)
    spilled: list[str] = field(default_factory=list)        # points whose cached data spilled to disk


def run(ctx: Context, keys: list[str], partitions: tuple[int, ...], out: SparkSetups) -> SparkSetups:
    """Every (set-up, partitions) point, filled into ``out`` as it goes."""
    from . import spark_driver

    children, sizes = ctx.children, ctx.sizes
    broker = children.broker("256MiB")
    cluster = None
    try:
        if "local" in keys:
            if ctx.session_seconds is not None:
                out.session_seconds["local"] = ctx.session_seconds
            source = spark_driver.Driver(ctx.spark)
            try:
                _points(ctx, broker, "local", source, partitions, out)
            finally:
                source.close()
        standalone = [key for key in keys if key != "local"]
        if standalone:
            cluster = children.add(StandaloneCluster(ctx.work / "cluster", HOSTS, cores=WORKER_CORES,
                                                     memory=WORKER_MEMORY, java_opts=QUICK_START_JAVA_OPTS))
            started = time.monotonic()
            cluster.start(timeout=120, wait=False)
            ctx.log(f"  standalone cluster: Master at {cluster.master_url}, Workers on {', '.join(HOSTS)} starting")
        for i, key in enumerate(standalone):
            assert cluster is not None
            executors, cores = CONFIGS[key]
            driver = DriverProcess(children, ctx.work / f"driver-{key}", f"driver-{key}", {
                "spark.master": cluster.master_url, "spark.app.name": f"sparkbus-bench-{key}",
                "spark.cores.max": str(executors * cores), "spark.executor.cores": str(cores),
                "spark.executor.memory": sizes.spark_executor_memory,
                "spark.scheduler.minRegisteredResourcesRatio": "1.0",
                "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s"}, executors=executors,
                slots=executors * cores, env={"SPARK_LOCAL_IP": HOSTS[0]}, timeout=max(120.0, sizes.timeout * 2))
            try:
                if i == 0:            # the first driver starts while the Workers register
                    cluster.wait_ready(120)
                    ctx.log(f"  standalone cluster up after {time.monotonic() - started:.1f} s")
                info = driver.ready()
                out.session_seconds[key] = info["session_seconds"]
                ctx.log(f"  {key}: driver and executors up after {info['session_seconds']:.1f} s; executors "
                        + ", ".join(f"{e['executor']} on {e['host']} ({e['slots']} slots)" for e in info["executors"]))
                _points(ctx, broker, key, driver, partitions, out)
            except BaseException:
                driver.stop(polite=False)
                raise
            driver.stop()
    finally:
        if cluster is not None:
            children.discard(cluster)
        children.discard(broker)
    return out


def _points(ctx: Context, broker, key: str, source: Any, partitions: tuple[int, ...], out: SparkSetups) -> None:
    sizes = ctx.sizes
    for parts in partitions:
        started = time.monotonic()
        info = source.prepare(rows=sizes.spark_rows, partitions=parts, feed=broker.feed)
        ctx.log(f"  {key}, {parts} partitions: cached and warmed up in {time.monotonic() - started:.1f} s")
        if info.get("cached_disk_bytes"):
            out.spilled.append(f"{key} at {parts} partitions")
        series = out.points[key, parts] = Series(f"{key}, {parts} partitions")
        for rep in range(sizes.reps):
            limit = source.limit()
            stream = f"config-{key}-{parts}-{next(_streams)}"

            def start(stream: str = stream) -> tuple:
                return source.feed(feed=broker.feed, stream=stream, batch_size=BATCH_SIZE,
                                   timeout=min(sizes.timeout, 120.0))

            run = run_fed_ranks(ctx.children, [broker], stream, start, info["rows"], RANKS, ctx.work, sizes.timeout)
            run["limit_rows_per_s"] = limit["rows"] / limit["seconds"]
            series.runs.append(run)
            ctx.log(f"  {key}, {parts} partitions, rep {rep + 1}/{sizes.reps}: {run['rows_per_s']:,.0f} rows/s to "
                    f"the ranks, first batch {run['first']:.2f} s, last {run['last']:.2f} s; Spark alone "
                    f"(mapInArrow) {run['limit_rows_per_s']:,.0f} rows/s")


class SparkSection(Section[SparkSetups]):
    """Figure 6: Spark set-ups as data suppliers (no target: it compares set-ups)."""

    name, title = "spark", "6. Spark configurations"

    def needs(self, args) -> str:
        """The benchmark's session only for ``local``: a standalone set-up has a driver process of its own."""
        return "session" if "local" in parse_configs(args.spark_configs) else ""

    def measure(self, ctx: Context) -> SparkSetups:
        out = ctx.results.setdefault(self.name, SparkSetups())
        run(ctx, parse_configs(ctx.args.spark_configs), ctx.args.spark_partitions, out)
        if out.spilled:
            ctx.notes.append(f"Spark set-ups whose cached data spilled to disk: {', '.join(out.spilled)} "
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
