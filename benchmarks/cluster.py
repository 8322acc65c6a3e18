"""Figure 2b, end to end shaped like a cluster: a Spark driver of its own (``spark_driver.py``, ``local[1]``) pinned
to one CPU, with its JVM and the Python workers where the feeder runs; the broker and 2 ranks under ``taskset`` on
the other. Per data kind (``fixed``, ``tokens``) and batch size (1 MiB, 64 KiB), alternating: Spark's hand-off on
that core (``mapInArrow`` + drop) and a sparkbus epoch; the CPU of each process group; the feeder's CPU-s per GB
above the hand-off's. A kind the feeder refuses is reported as not measured, in its words."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

from sparkbus.bench.figures import Figure, figure
from sparkbus.bench.hop import label as size_label

from . import end_to_end, spark_data
from .common import ROOT, BenchError, Children, DriverProcess, KiB, MiB, Sizes, median, on_cpus
from .end_to_end import RANKS, CpuMeter, Series
from .sections import Context, Run, Section

BATCH_BYTES = (MiB, 64 * KiB)
KINDS = ("fixed", "tokens")
PARTITIONS = 4
MAX_BUFFER = "256MiB"
_streams = itertools.count()


def cpus() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Spark's CPUs, the broker's and the ranks' CPUs): the first two this process may use.

    Raises:
        BenchError: fewer than 2 CPUs.
    """
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise BenchError(f"the cluster-shaped runs need 2 CPUs, this process may use {mine}")
    return (mine[0],), (mine[1],)


@dataclass
class ClusterPoint:
    """The repetitions of one (kind, batch size): the Arrow hand-off and sparkbus, on the same core."""

    limit: Series
    sparkbus: Series


@dataclass
class Cluster:
    """Figure 2b, filled as it goes (a failure keeps what was measured)."""

    kinds: dict[str, dict] = field(default_factory=dict)  # kind -> how the driver stored it
    points: dict[tuple[str, int], ClusterPoint] = field(default_factory=dict)   # (kind, batch bytes)


def run(children: Children, sizes: Sizes, work: Path, kinds: tuple[str, ...] = KINDS, log=print,
        out: Cluster | None = None) -> Cluster:
    """Every (kind, batch size) point, filled into ``out`` as it goes (a new record if None)."""
    spark_cpus, bus_cpus = cpus()
    out = Cluster() if out is None else out
    bus = on_cpus(bus_cpus)
    broker = children.broker(MAX_BUFFER, prefix=bus)
    driver = DriverProcess(children, work / "driver-cluster", "driver-cluster",
                           {"spark.master": "local[1]", "spark.driver.memory": sizes.driver_memory}, slots=1,
                           cpus=spark_cpus, timeout=max(120.0, sizes.timeout * 2))
    try:
        info = driver.ready()
        where = driver.where()
        log(f"  Spark local[1] pinned to CPU {spark_cpus[0]} up after {info['session_seconds']:.1f} s; its Python "
            f"workers import sparkbus from {Path(where['feeder']).parent} and run on CPUs {where['affinity']}; "
            f"broker and ranks on CPU {bus_cpus[0]}")
        if Path(where["feeder"]).resolve() != (ROOT / "feeder").resolve():
            raise BenchError(f"Spark's Python workers import the feeder from {where['feeder']}, not from {ROOT}: "
                             "set PYTHONPATH to the tree being measured")
        if where["affinity"] != list(spark_cpus):
            raise BenchError(f"Spark's Python workers run on CPUs {where['affinity']}, not {list(spark_cpus)}")
        for kind in kinds:
            stored = driver.prepare(rows=sizes.cluster_rows, partitions=PARTITIONS, feed=broker.feed, kind=kind)
            out.kinds[kind] = stored
            row_bytes = stored["payload_bytes"] / stored["rows"]
            log(f"  {kind} ({spark_data.KINDS[kind]}): {stored['rows']:,} rows, {stored['payload_bytes'] / 1e6:,.0f} "
                f"MB cached and warmed up")
            points = {size: out.points.setdefault((kind, size), ClusterPoint(Series(f"{kind} limit"),
                                                                             Series(f"{kind} sparkbus")))
                      for size in BATCH_BYTES}
            for rep in range(sizes.cluster_reps):
                for i, size in enumerate(BATCH_BYTES if rep % 2 == 0 else BATCH_BYTES[::-1]):
                    order = ("limit", "sparkbus") if (rep + i) % 2 == 0 else ("sparkbus", "limit")
                    for way in order:
                        if way == "limit":
                            run_ = _limit(driver)
                        else:
                            run_ = _sparkbus(children, broker, driver, stored, size, row_bytes, bus, work, sizes)
                        getattr(points[size], way).runs.append(run_)
                    lim, s = points[size].limit.runs[-1], points[size].sparkbus.runs[-1]
                    log(f"  cluster-shaped {kind}, {size // KiB:,} KiB batches, rep {rep + 1}/{sizes.cluster_reps}: "
                        f"limit {lim['rows_per_s']:,.0f} rows/s, sparkbus {s['rows_per_s']:,.0f} rows/s "
                        f"({s['rows_per_s'] / lim['rows_per_s']:.2f} x); Python workers {lim['cpu']['workers']:.2f} "
                        f"vs {s['cpu']['workers']:.2f} CPU-s")
    except BaseException:
        driver.stop(polite=False)
        raise
    finally:
        children.discard(broker)
    driver.stop()
    return out


def _limit(driver: DriverProcess) -> dict:
    meter = CpuMeter(spark_root=driver.child.pid)
    limit = driver.limit()
    return {"first": None, "last": limit["seconds"], "rows": limit["rows"],
            "rows_per_s": limit["rows"] / limit["seconds"], "cpu": meter.stop()}


def _sparkbus(children: Children, broker, driver: DriverProcess, stored: dict, size: int, row_bytes: float,
              bus: list[str], work: Path, sizes: Sizes) -> dict:
    stream = f"cluster-{next(_streams)}"
    batch_size, options = max(1, int(size // row_bytes)), {"max_batch_bytes": size}     # batches of ~size bytes

    def start():
        fed = driver.feed(feed=broker.feed, stream=stream, batch_size=batch_size, timeout=min(sizes.timeout, 120.0),
                          options=options)
        return fed["t0"], fed["t_fed"], fed["report"]

    meter = CpuMeter([broker], spark_root=driver.child.pid)
    result = end_to_end.run_fed_ranks(children, [broker], stream, start, stored["rows"], RANKS, work, sizes.timeout,
                                      prefix=bus)
    result["cpu"] = {**meter.stop(), "ranks": result["ranks_cpu"]}
    result["batch_size"] = batch_size
    expected = str((ROOT / "worker").resolve())
    if any(str(Path(m).resolve()) != expected for m in result["rank_modules"]):
        raise BenchError(f"the ranks imported sparkbus's worker from {result['rank_modules']}, not {expected}")
    return result


def feeder_cpu_per_gb(point: ClusterPoint, payload_bytes: int) -> float:
    """CPU seconds per GB of payload in Spark's Python workers above the hand-off's (medians)."""
    def workers(series: Series) -> float:
        return median([r["cpu"]["workers"] for r in series.runs])

    return (workers(point.sparkbus) - workers(point.limit)) / (payload_bytes / 1e9)


class ClusterSection(Section[Cluster]):
    """Figure 2b: Spark pinned to one core, the broker and the ranks to the other."""

    name, figure = "cluster", "2b"
    title = "2b. end to end, cluster-shaped (Spark on one core, the broker and the ranks on the other)"

    def measure(self, ctx: Context) -> Cluster:
        out = ctx.results[self.name] = Cluster()
        return run(ctx.children, ctx.sizes, ctx.work, log=ctx.log, out=out)

    def figures(self, run: Run, result: Cluster) -> list[Figure]:
        """Per kind and batch size: rows/s against the Arrow hand-off on the same core, and the feeder's CPU-s per
        GB in Spark's Python workers above the hand-off's."""
        out = []
        for (kind, size), point in result.points.items():
            if point.limit.runs and point.sparkbus.runs:
                what = f"{kind}, {size_label(size)} batches"
                limit = point.limit.figure("cluster", f"hand-off {what}", "rows_per_s", "rows/s")
                per_gb = feeder_cpu_per_gb(point, result.kinds[kind]["payload_bytes"])
                out += [limit, point.sparkbus.figure("cluster", f"sparkbus {what}", "rows_per_s", "rows/s", limit),
                        figure("cluster", f"feeder CPU-s per GB above the hand-off, {what}", [per_gb], "CPU-s/GB")]
        return out
