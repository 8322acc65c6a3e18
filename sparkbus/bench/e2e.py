"""End to end: a cached Spark DataFrame (local mode) fed through a broker to ranks, against what Spark can hand to
Python at best (``mapInArrow`` with nothing done: no sink can be faster) and against staging it as Parquet that the
ranks read. The DataFrame is a synthetic one (``id`` and 64 float32 features) or the user's own (``--parquet``)."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .agents import Agent, rank
from .figures import Figure, figure

RANKS = 2
BATCH_SIZE = 1024
_runs = itertools.count()


def synthetic_frame(spark: Any, rows: int, partitions: int = 4, seed: int = 7) -> Any:
    """``id`` long and ``features`` array<float>[64] of random values (Parquet cannot compress them away)."""
    from pyspark.sql import functions as F

    return spark.range(0, rows, numPartitions=partitions).select(
        F.col("id"), F.array(*[F.rand(seed + i).cast("float") for i in range(64)]).alias("features"))


def _dropper() -> Callable:
    def drop(batches: Any) -> Any:
        import pyarrow as pa

        rows = sum(batch.num_rows for batch in batches)
        yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))

    return drop


def hand_off(df: Any) -> tuple[float, int]:
    """The DataFrame handed to Python through ``mapInArrow`` and dropped: (seconds, rows)."""
    started = time.time()
    rows = sum(r["rows"] for r in df.mapInArrow(_dropper(), "rows long").collect())
    return time.time() - started, rows


def _ranks(work: Path, address: str, stream: str, timeout: float, files: str | None = None,
           go: Path | None = None) -> list[Agent]:
    agents = [Agent(rank, address, stream, r, RANKS, timeout, [files] if files else None, str(go) if go else None)
              for r in range(RANKS)]
    for r, agent in enumerate(agents):
        agent.get(timeout, f"rank {r}")
    return agents


def _finish(agents: list[Agent], started: float, rows: int, timeout: float, what: str) -> dict:
    try:
        done = [agent.get(timeout, f"{what} rank {r}") for r, agent in enumerate(agents)]
    finally:
        for agent in agents:
            agent.stop()
    got = sum(d["rows"] for d in done)
    if got != rows:                   # the remainder is shared out (remainder="split"): every row reaches a rank
        raise RuntimeError(f"{what}: {got} rows reached the ranks of {rows}")
    first = min(d["first"] for d in done if d["first"])
    last = max(d["last"] for d in done if d["last"])
    return {"first": first - started, "last": last - started, "rows_per_s": rows / (last - started),
            "ranks_cpu": sum(d["cpu"] for d in done)}


def via_sparkbus(df: Any, rows: int, broker: Any, work: Path, timeout: float, meter: Callable | None = None) -> dict:
    from sparkbus.feeder import feed

    stream = f"e2e-{next(_runs)}"
    agents = _ranks(work, broker.ranks, stream, timeout)
    cpu = meter(broker) if meter else None
    started = time.time()
    try:
        feed(df, broker.feed, stream=stream, epoch=0, batch_size=BATCH_SIZE, timeout=timeout)
    except BaseException:
        for agent in agents:
            agent.stop()
        raise
    done = _finish(agents, started, rows, timeout, "sparkbus")
    return {**done, "cpu": {**cpu.stop(), "ranks": done["ranks_cpu"]}} if cpu else done


def via_parquet(df: Any, rows: int, work: Path, timeout: float) -> dict:
    staging, go = work / f"staging-{next(_runs)}", work / "go"
    go.unlink(missing_ok=True)
    agents = _ranks(work, "", "", timeout, files=str(staging), go=go)
    started = time.time()
    try:
        df.write.mode("overwrite").parquet(str(staging))
        go.touch()
        return _finish(agents, started, rows, timeout, "Parquet staging")
    finally:
        for agent in agents:
            agent.stop()
        shutil.rmtree(staging, ignore_errors=True)


def measure(section: str, df: Any, work: Path, reps: int, timeout: float, parquet: bool = True,
            row_bytes: int | None = None, log: Callable[[str], None] = print,
            meter: Callable | None = None) -> list[Figure]:
    """Cache ``df`` (unless it is), warm Spark up, then interleave the hand-off, sparkbus and (``parquet``) staging
    ``reps`` times.

    Figures: rows/s of each way (sparkbus's against the hand-off), sparkbus's time to its first and last batch
    against staging's, and, with ``row_bytes``, MB/s. With ``meter`` (called with the broker, or None for the
    hand-off, before a run: its ``stop()`` gives the CPU seconds of each process group) and ``row_bytes``, the CPU-s
    per GB of the hand-off and of sparkbus, and of each group of sparkbus's."""
    from sparkbus.launch.broker import BrokerProcess

    cached = df.is_cached
    df = df if cached else df.cache()
    rows = df.count()
    if not rows:
        raise ValueError("the DataFrame has no rows")
    df.limit(1000).mapInArrow(_dropper(), "rows long").collect()         # Python workers started, scan warm
    broker = BrokerProcess(work / f"{section}-broker.log", "--max-buffer", "256MiB")
    broker.start(timeout)
    runs: dict[str, list[dict]] = {"hand-off": [], "sparkbus": [], "parquet": []}
    try:
        # every task slot's Python worker imports sparkbus once, outside the timing: a small unrecorded feed
        sample = df.limit(16 * BATCH_SIZE).cache()
        via_sparkbus(sample, sample.count(), broker, work, timeout)
        sample.unpersist()
        if parquet:
            df.limit(1000).write.mode("overwrite").parquet(str(work / "warm-up.parquet"))
        for _ in range(reps):
            cpu = meter(None) if meter else None
            seconds, handed = hand_off(df)
            runs["hand-off"].append({"rows_per_s": handed / seconds, "last": seconds,
                                     **({"cpu": cpu.stop()} if cpu else {})})
            runs["sparkbus"].append(via_sparkbus(df, rows, broker, work, timeout, meter))
            if parquet:
                runs["parquet"].append(via_parquet(df, rows, work, timeout))
            log(f"{section}: " + ", ".join(f"{k} {v[-1]['rows_per_s']:,.0f} rows/s" for k, v in runs.items() if v))
    finally:
        broker.stop()
        if not cached:
            df.unpersist()

    def reps_of(way: str, key: str) -> list[float]:
        return [r[key] for r in runs[way]]

    limit = figure(section, "Arrow hand-off rows/s", reps_of("hand-off", "rows_per_s"), "rows/s")
    ours = figure(section, "sparkbus rows/s", reps_of("sparkbus", "rows_per_s"), "rows/s", limit)
    figures = [limit, ours]
    if row_bytes:
        limit_mb = figure(section, "Arrow hand-off MB/s", [r * row_bytes / 1e6 for r in limit.reps], "MB/s")
        figures += [limit_mb, figure(section, "sparkbus MB/s", [r * row_bytes / 1e6 for r in ours.reps], "MB/s",
                                     limit_mb)]
    last = figure(section, "sparkbus seconds to last batch", reps_of("sparkbus", "last"), "s")
    figures.append(last)
    if parquet:
        p_rows = figure(section, "Parquet staging rows/s", reps_of("parquet", "rows_per_s"), "rows/s", limit)
        p_first = figure(section, "Parquet staging first batch", reps_of("parquet", "first"), "s")
        figures += [p_rows, figure(section, "Parquet staging seconds to last batch", reps_of("parquet", "last"),
                                   "s", last), p_first,
                    figure(section, "sparkbus first batch", reps_of("sparkbus", "first"), "s", p_first)]
    else:
        figures.append(figure(section, "sparkbus first batch", reps_of("sparkbus", "first"), "s", last))
    if meter and row_bytes:
        figures += _cpu_figures(section, runs, rows * row_bytes / 1e9)
    return figures


def _cpu_figures(section: str, runs: dict[str, list[dict]], gb: float) -> list[Figure]:
    """CPU-s per GB of payload, all processes: sparkbus's against the hand-off's; sparkbus's per process group."""
    def per_gb(way: str, groups: Any = None) -> list[float]:
        return [sum(v for k, v in r["cpu"].items() if groups is None or k in groups) / gb for r in runs[way]]

    limit = figure(section, "Arrow hand-off CPU-s per GB", per_gb("hand-off"), "CPU-s/GB")
    return [limit, figure(section, "sparkbus CPU-s per GB", per_gb("sparkbus"), "CPU-s/GB", limit),
            *(figure(section, f"sparkbus CPU-s per GB, {group}", per_gb("sparkbus", (group,)), "CPU-s/GB")
              for group in runs["sparkbus"][0]["cpu"])]
