"""Figure 13, language-model data (issue 26 §6): ragged token rows with a long-tailed length, made in Spark, fed
through one broker to 2 ranks (``rank.py --lengths tokens``) in several batching modes (:data:`MODES`), ``--reps``
epochs each, interleaved: real tokens/s, the padding share (``padding.padding_share``'s) and the straggler ratio per
global step (the largest rank's tokens over the smallest's); the ratio error per window of ``feed_mixture`` of two
sources at 0.7/0.3; and, as the anchor, Hugging Face ``Dataset.from_spark`` of the same DataFrame, each rank reading
its shard (``split_dataset_by_node``). Both are warmed up first on the same sample of every partition.
benchmarks/README.md, section 13, says more.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.bench.figures import Figure, figure

from .common import BenchError, Children, run_ranks
from .sections import Context, Run, Section
from .spark_data import warm_up_feed

RANKS = 2
PARTITIONS = 4
BATCH_SIZE = 32                  # rows a batch (the fixed-rows modes, the anchor's batches)
BATCH_TOKENS = 4096              # tokens a batch (the token-budget modes): about BATCH_SIZE rows of the mean length
BUCKET_WINDOW = 64               # bucket_by's window, in batches' worth of rows
# coordinated buckets' bounds (lengths of "tokens"): steps of 1.5 x from 32 to 1,024, then the long tail
BUCKET_BOUNDS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
LENGTH_MU, LENGTH_SIGMA, LENGTH_MAX = 4.6, 1.0, 4096     # lognormal document lengths: mean ~165, median ~100
MIX_WEIGHTS = {"web": 0.7, "code": 0.3}
MIX_WINDOW = 100                 # rows per window of exact counts (70/30)
MAX_BUFFER = "256MiB"
_runs = itertools.count()


BUCKET = {"bucket_by": "tokens", "bucket_window": BUCKET_WINDOW}
# Each way of cutting the epoch into batches, its feed arguments; the straggler ratio's axis: no bucketing, today's
# per-partition bucketing, coordinated buckets across ranks
MODES = {"batch_size": {"batch_size": BATCH_SIZE},
         "batch_size + bucket_by": {"batch_size": BATCH_SIZE, **BUCKET},
         "batch_size + bucket_bounds": {"batch_size": BATCH_SIZE, **BUCKET, "bucket_bounds": BUCKET_BOUNDS},
         "batch_tokens": {"batch_size": 4 * BATCH_SIZE, "batch_tokens": BATCH_TOKENS},
         "batch_tokens + bucket_by": {"batch_size": 4 * BATCH_SIZE, "batch_tokens": BATCH_TOKENS, **BUCKET}}


def docs_rows(quick: bool) -> int:
    return 16_000 if quick else 200_000


@dataclass
class Lm:
    """Figure 13, filled as it goes (a failure keeps what was measured)."""

    rows: int = 0
    tokens: int = 0
    build_seconds: float = 0.0
    modes: dict[str, list[dict]] = field(default_factory=dict)     # mode -> its repetitions (mode_result's)
    mixture: dict[str, Any] | None = None       # windows, the plan's counts, the largest error (rows and %)
    hf: list[dict[str, Any]] = field(default_factory=list)    # per rep: from_spark's first and last batch, ...
    hf_missing: str | None = None                # why the anchor was not measured


# ---- the data ---------------------------------------------------------------------------------------------------

def _generator(mu: float, seed: int):
    def generate(batches):
        import numpy as np
        import pyarrow as pa

        for batch in batches:
            ids = batch.column(0)
            if not len(ids):
                continue
            rng = np.random.default_rng([seed, int(ids[0].as_py())])
            n = len(ids)
            lengths = np.clip(rng.lognormal(mu, LENGTH_SIGMA, n), 1, LENGTH_MAX).astype(np.int32)
            offsets = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(lengths, out=offsets[1:])
            values = rng.integers(0, 32_000, int(offsets[-1]), dtype=np.int32)
            tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
            yield pa.RecordBatch.from_arrays([ids, tokens], ["id", "tokens"])
    return generate


def docs_frame(spark: Any, rows: int, mu: float = LENGTH_MU, seed: int = 26, partitions: int = PARTITIONS) -> Any:
    """A DataFrame of ``rows`` documents: ``id`` long, ``tokens`` array<int> of lognormal length (mean
    ``exp(mu + sigma^2 / 2)``, at most :data:`LENGTH_MAX`), the same rows whenever Spark computes it (seeded by
    the ids), as ``feed_mixture`` needs of a source."""
    return spark.range(0, rows, numPartitions=partitions).mapInArrow(_generator(mu, seed), "id long, tokens array<int>")


# ---- the run ----------------------------------------------------------------------------------------------------

def run(children: Children, spark: Any, quick: bool, reps: int, work: Path, timeout: float, log=print,
        out: Lm | None = None) -> Lm:
    """``reps`` epochs of every mode (interleaved), the mixture's, then ``reps`` of the anchor, into one set of 2
    ranks; filled into ``out``."""
    from sparkbus.feeder import feed
    from sparkbus.feeder.mixture import feed_mixture, window_counts

    out = Lm() if out is None else out
    started = time.monotonic()
    df = docs_frame(spark, docs_rows(quick)).cache()
    sources = {"web": docs_frame(spark, docs_rows(quick) // 4, seed=1, partitions=2),
               "code": docs_frame(spark, docs_rows(quick) // 8, mu=LENGTH_MU + 0.5, seed=2, partitions=2)}
    out.rows = df.count()
    out.build_seconds = time.monotonic() - started
    log(f"  {out.rows:,} documents made and cached in {out.build_seconds:.1f} s")
    try:
        import datasets  # noqa: F401
    except ImportError as exc:
        out.hf_missing = f"Hugging Face datasets is not installed ({exc}): pip install 'sparkbus[bench]'"
        log(f"  the anchor is not measured: {out.hf_missing}")
    broker = children.broker(MAX_BUFFER)
    stream = f"lm-{next(_runs)}"
    # every Python worker that will feed imports sparkbus first (a sample of every partition, a stream no rank reads)
    fraction = min(1.0, 16 * BATCH_SIZE / out.rows)
    warm_up = df.sample(fraction=fraction, seed=1)      # the anchor's warm-up reads the same sample
    warm_up_feed(df, out.rows, broker.feed, f"{stream}-warm-up", BATCH_SIZE, fraction, timeout, columns=["tokens"],
                 ragged=["tokens"])
    ranks_out = work / f"ranks-{stream}"
    hf_cache = work / f"hf-{stream}"
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")        # nothing downloaded; the ranks inherit it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    clocks: dict[str, float] = {}

    def wait_done(epoch: int) -> None:
        from sparkbus.launch.processes import wait_for

        wait_for(lambda: all((ranks_out / f"done-rank{r}-{epoch}").exists() for r in range(RANKS)), timeout,
                 f"the ranks to finish epoch {epoch}", interval=0.002)

    names = list(MODES)
    plan = [(rep, rep * len(names) + i, mode) for rep in range(reps)            # each rep starts one mode later
            for i, mode in enumerate(names[rep % len(names):] + names[:rep % len(names)])]
    mix_epoch = len(plan)

    def start() -> None:
        for _, epoch, mode in plan:
            clocks[f"epoch {epoch}"] = time.time()
            feed(df, broker.feed, stream=stream, epoch=epoch, columns=["tokens"], ragged=["tokens"], timeout=timeout,
                 **MODES[mode])
            wait_done(epoch)
        log(f"  {len(MODES)} modes x {reps} fed and received ({time.time() - clocks['epoch 0']:.1f} s)")
        clocks["mixture"] = time.time()
        feed_mixture(sources, broker.feed, weights=MIX_WEIGHTS, stream=stream, first_epoch=mix_epoch,
                     rows_per_epoch=docs_rows(quick) // 2, window=MIX_WINDOW, slot_column="slot", seed=26,
                     batch_size=BATCH_SIZE, columns=["tokens"], ragged=["tokens"], timeout=timeout)
        wait_done(mix_epoch)
        log(f"  the mixture fed and received ({time.time() - clocks['mixture']:.1f} s)")
        if out.hf_missing is None:
            from datasets import Dataset

            warm = time.time()
            Dataset.from_spark(warm_up, cache_dir=str(hf_cache / "warm-up"))     # as sparkbus's warm-up feed
            log(f"  from_spark warmed up ({time.time() - warm:.1f} s)")
            for rep in range(reps):
                clocks[f"hf {rep}"] = time.time()
                ds = Dataset.from_spark(df, cache_dir=str(hf_cache / f"timed-{rep}"))
                clocks[f"hf written {rep}"] = time.time()
                go = ranks_out / f"hf-go-{rep}"
                go.with_suffix(".tmp").write_text(json.dumps([f["filename"] for f in ds.cache_files]))
                os.replace(go.with_suffix(".tmp"), go)

    args = ["--ranks", broker.ranks, "--stream", stream, "--lengths", "tokens", "--epochs", str(mix_epoch + 1),
            "--mixture-epoch", str(mix_epoch), "--hf-batch-size", str(BATCH_SIZE), "--hf-reps", str(reps),
            "--timeout", str(timeout),
            *(["--hf-go", str(ranks_out / "hf-go")] if out.hf_missing is None else [])]
    try:
        ranks, _ = run_ranks(children, f"ranks-{stream}", RANKS, "rank.py", ranks_out, args, start,
                             timeout * (len(plan) + 2 + reps))
    finally:
        children.discard(broker)
        shutil.rmtree(hf_cache, ignore_errors=True)
        shutil.rmtree(ranks_out, ignore_errors=True)
        df.unpersist()
    out.tokens = sum(b[1] for r in ranks for b in r["epochs"][0]["batches"])
    for rep, epoch, mode in plan:
        m = mode_result(mode, [r["epochs"][epoch] for r in ranks], clocks[f"epoch {epoch}"], out.rows)
        if m["tokens"] != out.tokens:
            raise BenchError(f"mode {mode}: the ranks got {m['tokens']:,} tokens of {out.tokens:,}")
        out.modes.setdefault(mode, []).append(m)
        log(f"  {mode}, rep {rep + 1}/{reps}: {m['tokens_per_s']:,.0f} real tokens/s, padding {m['padding']:.1f} %, "
            f"{m['batches']} batches, straggler ratio mean {m['straggler']:.2f} p90 {m['straggler_p90']:.2f}")
    names = sorted(MIX_WEIGHTS)
    counts = window_counts([MIX_WEIGHTS[n] for n in names], MIX_WINDOW)
    out.mixture = mixture_errors([r["epochs"][mix_epoch] for r in ranks], dict(zip(names, counts)))
    log(f"  mixture {MIX_WEIGHTS} per window of {MIX_WINDOW}: {out.mixture['windows']} windows, largest error "
        f"{out.mixture['max_error_rows']} rows")
    for rep in range(reps if out.hf_missing is None else 0):
        hf = [r["hf"][rep] for r in ranks]
        if sum(h["rows"] for h in hf) != out.rows or sum(h["tokens"] for h in hf) != out.tokens:
            raise BenchError(f"from_spark's ranks read {sum(h['rows'] for h in hf)} rows of {out.rows}")
        t0 = clocks[f"hf {rep}"]
        out.hf.append({"first": min(h["t_first"] for h in hf) - t0, "last": max(h["t_last"] for h in hf) - t0,
                       "written": clocks[f"hf written {rep}"] - t0, "ranks": hf})
        log(f"  from_spark, rep {rep + 1}/{reps}: first batch {out.hf[-1]['first']:.2f} s, last "
            f"{out.hf[-1]['last']:.2f} s (written after {out.hf[-1]['written']:.2f} s); sparkbus batch_size: "
            f"{out.modes['batch_size'][rep]['first']:.2f} s, {out.modes['batch_size'][rep]['seconds']:.2f} s")
    return out


def mode_result(name: str, epochs: list[dict], t0: float, rows: int) -> dict:
    """One mode's figures from every rank's record of its epoch: ``seconds`` from the feed's start to the last batch
    at any rank (``first``: to the first), the padding share (%) and the straggler ratio per global step (mean and
    p90): the largest rank's tokens over the smallest's."""
    got = sum(b[0] for e in epochs for b in e["batches"])
    if got != rows:
        raise BenchError(f"mode {name}: the ranks got {got} rows of {rows}")
    # the padding share: each batch padded to its longest row (padding_share takes row lengths; here per batch
    # its rows, its tokens and its longest row are enough)
    slots = sum(b[0] * b[2] for e in epochs for b in e["batches"])
    tokens = sum(b[1] for e in epochs for b in e["batches"])
    steps = min(len(e["batches"]) for e in epochs)
    straggler = [max(e["batches"][i][1] for e in epochs) / max(1, min(e["batches"][i][1] for e in epochs))
                 for i in range(steps)] or [float("nan")]
    seconds = max(e["t_last"] for e in epochs) - t0
    return {"tokens": tokens, "seconds": seconds, "first": min(e["t_first"] for e in epochs) - t0,
            "tokens_per_s": tokens / seconds, "batches": sum(len(e["batches"]) for e in epochs),
            "padding": (1.0 - tokens / slots if slots else 0.0) * 100, "straggler": float(np.mean(straggler)),
            "straggler_p90": float(np.percentile(straggler, 90))}


def mixture_errors(epochs: list[dict], plan: dict[str, int]) -> dict[str, Any]:
    """Per whole window of slots, each source's count as the ranks received it against the plan's."""
    window = sum(plan.values())
    counts: dict[int, dict[str, int]] = {}
    for e in epochs:
        for source, slot in zip(e["sources"], e["slots"]):
            per = counts.setdefault(slot // window, {})
            per[source] = per.get(source, 0) + 1
    whole = [w for w, per in counts.items() if sum(per.values()) == window]
    errors = [max(abs(counts[w].get(s, 0) - n) for s, n in plan.items()) for w in whole]
    received = sum(len(e["slots"]) for e in epochs)
    return {"window": window, "plan": plan, "windows": len(whole), "rows": received,
            "slots_once": len({s for e in epochs for s in e["slots"]}) == received,
            "max_error_rows": max(errors, default=0), "errors": errors}


# ---- the section ------------------------------------------------------------------------------------------------

class LmSection(Section[Lm]):
    """Figure 13: language-model data: token budgets, bucketing, the straggler ratio, a mixture, from_spark."""

    name, title, spark = "lm", "13. language-model data", "session"

    def measure(self, ctx: Context) -> Lm:
        out = ctx.results[self.name] = Lm()
        return run(ctx.children, ctx.spark, ctx.quick, ctx.sizes.reps, ctx.work,
                   min(ctx.sizes.timeout, 120.0), log=ctx.log, out=out)

    def figures(self, run: Run, result: Lm) -> list[Figure]:
        """Per mode, real tokens/s, the padding share and the mean straggler ratio against ``batch_size`` rows
        (and the p90); the mixture's largest error per window (% of the window); sparkbus's first and last batch
        (mode ``batch_size``) against from_spark's."""
        out: list[Figure] = []
        plain = result.modes.get("batch_size")
        if not plain:
            return out
        anchors: dict[str, Figure] = {}
        for name, reps in result.modes.items():
            for what, unit, key in (("real tokens/s", "tokens/s", "tokens_per_s"), ("padding share", "%", "padding"),
                                    ("straggler ratio", "x", "straggler")):
                f = figure("lm", f"{what}, {name}", [m[key] for m in reps], unit, anchors.get(what))
                anchors.setdefault(what, f)
                out.append(f)
            out.append(figure("lm", f"straggler ratio p90, {name}", [m["straggler_p90"] for m in reps], "x"))
        if result.mixture:
            out.append(figure("lm", "mixture ratio error per window",
                              [result.mixture["max_error_rows"] / result.mixture["window"] * 100], "%"))
        if result.hf:
            first = figure("lm", "from_spark first batch", [h["first"] for h in result.hf], "s")
            last = figure("lm", "from_spark last batch", [h["last"] for h in result.hf], "s")
            out += [first, last, figure("lm", "sparkbus first batch", [m["first"] for m in plain], "s", first),
                    figure("lm", "sparkbus last batch", [m["seconds"] for m in plain], "s", last)]
        return out

    def json(self, run: Run, result: Lm) -> dict:
        return {"lm": {"rows": result.rows, "tokens": result.tokens, "build_seconds": result.build_seconds,
                       "modes": result.modes,
                       "mixture": result.mixture, "hf": result.hf, "hf_missing": result.hf_missing}}
