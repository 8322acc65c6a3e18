"""Figure 2, end to end: ``sparkbus.bench.e2e`` (a cached DataFrame to 2 ranks by sparkbus, against Spark's own
hand-off to Python and against Parquet staging) with the CPU of each process group. Also the runs to MPI ranks
(``rank_consumer.py``) that figures 2b, 3, 5, 6 and 7 make (``run_sparkbus``, ``run_fed_ranks``)."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.bench import e2e
from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.broker import BrokerProcess

from .common import BenchError, Children, median, run_ranks
from .sections import Context, Section
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
    result, (t0, _, report) = run_ranks(children, f"ranks-{stream}", ranks, "rank_consumer.py", out, args,
                                      start, timeout, prefix=prefix)
    shutil.rmtree(out, ignore_errors=True)
    report = report if isinstance(report, dict) else report._asdict()
    if result.rows + sum(r["dropped_rows"] for r in result.ranks) != rows:
        raise BenchError(f"stream {stream}: the ranks took {result.rows} rows and dropped "
                         f"{sum(r['dropped_rows'] for r in result.ranks)} of {rows}")
    last = result.last - t0
    return {"first": result.first - t0, "last": last, "rows_per_s": rows / last,
            "dropped_rows": sum(r["dropped_rows"] for r in result.ranks), "brokers": list(report.get("brokers") or ()),
            "ranks_cpu": sum(r["cpu_seconds"] for r in result.ranks),
            "touched_bytes": sum(r["touched_bytes"] for r in result.ranks),
            "rank_modules": sorted({r["module"] for r in result.ranks})}


class EndToEndSection(Section[list]):
    """Figure 2: the cached DataFrame to 2 ranks by sparkbus, by Parquet staging, and Spark's own hand-off."""

    name, title, spark = "e2e", "2. end to end: sparkbus vs the Arrow hand-off and Parquet staging", "frame"

    def measure(self, ctx: Context) -> list:
        return e2e.measure("e2e", ctx.df, ctx.work, ctx.sizes.reps, ctx.sizes.timeout, row_bytes=ROW_BYTES, log=ctx.log,
                           meter=lambda broker: CpuMeter([broker] if broker else []))
