"""Figure 2, end to end: ``sparkbus.bench.e2e`` (a cached DataFrame to 2 ranks by sparkbus, against Spark's own
hand-off to Python and against Parquet staging) with the CPU of each process group. Also the epochs fed to MPI
ranks (``rank.py``) that figures 2b, 3, 5, 6 and 7 make (:func:`run_fed_ranks`)."""

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

from .common import BenchError, Children, run_ranks
from .sections import Context, Section
from .spark_data import ROW_BYTES

RANKS = 2
BATCH_SIZE = 1024
_runs = itertools.count()


class CpuMeter:
    """CPU seconds (user + system) spent from its making to :meth:`stop` by Spark's JVMs (the descendants of
    ``spark_root``, default this process), their Python workers (where the feeder runs) and the brokers."""

    def __init__(self, brokers: Sequence[BrokerProcess] = (), spark_root: int | None = None):
        self._broker_pids = [b.pid for b in brokers]
        self._spark_root = spark_root
        self._start = self._read()

    def _read(self) -> dict[str, dict[int, float]]:
        import psutil

        groups: dict[str, dict[int, float]] = {"jvm": {}, "workers": {}, "broker": {}}
        procs: list[tuple[str, Any]] = []
        for pid in self._broker_pids:
            try:
                procs.append(("broker", psutil.Process(pid)))
            except psutil.Error:
                pass
        for proc in psutil.Process(self._spark_root).children(recursive=True):
            try:
                if proc.name() == "java":
                    procs += [("jvm", proc), *(("workers", worker) for worker in proc.children(recursive=True))]
            except psutil.Error:
                pass
        for group, proc in procs:
            try:
                t = proc.cpu_times()
                groups[group][proc.pid] = t.user + t.system
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

    def figure(self, section: str, name: str, key: str, unit: str, anchor: Figure | None = None,
               scale: float = 1.0) -> Figure:
        """The figure of ``key`` over its repetitions (times ``scale``), against ``anchor``."""
        return figure(section, name, [r[key] * scale for r in self.runs if r.get(key) is not None], unit, anchor)


def run_sparkbus(children: Children, broker: BrokerProcess | Sequence[BrokerProcess], df: Any, rows: int,
                 ranks: int, work: Path, timeout: float, steps: str = "broker") -> dict:
    """Feed ``df`` as one epoch to ``ranks`` ranks from this process's Spark, over one or several brokers (every
    rank consumes from all of them); ``steps``: how the ranks keep equal steps (granted, or agreed over MPI)."""
    from sparkbus.feeder import feed

    brokers = [broker] if isinstance(broker, BrokerProcess) else list(broker)
    stream = f"bench-{next(_runs)}"

    def start() -> tuple:
        t0 = time.time()
        report = feed(df, [b.feed for b in brokers], stream=stream, epoch=0, batch_size=BATCH_SIZE,
                      timeout=min(timeout, 120.0))
        return t0, time.time(), report

    return run_fed_ranks(children, brokers, stream, start, rows, ranks, work, timeout, steps=steps,
                         meter=CpuMeter(brokers))


def run_fed_ranks(children: Children, brokers: Sequence[BrokerProcess], stream: str, start: Callable[[], tuple],
                  rows: int, ranks: int, work: Path, timeout: float, *, prefix: Sequence[str] = (),
                  touch: bool = False, steps: str = "broker", meter: CpuMeter | None = None) -> dict:
    """Start ``ranks`` ranks on ``stream`` of ``brokers``; once they are ready, ``start()`` feeds the epoch and
    returns ``(t0, t_fed, report)`` (wall-clock seconds, a ``FeedReport`` or its dict); figures relative to t0.

    ``prefix``: argv before mpiexec's (``common.on_cpus``); ``touch``: the ranks add up the bytes of every column;
    ``meter``: the CPU of each process group during the run, in ``cpu``.
    """
    out = work / f"ranks-{stream}"
    args = ["--ranks", ",".join(b.ranks for b in brokers), "--stream", stream, "--timeout", str(timeout),
            "--steps", steps, *(["--touch"] if touch else [])]
    result, (t0, _, report) = run_ranks(children, f"ranks-{stream}", ranks, "rank.py", out, args, start, timeout,
                                        prefix=prefix)
    shutil.rmtree(out, ignore_errors=True)
    report = report if isinstance(report, dict) else report._asdict()
    epochs = [r["epochs"][0] for r in result]
    got, dropped = sum(e["rows"] for e in epochs), sum(e["dropped_rows"] for e in epochs)
    if got + dropped != rows:
        raise BenchError(f"stream {stream}: the ranks took {got} rows and dropped {dropped} of {rows}")
    last = max(e["t_last"] for e in epochs if e["t_last"] is not None) - t0
    cpu = sum(r["cpu_seconds"] for r in result)
    return {"first": min(e["t_first"] for e in epochs if e["t_first"] is not None) - t0, "last": last,
            "rows_per_s": rows / last, "dropped_rows": dropped, "brokers": list(report.get("brokers") or ()),
            "ranks_cpu": cpu, "touched_bytes": sum(e["touched_bytes"] for e in epochs),
            "rank_modules": sorted({r["module"] for r in result}),
            **({"cpu": {**meter.stop(), "ranks": cpu}} if meter else {})}


class EndToEndSection(Section[list]):
    """Figure 2: the cached DataFrame to 2 ranks by sparkbus, by Parquet staging, and Spark's own hand-off."""

    name, title, spark = "e2e", "2. end to end: sparkbus vs the Arrow hand-off and Parquet staging", "frame"

    def measure(self, ctx: Context) -> list:
        return e2e.measure("e2e", ctx.df, ctx.work, ctx.sizes.reps, ctx.sizes.timeout, row_bytes=ROW_BYTES, log=ctx.log,
                           meter=lambda broker: CpuMeter([broker] if broker else []))
