"""Figure 4, data-wait: the share of an epoch 2 ranks wait for data while the feed outpaces their compute (a sleep
per batch at half the end-to-end rate), the steps granted by the broker (the figure), agreed over MPI, and not
kept even (a diagnostic). benchmarks/README.md, section 4, says more."""

from __future__ import annotations

import itertools
import shutil
import threading
from typing import Any

from sparkbus.bench.figures import Figure
from sparkbus.launch.processes import wait_for

from . import spark_data
from .common import BenchError, MiB, run_ranks
from .end_to_end import BATCH_SIZE, RANKS, Series
from .sections import Context, Section

GO_BUFFERED = 16 * MiB
WAYS = {"steps granted": ("broker", "auto"), "steps agreed over MPI": ("mpi", "auto"), "even=False": ("broker", "no")}
_runs = itertools.count()


class DataWaitSection(Section[list]):
    """Figure 4: the worst rank's data-wait, % of the epoch: steps granted by the broker (the figure), then steps
    agreed over MPI and even=False (a diagnostic) against it."""

    name, title, spark = "wait", "4. data-wait", "frame"

    def measure(self, ctx: Context) -> list[Figure]:
        sizes = ctx.sizes
        rate = next((f.value for f in ctx.results.get("e2e") or () if f.name == "sparkbus rows/s"), None)
        # compute per batch and rank so that the ranks consume at half the end-to-end rate
        compute = min(0.05, max(0.002, 2 * RANKS * BATCH_SIZE / rate)) if rate and rate == rate else 0.01
        rows = int(min(ctx.rows, max(20 * RANKS, RANKS * sizes.wait_epoch_seconds / compute) * BATCH_SIZE))
        df = ctx.df if rows >= ctx.rows else spark_data.cached_frame(ctx.spark, rows, sizes.partitions, seed=1000)[0]
        series = {name: Series(f"data-wait, {name}") for name in WAYS}
        broker = ctx.children.broker("32MiB")
        try:
            for rep in range(sizes.reps):
                for name, (steps, even) in WAYS.items():
                    series[name].runs.append(_one(ctx, broker, df, compute, even, steps))
                    ctx.log(f"  data-wait rep {rep + 1}/{sizes.reps}, {name}: compute {compute * 1e3:.1f} ms/batch, "
                            f"waited {series[name].runs[-1]['wait_share'] * 100:.2f} % (worst rank)")
        finally:
            ctx.children.discard(broker)
            if df is not ctx.df:
                df.unpersist()
        granted = series.pop("steps granted").figure("wait", "data-wait, steps granted", "wait_share", "%", scale=100)
        return [granted, *(s.figure("wait", s.name, "wait_share", "%", granted, 100) for s in series.values())]


def _one(ctx: Context, broker, df: Any, compute: float, even: str, steps: str) -> dict:
    """One epoch: the ranks wait for the go file, touched once the feed has buffered :data:`GO_BUFFERED`."""
    from sparkbus.feeder import feed

    n, timeout = next(_runs), ctx.sizes.timeout
    stream, out = f"wait-{n}", ctx.work / f"wait-{n}"
    go = out / "go"
    state: dict = {}

    def feeding() -> None:
        try:
            state["report"] = feed(df, broker.feed, stream=stream, epoch=0, batch_size=BATCH_SIZE,
                                   timeout=min(timeout, 120.0))
        except BaseException as exc:       # reported by the caller
            state["error"] = exc

    def start() -> threading.Thread:
        thread = threading.Thread(target=feeding, name="datawait-feed", daemon=True)
        thread.start()
        wait_for(lambda: not thread.is_alive() or _buffered(broker) >= GO_BUFFERED, timeout,
                 "the feed to get under way", interval=0.005)
        go.touch()
        return thread

    args = ["--ranks", broker.ranks, "--stream", stream, "--go", str(go), "--compute", str(compute),
            "--timeout", str(timeout), "--even", even, "--steps", steps]
    ranks, thread = run_ranks(ctx.children, f"wait-ranks-{n}", RANKS, "rank.py", out, args, start, timeout)
    thread.join(timeout)
    shutil.rmtree(out, ignore_errors=True)
    if "error" in state:
        raise BenchError(f"the data-wait feed failed: {state['error']}")
    if thread.is_alive():
        raise BenchError("the data-wait feed did not finish")
    epochs = [r["epochs"][0] for r in ranks]
    return {"wait_share": max(e["wait_seconds"] / e["seconds"] for e in epochs if e["seconds"] > 0)}


def _buffered(broker) -> int:
    try:
        return int(broker.stats(2.0)["broker"].get("buffered_bytes", 0))
    except Exception:
        return 0
