"""Figure 3, scaling over ranks (1, 2, 4) and feeding tasks (1, 2, 4) on one broker, and 3b, the broker's peak RSS
while far more than its ``--max-buffer`` flows through it (two feeders on the real feeder path, one verifying
``BatchStream``; RSS sampled every 50 ms, the kernel's ``VmHWM`` beside it)."""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure
from sparkbus.broker.client import ControlClient
from sparkbus.wire.protocol import Kind

from . import agents, end_to_end
from .common import BenchError, Children, MiB, Sizes, median, open_epoch, rss_sampler, vm_hwm
from .end_to_end import Series
from .report import gib
from .sections import Context, Run, Section, Table
from .spark_data import ROW_BYTES

RANKS = (1, 2, 4)
TASKS = (1, 2, 4)
RSS_BATCH = 1 * MiB
RSS_FEEDERS = 2
_streams = itertools.count()


@dataclass
class RssRun:
    """One repetition of the broker's peak RSS: bytes through it, in how long, its RSS idle and at peak."""

    bytes: int
    seconds: float
    idle_rss: int
    peak_rss: int
    vm_hwm: int | None              # the kernel's high-water mark (None where /proc does not give it)
    samples: int
    max_buffer: int
    at: float


def run(children: Children, df: Any, rows: int, sizes: Sizes, work: Path, e2e: Series | None = None,
        log=print) -> Scaling:
    """``{(ranks, tasks, steps): Series}`` for every point of the two sweeps (steps granted by the broker), and 4
    ranks with their steps agreed over MPI beside them."""
    base = sizes.partitions
    points = sorted({(r, base, "broker") for r in RANKS} | {(end_to_end.RANKS, t, "broker") for t in TASKS}
                    | {(max(RANKS), base, "mpi")})
    series = {p: Series(f"{p[0]} ranks, {p[1]} tasks" + (", steps agreed over MPI" if p[2] == "mpi" else ""))
              for p in points}
    reuse = (end_to_end.RANKS, base, "broker")
    if e2e is not None and e2e.runs:
        series[reuse].runs = list(e2e.runs)
        series[reuse].name += " (the end-to-end runs)"
    frames = {t: (df if t == base else df.coalesce(t)) for t in TASKS}
    broker = children.broker("256MiB")
    try:
        end_to_end.warm_up_feed(df, broker)         # Spark's Python workers start before any point is timed
        for rep in range(sizes.reps):
            for ranks, tasks, steps in (points if rep % 2 == 0 else points[::-1]):     # no point always runs first
                if (ranks, tasks, steps) == reuse and e2e is not None and e2e.runs:
                    continue
                series[ranks, tasks, steps].runs.append(
                    end_to_end.run_sparkbus(children, broker, frames[tasks], rows, ranks, work, sizes.timeout,
                                            steps=steps))
        for point in points:
            s = series[point]
            log(f"  scaling {s.name}: {s.med('rows_per_s'):,.0f} rows/s, first batch {s.med('first'):.2f} s, "
                f"last {s.med('last'):.2f} s, ranks' CPU {s.med('ranks_cpu'):.2f} s")
    finally:
        children.discard(broker)
    return series


def run_rss(children: Children, sizes: Sizes, log=print) -> list[RssRun]:
    """Peak RSS of a broker with ``--max-buffer sizes.rss_max_buffer`` while ``sizes.rss_bytes`` flow through."""
    per_feeder = max(1, sizes.rss_bytes // RSS_BATCH // RSS_FEEDERS)
    feeders = [children.agent(f"rss-feeder-{i}", agents.sender) for i in range(RSS_FEEDERS)]
    consumer = children.agent("rss-consumer", agents.receiver)
    timeout = max(60.0, sizes.timeout)
    runs = []
    try:
        for rep in range(sizes.reps):
            broker = children.broker(sizes.rss_max_buffer)
            try:
                runs.append(_one_rss(broker, feeders, consumer, per_feeder, sizes, timeout))
            finally:
                children.discard(broker)
            r = runs[-1]
            log(f"  broker RSS rep {rep + 1}/{sizes.reps}: {r.bytes / MiB:,.0f} MiB through --max-buffer "
                f"{sizes.rss_max_buffer / MiB:.0f}MiB in {r.seconds:.1f} s: idle {r.idle_rss / MiB:.0f} MiB, "
                f"peak {r.peak_rss / MiB:.0f} MiB (VmHWM {(r.vm_hwm or 0) / MiB:.0f} MiB)")
    finally:
        for child in (consumer, *feeders):
            children.discard(child)
    return runs


def _one_rss(broker, feeders, consumer, per_feeder: int, sizes: Sizes, timeout: float) -> RssRun:
    import psutil

    stream = f"rss-{next(_streams)}"
    idle = psutil.Process(broker.pid).memory_info().rss
    sampler = rss_sampler(broker.pid, 0.05)
    client = ControlClient(broker.control, timeout)
    try:
        open_epoch(client, stream, 0, len(feeders))
        consumer.send({"mode": "sparkbus", "ranks": broker.ranks, "stream": stream, "timeout": timeout,
                       "size": RSS_BATCH})
        consumer.recv(timeout, "its ready message")
        for part, feeder in enumerate(feeders):
            feeder.send({"mode": "sparkbus", "size": RSS_BATCH, "seconds": 0.0, "min_batches": per_feeder,
                         "max_batches": per_feeder, "feed": broker.feed, "control": broker.control,
                         "stream": stream, "partition": part, "timeout": timeout})
        sent = [f.recv(timeout + sizes.rss_bytes / (20 * MiB), "the end of its feed") for f in feeders]
        client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=len(feeders))
        got = consumer.recv(timeout, "the end of its epoch")
    finally:
        client.close()
        peak = sampler.stop()
    hwm = vm_hwm(broker.pid)
    if got["received"] != sum(s["sent"] for s in sent):
        raise BenchError(f"RSS run: sent {sum(s['sent'] for s in sent)} batches, received {got['received']}")
    start = min(s["t_first"] for s in sent)
    return RssRun(bytes=got["received"] * RSS_BATCH, seconds=got["t_last"] - start, idle_rss=idle,
                  peak_rss=peak, vm_hwm=hwm, samples=sampler.samples, max_buffer=sizes.rss_max_buffer, at=time.time())


# ---- the sections -----------------------------------------------------------------------------------------

Scaling = dict[tuple[int, int, str], Series]     # (ranks, feeding tasks, steps) -> repetitions


class ScalingSection(Section[Scaling]):
    """Figure 3: ranks and feeding tasks; the (2 ranks, 4 tasks) point reuses figure 2's sparkbus runs."""

    name, title, figure, spark = "scaling", "3. scaling", "3", "frame"

    def measure(self, ctx: Context) -> Scaling:
        assert ctx.dataset is not None
        e2e = ctx.results.get("e2e")
        return run(ctx.children, ctx.df, ctx.dataset.rows, ctx.sizes, ctx.work, e2e.sparkbus if e2e else None,
                   ctx.log)

    def figures(self, run: Run, result: Scaling) -> list[Figure]:
        """Rows/s of every point against 1 rank fed by as many tasks."""
        one = result.get((1, run.sizes.partitions, "broker"))
        anchor = one.figure("scaling", f"1 rank, {run.sizes.partitions} tasks", "rows_per_s", "rows/s") \
            if one and one.runs else None
        return ([anchor] if anchor else []) + [
            s.figure("scaling", f"{r} ranks, {k} tasks" + (", steps over MPI" if steps == "mpi" else ""), "rows_per_s",
                     "rows/s", anchor) for (r, k, steps), s in sorted(result.items()) if s is not one and s.runs]

    def tables(self, run: Run, result: Scaling) -> list[Table]:
        one = result.get((1, run.sizes.partitions, "broker"))
        anchor = one.med("rows_per_s") if one else float("nan")
        return [Table("Ranks and feeding tasks (partitions, fewer through coalesce; Spark local[2])",
                      ["point", "ranks", "feeding tasks", "equal steps", "rows/s", "MB/s", "first batch (s)",
                       "last batch (s)", "ranks idle (%)", f"vs 1 rank, {run.sizes.partitions} tasks"],
                      [[f"{r}r/{k}t" + ("/mpi" if steps == "mpi" else ""), r, k,
                        "granted" if steps == "broker" else "agreed over MPI", s.med("rows_per_s"),
                        s.med("rows_per_s") * ROW_BYTES / 1e6, s.med("first"), s.med("last"),
                        s.med("wait_share") * 100, s.med("rows_per_s") / anchor]
                       for (r, k, steps), s in sorted(result.items())],
                      ["ranks idle: BatchStream's wait_seconds / seconds, worst rank, no compute"], plot=("rows/s",))]

    def json(self, run: Run, result: Scaling) -> dict:
        return {"scaling": [{"ranks": k[0], "tasks": k[1], "steps": k[2], "runs": s.runs}
                            for k, s in sorted(result.items())]}


class RssSection(Section[list[RssRun]]):
    """Figure 3b: the broker's peak RSS while far more than ``--max-buffer`` flows through it."""

    name, title, figure = "rss", "3b. broker peak RSS", "3b"

    def measure(self, ctx: Context) -> list[RssRun]:
        return run_rss(ctx.children, ctx.sizes, ctx.log)

    def figures(self, run: Run, result: list[RssRun]) -> list[Figure]:
        """The broker's peak RSS against its bound, --max-buffer + 100 MiB."""
        bound = figure("rss", "bound: --max-buffer + 100 MiB", [result[0].max_buffer / MiB + 100], "MiB")
        return [bound, figure("rss", "broker peak RSS", [x.peak_rss / MiB for x in result], "MiB", bound),
                figure("rss", "bytes through", [x.bytes / MiB for x in result], "MiB", bound)]

    def tables(self, run: Run, result: list[RssRun]) -> list[Table]:
        peak, bound = median([x.peak_rss for x in result]), result[0].max_buffer + 100 * MiB
        return [Table("Broker memory: 1 MiB batches from two feeders through one verifying BatchStream",
                      ["bytes through", "--max-buffer", "idle RSS (MiB)", "peak RSS, sampled (MiB)", "VmHWM (MiB)",
                       "bound (MiB)", "peak / bound", "MB/s through"],
                      [[gib(median([x.bytes for x in result])), gib(result[0].max_buffer),
                        median([x.idle_rss for x in result]) / MiB, peak / MiB,
                        median([x.vm_hwm or float("nan") for x in result]) / MiB, bound / MiB, peak / bound,
                        median([x.bytes / x.seconds / 1e6 for x in result])]])]

    def json(self, run: Run, result: list[RssRun]) -> dict:
        return {"rss": [asdict(x) for x in result]}
