"""Figure 2b, end to end shaped like a cluster: a Spark driver of its own (``spark_driver.py``, ``local[1]``) pinned
to one CPU, with its JVM and the Python workers where the feeder runs; the broker and 2 ranks under ``taskset`` on
the other. Per data kind (``fixed``, ``tokens``) and batch size (1 MiB, 64 KiB), alternating: Spark's hand-off on
that core (``mapInArrow`` + drop) and a sparkbus epoch; the feeder's CPU-s per GB above the hand-off's."""

from __future__ import annotations

import itertools
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from sparkbus.bench.figures import Figure, figure
from sparkbus.bench.hop import label as size_label

from . import spark_data
from .common import ROOT, BenchError, DriverProcess, KiB, MiB, on_cpus
from .end_to_end import RANKS, CpuMeter, Series, run_fed_ranks
from .sections import Context, Run, Section

BATCH_BYTES = (MiB, 64 * KiB)
KINDS = ("fixed", "tokens")
PARTITIONS = 4
_streams = itertools.count()


@dataclass
class Cluster:
    """Figure 2b, filled as it goes (a failure keeps what was measured)."""

    payload: dict[str, int] = field(default_factory=dict)      # kind -> its payload bytes
    points: dict[tuple[str, int], dict[str, Series]] = field(default_factory=dict)   # (kind, batch bytes) -> ways


def run(ctx: Context, out: Cluster) -> Cluster:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise BenchError(f"the cluster-shaped runs need 2 CPUs, this process may use {mine}")
    sizes, bus = ctx.sizes, on_cpus(mine[1:2])
    broker = ctx.children.broker("256MiB", prefix=bus)
    driver = DriverProcess(ctx.children, ctx.work / "driver-cluster", "driver-cluster",
                           {"spark.master": "local[1]", "spark.driver.memory": sizes.driver_memory}, slots=1,
                           cpus=mine[:1], timeout=max(120.0, sizes.timeout * 2))
    try:
        info = driver.ready()
        where = info["executors"][0]            # local[1]: the one executor, the driver
        ctx.log(f"  Spark local[1] pinned to CPU {mine[0]} up after {info['session_seconds']:.1f} s; its Python "
                f"workers import sparkbus from {Path(where['feeder']).parent} and run on CPUs {where['affinity']}; "
                f"broker and ranks on CPU {mine[1]}")
        if Path(where["feeder"]).resolve() != (ROOT / "feeder").resolve():
            raise BenchError(f"Spark's Python workers import the feeder from {where['feeder']}, not from {ROOT}: "
                             "set PYTHONPATH to the tree being measured")
        if where["affinity"] != mine[:1]:
            raise BenchError(f"Spark's Python workers run on CPUs {where['affinity']}, not {mine[:1]}")
        for kind in KINDS:
            stored = driver.prepare(rows=sizes.cluster_rows, partitions=PARTITIONS, feed=broker.feed, kind=kind)
            out.payload[kind] = stored["payload_bytes"]
            ctx.log(f"  {kind} ({spark_data.KINDS[kind]}): {stored['rows']:,} rows, "
                    f"{stored['payload_bytes'] / 1e6:,.0f} MB cached and warmed up")
            for rep in range(sizes.cluster_reps):
                for i, size in enumerate(BATCH_BYTES if rep % 2 == 0 else BATCH_BYTES[::-1]):
                    point = out.points.setdefault((kind, size), {way: Series(way) for way in ("limit", "sparkbus")})
                    for way in ("limit", "sparkbus") if (rep + i) % 2 == 0 else ("sparkbus", "limit"):
                        point[way].runs.append(_limit(driver) if way == "limit" else
                                               _sparkbus(ctx, broker, driver, stored, size, bus))
                    lim, s = point["limit"].runs[-1], point["sparkbus"].runs[-1]
                    ctx.log(f"  cluster-shaped {kind}, {size // KiB:,} KiB batches, rep {rep + 1}/"
                            f"{sizes.cluster_reps}: limit {lim['rows_per_s']:,.0f} rows/s, sparkbus "
                            f"{s['rows_per_s']:,.0f} rows/s; Python workers {lim['cpu']['workers']:.2f} vs "
                            f"{s['cpu']['workers']:.2f} CPU-s")
    except BaseException:
        driver.stop(polite=False)
        raise
    finally:
        ctx.children.discard(broker)
    driver.stop()
    return out


def _limit(driver: DriverProcess) -> dict:
    meter = CpuMeter(spark_root=driver.child.pid)
    limit = driver.limit()
    return {"rows_per_s": limit["rows"] / limit["seconds"], "cpu": meter.stop()}


def _sparkbus(ctx: Context, broker, driver: DriverProcess, stored: dict, size: int, bus: list[str]) -> dict:
    stream = f"cluster-{next(_streams)}"
    batch_size = max(1, int(size // (stored["payload_bytes"] / stored["rows"])))     # batches of ~size bytes

    def start() -> tuple:
        return driver.feed(feed=broker.feed, stream=stream, batch_size=batch_size,
                           timeout=min(ctx.sizes.timeout, 120.0), options={"max_batch_bytes": size})

    result = run_fed_ranks(ctx.children, [broker], stream, start, stored["rows"], RANKS, ctx.work, ctx.sizes.timeout,
                           prefix=bus, meter=CpuMeter([broker], spark_root=driver.child.pid))
    expected = str((ROOT / "worker").resolve())
    if any(str(Path(m).resolve()) != expected for m in result["rank_modules"]):
        raise BenchError(f"the ranks imported sparkbus's worker from {result['rank_modules']}, not {expected}")
    return result


class ClusterSection(Section[Cluster]):
    """Figure 2b: Spark pinned to one core, the broker and the ranks to the other."""

    name = "cluster"
    title = "2b. end to end, cluster-shaped (Spark on one core, the broker and the ranks on the other)"

    def measure(self, ctx: Context) -> Cluster:
        return run(ctx, ctx.results.setdefault(self.name, Cluster()))

    def figures(self, run: Run, result: Cluster) -> list[Figure]:
        """Per kind and batch size: rows/s against the Arrow hand-off on the same core, and the feeder's CPU-s per
        GB in Spark's Python workers above the hand-off's (medians)."""
        out = []
        for (kind, size), point in result.points.items():
            if point["limit"].runs and point["sparkbus"].runs:
                what = f"{kind}, {size_label(size)} batches"
                limit = point["limit"].figure("cluster", f"hand-off {what}", "rows_per_s", "rows/s")
                workers = {way: statistics.median(r["cpu"]["workers"] for r in s.runs) for way, s in point.items()}
                per_gb = (workers["sparkbus"] - workers["limit"]) / (result.payload[kind] / 1e9)
                out += [limit, point["sparkbus"].figure("cluster", f"sparkbus {what}", "rows_per_s", "rows/s", limit),
                        figure("cluster", f"feeder CPU-s per GB above the hand-off, {what}", [per_gb], "CPU-s/GB")]
        return out
