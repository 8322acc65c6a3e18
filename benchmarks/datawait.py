"""Figure 4, data-wait: the share of an epoch 2 ranks wait for data while the feed outpaces their compute (a sleep
per batch at half the end-to-end rate), the steps granted by the broker (the figure), agreed over MPI, and not
kept even (a diagnostic). benchmarks/README.md, section 4, says more."""

from __future__ import annotations

import itertools
import shutil
import threading
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure
from sparkbus.launch.processes import wait_for

from . import spark_data
from .common import BenchError, Children, MiB, Sizes, run_ranks
from .end_to_end import BATCH_SIZE, RANKS, Series
from .sections import Context, Section

GO_BUFFERED = 16 * MiB
MAX_BUFFER = "32MiB"
DEFAULT_COMPUTE = 0.01
_runs = itertools.count()


def compute_per_batch(rows_per_s: float | None) -> float:
    """Seconds of compute per batch and rank so that the ranks consume at half ``rows_per_s``."""
    if not rows_per_s or rows_per_s != rows_per_s:
        return DEFAULT_COMPUTE
    return min(0.05, max(0.002, 2 * RANKS * BATCH_SIZE / rows_per_s))


def run(children: Children, spark: Any, main_df: Any, main_rows: int, sizes: Sizes, work: Path,
        rows_per_s: float | None, log=print) -> list[Figure]:
    """The worst rank's data-wait, % of the epoch: steps granted by the broker (the figure), then steps agreed over
    MPI and even=False (a diagnostic) against it."""
    compute = compute_per_batch(rows_per_s)
    batches = RANKS * sizes.wait_epoch_seconds / compute
    rows = int(min(main_rows, max(20 * RANKS, batches) * BATCH_SIZE))
    if rows >= main_rows:
        df, own = main_df, False
    else:
        (df, _), own = spark_data.cached_frame(spark, rows, sizes.partitions, seed=1000), True
    ways = {"steps granted": ("broker", True), "steps agreed over MPI": ("mpi", True), "even=False": ("broker", False)}
    series = {name: Series(f"data-wait, {name}") for name in ways}
    broker = children.broker(MAX_BUFFER)
    try:
        for rep in range(sizes.reps):
            for name, (steps, even) in ways.items():
                series[name].runs.append(_one(children, broker, df, compute, work, sizes.timeout, even, steps))
                log(f"  data-wait rep {rep + 1}/{sizes.reps}, {name}: compute {compute * 1e3:.1f} ms/batch, waited "
                    f"{series[name].runs[-1]['wait_share'] * 100:.2f} % (worst rank)")
    finally:
        children.discard(broker)
        if own:
            df.unpersist()
    granted = series.pop("steps granted").figure("wait", "data-wait, steps granted", "wait_share", "%", scale=100)
    return [granted, *(s.figure("wait", s.name, "wait_share", "%", granted, 100) for s in series.values())]


def _one(children: Children, broker, df: Any, compute: float, work: Path, timeout: float, even: bool,
         steps: str = "broker") -> dict:
    from sparkbus.feeder import feed

    n = next(_runs)
    stream, out = f"wait-{n}", work / f"wait-{n}"
    go = out / "go"
    state: dict = {}

    def feeding():
        try:
            state["report"] = feed(df, broker.feed, stream=stream, epoch=0, batch_size=BATCH_SIZE,
                                   timeout=min(timeout, 120.0))
        except BaseException as exc:       # reported by the caller
            state["error"] = exc

    def start():
        thread = threading.Thread(target=feeding, name="datawait-feed", daemon=True)
        thread.start()
        wait_for(lambda: not thread.is_alive() or _buffered(broker) >= GO_BUFFERED, timeout,
                 "the feed to get under way", interval=0.005)
        go.touch()
        return thread

    args = ["--ranks", broker.ranks, "--stream", stream, "--go", str(go), "--compute", str(compute),
            "--timeout", str(timeout), "--even", "auto" if even else "no", "--steps", steps]
    result, thread = run_ranks(children, f"wait-ranks-{n}", RANKS, "rank_consumer.py", out, args, start, timeout)
    thread.join(timeout)
    shutil.rmtree(out, ignore_errors=True)
    if "error" in state:
        raise BenchError(f"the data-wait feed failed: {state['error']}")
    if thread.is_alive():
        raise BenchError("the data-wait feed did not finish")
    return {"wait_share": max(r["wait_seconds"] / r["seconds"] for r in result.ranks if r["seconds"] > 0)}


def _buffered(broker) -> int:
    try:
        return int(broker.stats(2.0)["broker"].get("buffered_bytes", 0))
    except Exception:
        return 0


class DataWaitSection(Section[list]):
    """Figure 4: the ranks' data-wait while the feed outpaces their compute."""

    name, title, spark = "wait", "4. data-wait", "frame"

    def measure(self, ctx: Context) -> list:
        rate = next((f.value for f in ctx.results.get("e2e") or () if f.name == "sparkbus rows/s"), None)
        return run(ctx.children, ctx.spark, ctx.df, ctx.rows, ctx.sizes, ctx.work, rate, ctx.log)
