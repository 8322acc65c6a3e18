"""Figure 3: scaling with ranks and feeding tasks, and the broker's peak memory while data flows through it.

Ranks: 1, 2 and 4 (``mpiexec -n``) consuming the cached DataFrame fed by its ``Sizes.partitions`` tasks.
Feeding tasks: 1, 2 and 4 partitions (``df.coalesce(p)`` of the cached 4-partition DataFrame, which reads the
cache without a shuffle) to 2 ranks. Spark stays ``local[2]`` throughout, so at most 2 tasks run at once: 4
partitions means 2 waves of 2 tasks. The (2 ranks, 4 tasks) point is the end-to-end sparkbus figure.

Peak RSS: a fresh broker with a small ``--max-buffer`` is fed ``Sizes.rss_bytes`` of 1 MiB batches by two
processes running the real feeder path (``feeder.task.stream_partition``, one partition each, epoch opened and
closed over the control socket) and drained by one ``BatchStream(comm=None)`` that verifies every checksum (so
the consumer is the slowest part and the broker's buffer fills). Its RSS is sampled every 50 ms with psutil;
the kernel's own high-water mark (``VmHWM``) is read as a cross-check.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import agents
import end_to_end
from broker.client import ControlClient
from broker.protocol import Kind
from common import BenchError, Children, MiB, Sizes, open_epoch, rss_sampler, vm_hwm
from end_to_end import Series

RANKS = (1, 2, 4)
TASKS = (1, 2, 4)
RSS_BATCH = 1 * MiB
RSS_FEEDERS = 2
_streams = itertools.count()


def run(children: Children, df: Any, rows: int, sizes: Sizes, work: Path, e2e: Series | None = None,
        log=print) -> dict[tuple[int, int], Series]:
    """``{(ranks, tasks): Series}`` for every point of the two sweeps."""
    base = sizes.partitions
    points = sorted({(r, base) for r in RANKS} | {(end_to_end.RANKS, t) for t in TASKS})
    series = {p: Series(f"{p[0]} ranks, {p[1]} tasks") for p in points}
    reuse = (end_to_end.RANKS, base)
    if e2e is not None and e2e.runs:
        series[reuse].runs = list(e2e.runs)
        series[reuse].name += " (the end-to-end runs)"
    frames = {t: (df if t == base else df.coalesce(t)) for t in TASKS}
    broker = children.broker("256MiB")
    try:
        end_to_end.warm_up_feed(df, broker)         # Spark's Python workers start before any point is timed
        for rep in range(sizes.reps):
            for ranks, tasks in (points if rep % 2 == 0 else points[::-1]):     # no point always runs first
                if (ranks, tasks) == reuse and e2e is not None and e2e.runs:
                    continue
                series[ranks, tasks].runs.append(
                    end_to_end.run_sparkbus(children, broker, frames[tasks], rows, ranks, work, sizes.timeout))
        for point in points:
            s = series[point]
            log(f"  scaling {s.name}: {s.med('rows_per_s'):,.0f} rows/s, first batch {s.med('first'):.2f} s, "
                f"last {s.med('last'):.2f} s, ranks' CPU {s.med('ranks_cpu'):.2f} s")
    finally:
        children.discard(broker)
    return series


def run_rss(children: Children, sizes: Sizes, log=print) -> list[dict]:
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
            log(f"  broker RSS rep {rep + 1}/{sizes.reps}: {r['bytes'] / MiB:,.0f} MiB through --max-buffer "
                f"{sizes.rss_max_buffer / MiB:.0f}MiB in {r['seconds']:.1f} s: idle {r['idle_rss'] / MiB:.0f} MiB, "
                f"peak {r['peak_rss'] / MiB:.0f} MiB (VmHWM {(r['vm_hwm'] or 0) / MiB:.0f} MiB)")
    finally:
        for child in (consumer, *feeders):
            children.discard(child)
    return runs


def _one_rss(broker, feeders, consumer, per_feeder: int, sizes: Sizes, timeout: float) -> dict:
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
    return {"bytes": got["received"] * RSS_BATCH, "seconds": got["t_last"] - start, "idle_rss": idle,
            "peak_rss": peak, "vm_hwm": hwm, "samples": sampler.samples, "max_buffer": sizes.rss_max_buffer,
            "at": time.time()}
