"""Figure 4, data-wait: the share of an epoch 2 ranks wait for data while the feed outpaces their compute (a sleep
per batch at half the end-to-end rate), the steps granted by the broker (the figure), agreed over MPI, and not
kept even (a diagnostic); the broker's queue sampled meanwhile. benchmarks/README.md, section 4, says more."""

from __future__ import annotations

import itertools
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure
from sparkbus.launch.processes import wait_for

from . import spark_data
from .common import BenchError, Children, MiB, Sizes, median, run_ranks
from .end_to_end import BATCH_SIZE, RANKS, Series
from .sections import Context, Run, Section, Table, per

GO_BUFFERED = 16 * MiB
MAX_BUFFER = "32MiB"
DEFAULT_COMPUTE = 0.01
_runs = itertools.count()


@dataclass
class DataWait:
    """Figure 4: the compute per batch, the rows, and the runs with ``even=True`` (the figure) and ``False``."""

    compute: float
    rows: int
    series: Series                # steps granted by the broker: the figure
    diagnostic: Series            # even=False
    from_rate: float | None       # the end-to-end rows/s the compute was chosen from (None: a default)
    agreed: Series | None = None  # steps agreed over MPI


def compute_per_batch(rows_per_s: float | None) -> float:
    """Seconds of compute per batch and rank so that the ranks consume at half ``rows_per_s``."""
    if not rows_per_s or rows_per_s != rows_per_s:
        return DEFAULT_COMPUTE
    return min(0.05, max(0.002, 2 * RANKS * BATCH_SIZE / rows_per_s))


def run(children: Children, spark: Any, main_df: Any, main_rows: int, sizes: Sizes, work: Path,
        rows_per_s: float | None, log=print) -> DataWait:
    compute = compute_per_batch(rows_per_s)
    batches = RANKS * sizes.wait_epoch_seconds / compute
    rows = int(min(main_rows, max(20 * RANKS, batches) * BATCH_SIZE))
    if rows >= main_rows:
        df, info, own = main_df, {"rows": main_rows}, False
    else:
        (df, info), own = spark_data.cached_frame(spark, rows, sizes.partitions, seed=1000), True
    series, diagnostic = Series("data-wait"), Series("data-wait, even=False")
    agreed = Series("data-wait, steps agreed over MPI")
    broker = children.broker(MAX_BUFFER)
    labels = {"broker": "", "mpi": " (steps agreed over MPI)", "none": " (diagnostic: even=False)"}
    try:
        for rep in range(sizes.reps):
            for target, steps in ((series, "broker"), (agreed, "mpi"), (diagnostic, "none")):
                target.runs.append(_one(children, broker, df, compute, work, sizes.timeout, steps != "none",
                                        "broker" if steps == "none" else steps))
                r = target.runs[-1]
                log(f"  data-wait rep {rep + 1}/{sizes.reps}{labels[steps]}: "
                    f"compute {compute * 1e3:.1f} ms/batch, epoch {r['seconds']:.2f} s, waited "
                    f"{r['wait_share'] * 100:.2f} % (worst rank); " + (
                        f"broker queue empty in {r['queue_empty_share'] * 100:.0f} % of {r['queue_samples']} samples"
                        if r["queue_samples"] else "feed done before the ranks started"))
    finally:
        children.discard(broker)
        if own:
            df.unpersist()
    return DataWait(compute, info["rows"], series, diagnostic, rows_per_s, agreed)


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
        state["queue"] = QueueSampler(broker, stream)
        return thread

    args = ["--ranks", broker.ranks, "--stream", stream, "--go", str(go), "--compute", str(compute),
            "--timeout", str(timeout), "--even", "auto" if even else "no", "--steps", steps]
    try:
        result, thread = run_ranks(children, f"wait-ranks-{n}", RANKS, "rank_consumer.py", out, args, start,
                                   timeout)
    finally:
        queue = state["queue"].stop() if "queue" in state else []
    thread.join(timeout)
    shutil.rmtree(out, ignore_errors=True)
    if "error" in state:
        raise BenchError(f"the data-wait feed failed: {state['error']}")
    if thread.is_alive():
        raise BenchError("the data-wait feed did not finish")
    shares = [r["wait_seconds"] / r["seconds"] for r in result.ranks if r["seconds"] > 0]
    worst = max(result.ranks, key=lambda r: r["wait_seconds"] / r["seconds"] if r["seconds"] > 0 else 0)
    return {"wait_share": max(shares), "wait_shares": shares, "wait_seconds": worst["wait_seconds"],
            "seconds": worst["seconds"], "consumed_rows": result.rows,
            "batches": [r["batches"] for r in result.ranks],
            # the worst rank's waits as its loop saw them: first batch, steady state, end of the epoch
            "wait_first": worst["wait_first"], "wait_steady": worst["wait_steady"], "wait_end": worst["wait_end"],
            "wait_steady_max": worst["wait_steady_max"], "waits_over_1ms": worst["waits_over_1ms"],
            # the broker's queue for the ranks, sampled while they consumed: empty = the feed was behind
            "queue_samples": len(queue),
            "queue_empty_share": sum(1 for q in queue if q == 0) / len(queue) if queue else None,
            "queue_median": sorted(queue)[len(queue) // 2] if queue else None}


class QueueSampler(threading.Thread):
    """Samples how many batches of ``stream`` wait in the broker for the ranks, every 100 ms, while the feed runs."""

    def __init__(self, broker, stream: str, interval: float = 0.1):
        super().__init__(daemon=True, name="queue-sampler")
        self.broker, self.stream, self.interval = broker, stream, interval
        self.samples: list[int] = []
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            try:
                epochs = self.broker.stats(1.0)["streams"][self.stream]["epochs"]
            except Exception:
                continue
            live = [e for e in epochs.values() if not e.get("ended")]
            if live and not live[0].get("closed"):      # once closed, an empty queue is the epoch's end
                self.samples.append(int(live[0].get("queued", 0)))

    def stop(self) -> list[int]:
        self._halt.set()
        self.join(5)
        return self.samples


def _buffered(broker) -> int:
    try:
        return int(broker.stats(2.0)["broker"].get("buffered_bytes", 0))
    except Exception:
        return 0


# ---- the section ------------------------------------------------------------------------------------------



class DataWaitSection(Section[DataWait]):
    """Figure 4: the ranks' data-wait while the feed outpaces their compute."""

    name, title, figure, spark = "wait", "4. data-wait", "4", "frame"

    def measure(self, ctx: Context) -> DataWait:
        assert ctx.dataset is not None
        e2e = ctx.results.get("e2e")
        rate = e2e.sparkbus.med("rows_per_s") if e2e else None
        return run(ctx.children, ctx.spark, ctx.df, ctx.dataset.rows, ctx.sizes, ctx.work, rate, ctx.log)

    def figures(self, run: Run, result: DataWait) -> list[Figure]:
        """The worst rank's data-wait, % of the epoch: steps granted by the broker (the figure), then even=False and
        steps agreed over MPI against it."""
        granted = result.series.figure("wait", "data-wait, steps granted", "wait_share", "%", scale=100)
        return [granted, *(series.figure("wait", name, "wait_share", "%", granted, 100)
                           for name, series in (("data-wait, even=False", result.diagnostic),
                                                ("data-wait, steps agreed over MPI", result.agreed))
                           if series is not None and series.runs)]

    def tables(self, run: Run, result: DataWait) -> list[Table]:
        anchor = result.series.med("wait_share")
        rows = [[label, median([max(x["batches"]) for x in s.runs]), s.med("seconds"), s.med("wait_seconds"),
                 s.med("wait_share") * 100, per(s.med("wait_share"), anchor), s.med("wait_first"), s.med("wait_steady"),
                 s.med("wait_end"), s.med("wait_steady_max") * 1e3, s.med("waits_over_1ms"),
                 s.med("queue_empty_share") * 100, s.med("queue_median")]
                for label, s in (("even, steps granted by the broker (the figure)", result.series),
                                 ("even, steps agreed over MPI", result.agreed),
                                 ("even=False (diagnostic)", result.diagnostic)) if s is not None and s.runs]
        basis = f"half the end-to-end rate, {result.from_rate:,.0f} rows/s" if result.from_rate else "a default"
        return [Table(f"2 ranks computing {result.compute * 1e3:.1f} ms a batch of {BATCH_SIZE} rows ({basis}); "
                      f"{result.rows:,} rows through --max-buffer {MAX_BUFFER}",
                      ["ranks", "batches / rank", "epoch (s)", "waited (s)", "share of the epoch (%)",
                       "share / granted's", "in next(): first (s)", "between (s)", "last (s)",
                       "longest between (ms)", "next() > 1 ms", "broker queue empty (%)", "broker queue (median)"],
                      rows, ["waited, share: BatchStream's own (worst rank); in next(): its loop timing its calls; "
                             "broker queue: sampled every 100 ms while the feed ran (empty: the feed was behind)"])]

    def json(self, run: Run, result: DataWait) -> dict:
        return {"datawait": {"compute": result.compute, "rows": result.rows, "runs": result.series.runs,
                             "agreed_over_mpi": result.agreed.runs if result.agreed else [],
                             "diagnostic_even_false": result.diagnostic.runs if result.diagnostic else []}}
