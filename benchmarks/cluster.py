"""Figure 2b, end to end shaped like a cluster: Spark on one core, the broker and the ranks on the other.

On a cluster the broker and the ranks have hosts of their own, and only the feeder's work (in Spark's Python
workers) competes with Spark for the executors' cores. On one 2-core machine that is simulated by pinning:

* a Spark driver process of its own (``spark_driver.py --cpus 0``, ``local[1]``) calls ``os.sched_setaffinity``
  before its session starts, so its JVM and the JVM's Python workers, where the feeder runs, stay on CPU 0;
* the broker and ``mpiexec -n 2 rank_consumer.py`` (hydra and both ranks) run under ``taskset -c 1``.

Per data kind (``fixed``: the ``id`` + float32[64] rows of figure 2; ``tokens``: ``id`` + int arrays of 1..127
elements, as many bytes a row on average), cached in that driver, and per batch size (1 MiB and 64 KiB of payload:
``batch_size`` = size / mean row bytes, ``max_batch_bytes`` = size), each repetition measures the Arrow hand-off
limit (``mapInArrow`` + drop, on the same one core) and one epoch fed by ``feeder.feed`` to the 2 ranks, in an
order that alternates from one repetition to the next. Figures: rows/s of each (all rows / time from the call to
the last batch at any rank), the ratio of their medians, and the CPU seconds of each process group; from these,
the feeder's CPU seconds per GB in Spark's Python workers above what the hand-off alone costs them.

A kind the feeder refuses (variable-length arrays before protocol v4) is reported as not measured, with the
feeder's own words. The driver checks once, from inside a task, which sparkbus Spark's Python workers import and
where they run; the ranks report theirs with their figures.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import end_to_end, spark_data
from .common import ROOT, BenchError, Children, KiB, MiB, Sizes, median, on_cpus
from .end_to_end import RANKS, CpuMeter, Series
from .hop import size_label
from .report import num, table
from .sections import Context, Run, Section, Target, at_least, at_most
from .spark_configs import Config, DriverProcess

BATCH_BYTES = (MiB, 64 * KiB)
KINDS = ("fixed", "tokens")
PARTITIONS = 4
MAX_BUFFER = "256MiB"
CONFIG = Config("cluster", 0, 1)        # local[1]: one task slot, as one executor core on a cluster
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


def batch_options(size: int, row_bytes: float) -> tuple[int, dict]:
    """``(batch_size, feed options)`` for batches of about ``size`` bytes of rows of ``row_bytes`` on average."""
    return max(1, int(size // row_bytes)), {"max_batch_bytes": size}


@dataclass
class ClusterPoint:
    """The repetitions of one (kind, batch size): the Arrow hand-off and sparkbus, on the same core."""

    limit: Series
    sparkbus: Series


@dataclass
class Cluster:
    """Figure 2b, filled as it goes (a failure keeps what was measured)."""

    rows: int
    reps: int
    cpus: dict[str, list[int]]                          # "spark", "bus": the CPUs of each side
    where: dict[str, Any] = field(default_factory=dict)  # where Spark's Python workers run and import sparkbus from
    kinds: dict[str, dict] = field(default_factory=dict)  # kind -> how the driver stored it
    refused: dict[str, str] = field(default_factory=dict)  # kind -> why the feeder refused it
    points: dict[tuple[str, int], ClusterPoint] = field(default_factory=dict)   # (kind, batch bytes)


def run(children: Children, sizes: Sizes, work: Path, kinds: tuple[str, ...] = KINDS, log=print,
        out: Cluster | None = None) -> Cluster:
    """Every (kind, batch size) point, filled into ``out`` as it goes (a new record if None)."""
    spark_cpus, bus_cpus = cpus()
    if out is None:
        out = Cluster(sizes.cluster_rows, sizes.cluster_reps, {"spark": list(spark_cpus), "bus": list(bus_cpus)})
    bus = on_cpus(bus_cpus)
    broker = children.broker(MAX_BUFFER, prefix=bus)
    driver = DriverProcess(children, CONFIG, "local[1]", sizes, work, cpus=spark_cpus,
                           conf={"spark.driver.memory": sizes.driver_memory})
    try:
        info = driver.wait_ready()
        where = out.where = {**driver.where(), "session_seconds": info["session_seconds"]}
        log(f"  Spark local[1] pinned to CPU {spark_cpus[0]} up after {info['session_seconds']:.1f} s; its Python "
            f"workers import sparkbus from {Path(where['feeder']).parent} and run on CPUs {where['affinity']}; "
            f"broker and ranks on CPU {bus_cpus[0]}")
        if Path(where["feeder"]).resolve() != (ROOT / "feeder").resolve():
            raise BenchError(f"Spark's Python workers import the feeder from {where['feeder']}, not from {ROOT}: "
                             "set PYTHONPATH to the tree being measured")
        if where["affinity"] != list(spark_cpus):
            raise BenchError(f"Spark's Python workers run on CPUs {where['affinity']}, not {list(spark_cpus)}")
        for kind in kinds:
            try:
                stored = driver.prepare(rows=sizes.cluster_rows, partitions=PARTITIONS, feed=broker.feed, kind=kind)
            except BenchError as exc:
                if kind == "fixed":
                    raise
                out.refused[kind] = _cause(str(exc))
                log(f"  {kind}: not measured, the feeder refused it: {out.refused[kind]}")
                continue
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
    batch_size, options = batch_options(size, row_bytes)

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


def _cause(text: str) -> str:
    """The last ``SomeError: message`` line of a driver's traceback, shortened."""
    lines = [line.strip() for line in text.splitlines() if "Error:" in line or "Exception:" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:300]


def ratio(point: ClusterPoint) -> float:
    """sparkbus rows/s / limit rows/s, medians of the repetitions."""
    return point.sparkbus.med("rows_per_s") / point.limit.med("rows_per_s")


def feeder_cpu_per_gb(point: ClusterPoint, payload_bytes: int) -> float:
    """CPU seconds per GB of payload in Spark's Python workers above the hand-off's (medians)."""
    def workers(series: Series) -> float:
        return median([r["cpu"]["workers"] for r in series.runs])

    return (workers(point.sparkbus) - workers(point.limit)) / (payload_bytes / 1e9)


def spark_cpu_ratio(point: ClusterPoint) -> float:
    """Spark's CPU-s (JVM + Python workers) in the hand-off / in the sparkbus run (medians): the wall-clock ratio
    one core would allow if nothing else ran on it."""
    def spark(series: Series) -> float:
        return median([r["cpu"]["jvm"] + r["cpu"]["workers"] for r in series.runs])

    return spark(point.limit) / spark(point.sparkbus)



# ---- the section ------------------------------------------------------------------------------------------

CLUSTER_RATIOS = ((MiB, 0.95), (64 * KiB, 0.9))     # batch size -> x the Arrow hand-off on the same core
FEEDER_CPU_PER_GB = 0.45                            # CPU-s per GB above the hand-off, at 1 MiB batches
KIND_LABELS = {"fixed": "fixed-width", "tokens": "variable-length (int arrays, mean 64)"}


class ClusterSection(Section[Cluster]):
    """Figure 2b: Spark pinned to one core, the broker and the ranks to the other."""

    name, figure = "cluster", "2b"
    title = "2b. end to end, cluster-shaped (Spark on one core, the broker and the ranks on the other)"

    def measure(self, ctx: Context) -> Cluster:
        spark_cpus, bus_cpus = cpus()
        out = ctx.results[self.name] = Cluster(ctx.sizes.cluster_rows, ctx.sizes.cluster_reps,
                                               {"spark": list(spark_cpus), "bus": list(bus_cpus)})
        return run(ctx.children, ctx.sizes, ctx.work, log=ctx.log, out=out)

    def targets(self, run: Run, result: Cluster | None) -> list[Target]:
        """The ratio to the hand-off per kind and batch size, and the feeder's CPU above the hand-off's."""
        out = []
        points = result.points if result else {}
        for kind in KINDS:
            for size, goal in CLUSTER_RATIOS:
                what = f"cluster-shaped end to end, {KIND_LABELS[kind]}, {size_label(size)} batches"
                goal_text = f">= {goal} x the Arrow hand-off on the same core"
                point = points.get((kind, size))
                if point and point.sparkbus.runs and point.limit.runs:
                    r = ratio(point)
                    out.append(Target(what, goal_text, f"{r:.2f} x ({point.sparkbus.med('rows_per_s'):,.0f} vs "
                                      f"{point.limit.med('rows_per_s'):,.0f} rows/s)",
                                      at_least(r, goal)))
                else:
                    out.append(Target(what, goal_text, not_measured(result, kind), None))
        for kind in KINDS:
            for size, _ in CLUSTER_RATIOS:
                what = (f"feeder CPU-s per GB above the Arrow hand-off (Spark's Python workers), {KIND_LABELS[kind]}, "
                        f"{size_label(size)} batches, cluster-shaped")
                goal_text = f"<= {FEEDER_CPU_PER_GB}" if size == MiB else "printed (no target)"
                point = points.get((kind, size))
                if result and point and point.sparkbus.runs and point.limit.runs:
                    per_gb = feeder_cpu_per_gb(point, result.kinds[kind]["payload_bytes"])
                    out.append(Target(what, goal_text, f"{per_gb:.2f} CPU-s/GB",
                                      at_most(per_gb, FEEDER_CPU_PER_GB) if size == MiB else None))
                else:
                    out.append(Target(what, goal_text, not_measured(result, kind), None))
        return out

    def markdown(self, run: Run, result: Cluster) -> list[str]:
        if not result.points:
            return []
        c = result
        where = c.where
        parts = ["", "## 2b. End to end, cluster-shaped (Spark on one core, the broker and the ranks on the other)", "",
                 f"A Spark driver process of its own (`local[1]`) pinned to CPU {c.cpus['spark'][0]} before its "
                 "session started (`os.sched_setaffinity`): its JVM and Spark's Python workers, where the feeder "
                 f"runs, inherit it (checked from inside a task: CPUs {where.get('affinity')}, sparkbus imported from "
                 f"`{Path(where.get('feeder', '?')).parent}`). The broker and `mpiexec -n 2` ranks run under "
                 f"`taskset -c {c.cpus['bus'][0]}`. So only the feeder's work competes with Spark, as on a cluster "
                 f"where the broker and the ranks have hosts of their own. {c.rows:,} rows per kind, {PARTITIONS} "
                 "partitions, cached in that driver; batches of about 1 MiB and 64 KiB of payload (`batch_size` = size "
                 "/ mean row bytes, `max_batch_bytes` = size). Each repetition runs the Arrow hand-off (`mapInArrow` + "
                 "drop, on the same core) and the sparkbus epoch, in alternating order; figures are medians of "
                 f"{c.reps} repetitions.", ""]
        rows = []
        for (kind, size), point in c.points.items():
            if not (point.limit.runs and point.sparkbus.runs):
                continue
            lim, s = point.limit, point.sparkbus

            def cpu(series, group):
                return median([run["cpu"].get(group, 0.0) for run in series.runs])

            rows.append([kind, size_label(size), num(median([x["batch_size"] for x in s.runs])),
                         num(lim.med("rows_per_s")),
                         num(s.med("rows_per_s")), f"**{ratio(point):.2f}**", num(s.med("first"), ".2f"),
                         f"{cpu(lim, 'jvm'):.2f} / {cpu(lim, 'workers'):.2f}",
                         f"{cpu(s, 'jvm'):.2f} / {cpu(s, 'workers'):.2f} / {cpu(s, 'broker'):.2f} / "
                         f"{cpu(s, 'ranks'):.2f}",
                         f"**{feeder_cpu_per_gb(point, c.kinds[kind]['payload_bytes']):.2f}**",
                         num(spark_cpu_ratio(point), ".2f")])
        parts.append(table(["kind", "batch", "rows a batch", "hand-off rows/s", "sparkbus rows/s",
                            "sparkbus / hand-off",
                             "first batch (s)", "hand-off CPU-s: JVM / Python workers",
                             "sparkbus CPU-s: JVM / Python workers / broker / ranks",
                             "feeder CPU-s per GB above the hand-off", "Spark's CPU-s: hand-off / sparkbus"], rows))
        kinds = "; ".join(f"`{k}`: {spark_data.KINDS[k]}, {info['payload_bytes'] / 1e6:,.0f} MB" for k, info in
                          c.kinds.items())
        parts += ["", f"Kinds: {kinds}. Feeder CPU-s per GB = (Python workers' CPU-s in the sparkbus run - in the "
                  "hand-off run) / GB of payload (medians): what the feeder adds on Spark's cores. The last column, "
                  "Spark's CPU seconds (JVM + Python workers) of the hand-off / of the sparkbus run, is the ratio the "
                  "one core would allow if it were Spark's alone: a check on the wall-clock ratio, which other work on "
                  "the machine (a load average above 2 here) lowers for sparkbus more than for the hand-off, since "
                  "sparkbus needs the second core too."]
        for kind, why in c.refused.items():
            parts += ["", f"`{kind}` ({spark_data.KINDS[kind]}) was not measured: the feeder refused it: {why}"]
        return parts

    def json(self, run: Run, result: Cluster) -> dict:
        return {"cluster": {"rows": result.rows, "cpus": result.cpus, "where": result.where or None,
                            "kinds": result.kinds, "refused": result.refused,
                            "points": [{"kind": k[0], "batch_bytes": k[1], "limit": p.limit.runs,
                                        "sparkbus": p.sparkbus.runs} for k, p in result.points.items()]}}

    def plots(self, result: Cluster) -> bool:
        return any(p.sparkbus.runs for p in result.points.values())

    def plot(self, ax, run: Run, result: Cluster) -> None:
        points = [(k, p) for k, p in result.points.items() if p.sparkbus.runs and p.limit.runs]
        x = range(len(points))
        ax.bar([i - 0.2 for i in x], [p.limit.med("rows_per_s") / 1e3 for _, p in points], 0.4, color="#999999",
               label="Arrow hand-off")
        bars = ax.bar([i + 0.2 for i in x], [p.sparkbus.med("rows_per_s") / 1e3 for _, p in points], 0.4,
                      color="#1f77b4", label="sparkbus")
        for bar, (_, p) in zip(bars, points):
            ax.annotate(f"{ratio(p):.2f} x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(list(x), [f"{k}\n{size_label(size)}" for (k, size), _ in points], fontsize=8)
        ax.set_ylabel("thousand rows/s")
        ax.set_title("Cluster-shaped: Spark on 1 core, bus on the other", fontsize=9)
        ax.legend(fontsize=8)
        ax.margins(y=0.2)


def not_measured(result: Any, kind: str) -> str:
    """``not run``, or why the feeder refused ``kind`` (a section's record with a ``refused`` dict)."""
    if result is not None and kind in result.refused:
        return f"not measured: the feeder refused it ({result.refused[kind].split('failed: ')[-1][:100]})"
    return "not run"
