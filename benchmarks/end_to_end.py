"""Figure 2, end to end from a cached DataFrame to 2 MPI ranks (``rank_consumer.py``): ``sparkbus`` (broker,
``feeder.feed``), ``parquet`` (Spark writes Parquet, the ranks read it with ``--parquet``) and ``limit`` (Spark's own
hand-off to Python through ``mapInArrow``, dropped: the most any path from Spark can do here). The ranks are ready
before any clock starts. Also the runs that figures 2b, 3, 5, 6 and 7 make (``run_fed_ranks``)."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.broker import BrokerProcess

from . import spark_data
from .common import BenchError, Children, Sizes, median, run_ranks
from .sections import Context, Run, Section, Table
from .spark_data import ROW_BYTES

RANKS = 2
BATCH_SIZE = 1024
_runs = itertools.count()


class CpuMeter:
    """CPU seconds (user + system, psutil) spent during a run by Spark's JVM, by its Python workers (where the
    feeder runs) and by the brokers; started when made, read by :meth:`stop`.

    ``spark_root``: the process whose descendant JVMs are Spark's (default this one; a Spark driver process of
    its own for the cluster-shaped runs).
    """

    def __init__(self, brokers: Sequence[BrokerProcess] = (), spark_root: int | None = None):
        self._broker_pids = [b.pid for b in brokers]
        self._spark_root = spark_root
        self._start = self._read()

    def _read(self) -> dict[str, dict[int, float]]:
        import psutil

        groups: dict[str, dict[int, float]] = {"jvm": {}, "workers": {}, "broker": {}}

        def add(group: str, proc: psutil.Process) -> None:
            try:
                t = proc.cpu_times()
                groups[group][proc.pid] = t.user + t.system
            except psutil.Error:
                pass

        for proc in psutil.Process(self._spark_root).children(recursive=True):
            try:
                if proc.name() != "java":
                    continue
                add("jvm", proc)
                for worker in proc.children(recursive=True):
                    add("workers", worker)
            except psutil.Error:
                pass
        for pid in self._broker_pids:
            try:
                add("broker", psutil.Process(pid))
            except psutil.Error:
                pass
        return groups

    def stop(self) -> dict[str, float]:
        end = self._read()
        return {group: sum(max(0.0, t - self._start[group].get(pid, 0.0)) for pid, t in pids.items())
                for group, pids in end.items()}


@dataclass
class Series:
    """Repetitions of one way of getting the data to the ranks."""

    name: str
    runs: list[dict] = field(default_factory=list)

    def med(self, key: str) -> float:
        return median([r[key] for r in self.runs if r.get(key) is not None])

    def figure(self, section: str, name: str, key: str, unit: str, anchor: Figure | None = None,
               scale: float = 1.0) -> Figure:
        """The figure of ``key`` over its repetitions (times ``scale``), against ``anchor``."""
        return figure(section, name, [r[key] * scale for r in self.runs if r.get(key) is not None], unit, anchor)


def run_sparkbus(children: Children, broker: BrokerProcess | Sequence[BrokerProcess], df: Any, rows: int,
                 ranks: int, work: Path, timeout: float, steps: str = "broker") -> dict:
    """Feed ``df`` as one epoch to ``ranks`` ranks; figures relative to the call of ``feed``.

    With several brokers, the feed spreads the partitions over them and every rank consumes from all of them.
    ``steps``: how the ranks keep equal steps (``BatchStream(steps=...)``: granted by the broker, or agreed over
    MPI).
    """
    from sparkbus.feeder import feed

    brokers = [broker] if isinstance(broker, BrokerProcess) else list(broker)

    def start():
        t0 = time.time()
        report = feed(df, [b.feed for b in brokers], stream=stream, epoch=0, batch_size=BATCH_SIZE,
                      timeout=min(timeout, 120.0))
        return t0, time.time(), report

    stream = f"bench-{next(_runs)}"
    meter = CpuMeter(brokers)
    result = run_fed_ranks(children, brokers, stream, start, rows, ranks, work, timeout, steps=steps)
    result["cpu"] = {**meter.stop(), "ranks": result["ranks_cpu"]}
    return result


def run_fed_ranks(children: Children, brokers: Sequence[BrokerProcess], stream: str, start: Callable[[], tuple],
                  rows: int, ranks: int, work: Path, timeout: float, *, prefix: Sequence[str] = (),
                  touch: bool = False, steps: str = "broker") -> dict:
    """Start ``ranks`` ranks on ``stream`` of ``brokers``; once they are ready, ``start()`` feeds the epoch and
    returns ``(t0, t_fed, report)`` (wall-clock seconds, a ``FeedReport`` or its dict); figures relative to t0.

    ``prefix``: argv before mpiexec's (``common.on_cpus`` pins the ranks); ``touch``: the ranks add up the bytes
    of every column of every batch (``nbytes`` of numpy arrays, of a variable-length column's values and offsets).
    """
    out = work / f"ranks-{stream}"
    args = ["--ranks", ",".join(b.ranks for b in brokers), "--stream", stream, "--timeout", str(timeout),
            "--steps", steps, *(["--touch"] if touch else [])]
    result, (t0, t_fed, report) = run_ranks(children, f"ranks-{stream}", ranks, "rank_consumer.py", out, args,
                                            start, timeout, prefix=prefix)
    shutil.rmtree(out, ignore_errors=True)
    report = report if isinstance(report, dict) else report._asdict()
    if result.rows + sum(r["dropped_rows"] for r in result.ranks) != rows:
        raise BenchError(f"stream {stream}: the ranks took {result.rows} rows and dropped "
                         f"{sum(r['dropped_rows'] for r in result.ranks)} of {rows}")
    last = result.last - t0
    return {"first": result.first - t0, "last": last, "rows": rows, "rows_per_s": rows / last,
            "received_rows": result.rows, "dropped_rows": sum(r["dropped_rows"] for r in result.ranks),
            "feed_seconds": t_fed - t0, "batches": report["batches"], "brokers": list(report.get("brokers") or ()),
            "wait_share": max(r["wait_seconds"] / r["seconds"] for r in result.ranks if r["seconds"] > 0),
            "ranks_cpu": sum(r["cpu_seconds"] for r in result.ranks), "fed_bytes": report.get("bytes"),
            "touched_bytes": sum(r.get("touched_bytes") or 0 for r in result.ranks),
            "rank_affinity": sorted({c for r in result.ranks for c in r.get("affinity") or ()}),
            "rank_modules": sorted({r["module"] for r in result.ranks if r.get("module")})}


def run_parquet(children: Children, df: Any, rows: int, ranks: int, work: Path, timeout: float) -> dict:
    """Stage ``df`` as Parquet, then let ``ranks`` ranks read it; figures relative to the start of the write."""
    n = next(_runs)
    staging, out = work / f"staging-{n}", work / f"parquet-{n}"
    go = out / "go"
    clock: dict = {}

    def start():
        clock["t0"] = time.time()
        df.write.mode("overwrite").parquet(str(staging))
        clock["t_written"] = time.time()
        go.touch()

    args = ["--parquet", str(staging), "--go", str(go), "--batch-size", str(BATCH_SIZE), "--timeout", str(timeout)]
    try:
        result, _ = run_ranks(children, f"parquet-{n}", ranks, "rank_consumer.py", out, args, start, timeout)
    finally:
        files = list(staging.glob("*.parquet"))
        staged = sum(f.stat().st_size for f in files)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    if result.rows != rows:
        raise RuntimeError(f"the Parquet ranks read {result.rows} rows of {rows}")
    last = result.last - clock["t0"]
    return {"first": result.first - clock["t0"], "last": last, "rows": rows, "rows_per_s": rows / last,
            "write_seconds": clock["t_written"] - clock["t0"], "files": len(files), "staged_bytes": staged}


def warm_up_feed(df: Any, broker: BrokerProcess) -> None:
    """Feed a few thousand rows on every Python worker into a stream no rank reads (they stay in the broker)."""
    from sparkbus.feeder import feed

    small = df.limit(4 * BATCH_SIZE).repartition(2)
    feed(small, broker.feed, stream="warm-up", epoch=0, batch_size=BATCH_SIZE, timeout=60.0)


def run_limit(df: Any) -> dict:
    meter = CpuMeter()
    seconds, rows = spark_data.arrow_limit(df)
    return {"first": None, "last": seconds, "rows": rows, "rows_per_s": rows / seconds, "cpu": meter.stop()}


@dataclass
class EndToEnd:
    """Figure 2: the repetitions of the three ways."""

    limit: Series
    sparkbus: Series
    parquet: Series

    def series(self) -> dict[str, Series]:
        return {"limit": self.limit, "sparkbus": self.sparkbus, "parquet": self.parquet}


def run(children: Children, df: Any, rows: int, sizes: Sizes, work: Path, log=print) -> EndToEnd:
    """The three ways, repetitions interleaved (limit, sparkbus, parquet, limit, ...)."""
    result = EndToEnd(Series("limit"), Series("sparkbus"), Series("parquet"))
    series = result.series()
    broker = children.broker("256MiB")
    try:
        # Warm-ups, not recorded: the first full scan of the cache, and the first Parquet write of the session
        # (class loading, committer set-up) are slower than any later one.
        # The first feed also pays for importing sparkbus in the Python workers: a small one, nobody consumes it.
        run_limit(df)
        df.limit(1000).write.mode("overwrite").parquet(str(work / "warm-up.parquet"))
        shutil.rmtree(work / "warm-up.parquet", ignore_errors=True)
        warm_up_feed(df, broker)
        for rep in range(sizes.reps):
            series["limit"].runs.append(run_limit(df))
            series["sparkbus"].runs.append(run_sparkbus(children, broker, df, rows, RANKS, work, sizes.timeout))
            series["parquet"].runs.append(run_parquet(children, df, rows, RANKS, work, sizes.timeout))
            s, p, lim = (series[k].runs[-1] for k in ("sparkbus", "parquet", "limit"))
            log(f"  e2e rep {rep + 1}/{sizes.reps}: limit {lim['rows_per_s']:,.0f} rows/s; sparkbus first "
                f"{s['first']:.2f} s last {s['last']:.2f} s ({s['rows_per_s']:,.0f} rows/s); parquet first "
                f"{p['first']:.2f} s last {p['last']:.2f} s ({p['rows_per_s']:,.0f} rows/s)")
    finally:
        children.discard(broker)
    return result


# ---- the section ------------------------------------------------------------------------------------------



class EndToEndSection(Section[EndToEnd]):
    """Figure 2: the cached DataFrame to 2 ranks by sparkbus, by Parquet staging, and Spark's own hand-off."""

    name, title, figure, spark = "e2e", "2. end to end", "2", "frame"

    def measure(self, ctx: Context) -> EndToEnd:
        assert ctx.dataset is not None
        return run(ctx.children, ctx.df, ctx.dataset.rows, ctx.sizes, ctx.work, ctx.log)

    def figures(self, run: Run, result: EndToEnd) -> list[Figure]:
        s, p, lim = result.sparkbus, result.parquet, result.limit
        limit = lim.figure("e2e", "Arrow hand-off rows/s", "rows_per_s", "rows/s")
        last, p_first = s.figure("e2e", "sparkbus seconds to last batch", "last", "s"), \
            p.figure("e2e", "Parquet staging first batch", "first", "s")
        limit_mb = lim.figure("e2e", "Arrow hand-off MB/s", "rows_per_s", "MB/s", scale=ROW_BYTES / 1e6)
        return [limit, s.figure("e2e", "sparkbus rows/s", "rows_per_s", "rows/s", limit),
                limit_mb, s.figure("e2e", "sparkbus MB/s", "rows_per_s", "MB/s", limit_mb, ROW_BYTES / 1e6),
                p.figure("e2e", "Parquet staging rows/s", "rows_per_s", "rows/s", limit), last,
                p.figure("e2e", "Parquet staging seconds to last batch", "last", "s", last), p_first,
                s.figure("e2e", "sparkbus first batch", "first", "s", p_first)]

    def tables(self, run: Run, result: EndToEnd) -> list[Table]:
        s, p, lim = result.sparkbus, result.parquet, result.limit
        rows = [[label, x.med("first"), x.med("last"), x.med("rows_per_s"), x.med("rows_per_s") * ROW_BYTES / 1e6,
                 x.med("rows_per_s") / lim.med("rows_per_s"), x.med("last") / s.med("last"),
                 x.med("first") / p.med("first")]
                for label, x in (("Arrow hand-off limit (mapInArrow, no sink)", lim), ("sparkbus (2 ranks)", s),
                                 ("Parquet staging (write, then 2 ranks read)", p))]
        paths = Table("The cached DataFrame to 2 ranks: from the call to the first and the last batch at any rank",
                      ["path", "first batch (s)", "last batch (s)", "rows/s", "MB/s", "rows/s / limit's",
                       "last / sparkbus's", "first / Parquet's"], rows,
                      [f"Parquet: the write took {p.med('write_seconds'):.2f} s "
                       f"({median([x['staged_bytes'] for x in p.runs]) / 2**20:,.0f} MiB in {p.runs[0]['files']} "
                       f"files); sparkbus: feed() returned after {s.med('feed_seconds'):.2f} s, "
                       f"{s.med('dropped_rows'):,.0f} rows dropped to keep the ranks even"], plot=("rows/s",))
        ds = run.dataset
        if ds is None:
            return [paths]
        paths.notes.insert(0, f"{ds.rows:,} rows, {ds.partitions} partitions, {ds.payload_bytes / 2**30:.2f} GiB of "
                           f"payload; Spark's cache holds {ds.cached_memory_bytes / 2**30:.2f} GiB in memory, "
                           f"{ds.cached_disk_bytes / 2**30:.2f} GiB on disk")
        return [paths] + cpu_table(lim, s, ds.payload_bytes, run.machine.get("nproc"))

    def json(self, run: Run, result: EndToEnd) -> dict:
        return {"e2e": {k: s.runs for k, s in result.series().items()}}


CPU_GROUPS = {"jvm": "Spark JVM", "workers": "Spark's Python workers (the feeder)", "broker": "broker",
              "ranks": "ranks"}


def cpu_table(limit: Series, sparkbus: Series, payload_bytes: int, cores: int | None) -> list[Table]:
    """Where the CPU of the end-to-end runs went: the limit's and sparkbus's, per process group (medians)."""
    if not all(run.get("cpu") for run in (*limit.runs, *sparkbus.runs)):
        return []

    def cpu(series: Series, group: str) -> float:
        return median([run["cpu"].get(group, 0.0) for run in series.runs])

    gb = payload_bytes / 1e9
    totals = {name: sum(cpu(x, g) for g in CPU_GROUPS) for name, x in (("limit", limit), ("sparkbus", sparkbus))}
    rows = [[label, *[cpu(x, g) for g in CPU_GROUPS], totals[name], x.med("last"), totals[name] / x.med("last"),
             totals[name] / totals["limit"]]
            for name, label, x in (("limit", "Arrow hand-off limit", limit), ("sparkbus", "sparkbus", sparkbus))]
    extra = totals["sparkbus"] - totals["limit"]
    notes = [f"sparkbus adds {extra:.2f} CPU-s to the limit's {totals['limit']:.2f} ({extra / gb:.2f} CPU-s per GB)",
             f"feeder CPU-s per GB above the hand-off in Spark's Python workers: "
             f"{(cpu(sparkbus, 'workers') - cpu(limit, 'workers')) / gb:.2f}"]
    if cores:
        best = totals["sparkbus"] / cores
        notes.append(f"on {cores} shared cores that CPU bounds sparkbus at {limit.med('last') / best:.2f} x the "
                     f"limit's rate; 0.9 x would need at most "
                     f"{(limit.med('last') / 0.9 * cores - totals['limit']) / gb:.2f} CPU-s per GB added")
    return [Table("CPU seconds per run by process group (medians; psutil, user + system)",
                  ["run", *CPU_GROUPS.values(), "all", "wall (s)", "cores busy", "all / limit's"], rows, notes)]
