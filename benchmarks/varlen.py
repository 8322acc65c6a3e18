"""Figure 7, variable-length columns end to end: binary rows and int arrays of varying length vs fixed width.

Three cached DataFrames of the benchmark's own ``local[2]`` session, made by numpy inside Spark's Python workers
(``spark_data.kind_frame``), each ``Sizes.varlen_rows`` rows of ``id`` long plus one column of 64 KiB a row:

* ``ints``: ``array<int>[16384]``, every row as long: the fixed-width path (a ``[n, 16384]`` int32 array);
* ``binary``: ``binary`` of 65,536 bytes a row;
* ``varints``: ``array<int>`` of 1..32,767 elements, 16,384 on average (64 KiB).

Each is fed by ``feeder.feed`` (``batch_size`` 1024 rows, ``max_batch_bytes`` 1 MiB: about 16 rows a batch)
through one broker to 2 ranks under mpiexec (``rank_consumer.py --touch``: the ranks add up each column's bytes,
numpy ``nbytes`` or a ``RaggedColumn``'s values and offsets, without per-row Python). Figures: MB/s of payload
(the id's and the values' bytes, offsets not counted) from the call of ``feed`` to the last batch at any rank, and
the ratios binary / ints and varints / ints of the medians, each of runs interleaved with the ``ints`` runs it is
compared with (the ``ints`` frame stays cached; ``binary``, then ``varints``, is cached beside it, so at most two
are in Spark's memory at once). Rows/s would say the same (the same rows, 64 KiB each on average).

Each feed is followed by Spark's Arrow hand-off of the same frame (``mapInArrow`` + drop), for context: Spark
itself hands binary rows and int arrays to Python at different costs.

Then, once: the padding share of batches padded to their longest row, in Spark's order and with
``bucket_by="tokens"`` (``padding.measure``: one epoch each, read back by one ``BatchStream`` without MPI) on
20,000 ``tokens`` rows (1..127 ints) in batches of 64.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.wire.errors import FeedError

from . import end_to_end, spark_data
from .cluster import not_measured
from .common import BenchError, Children, MiB, Sizes
from .end_to_end import RANKS, Series
from .padding import PaddingShares
from .report import num, table
from .sections import Context, Run, Section, Target, at_least, at_most

BASELINE = "ints"
COMPARED = ("binary", "varints")
PARTITIONS = 4
BATCH_SIZE = 1024
OPTIONS = {"max_batch_bytes": MiB}
MAX_BUFFER = "256MiB"
# The padding share (benchmarks/padding.py, its defaults): tokens rows, batches of 64, bucket_by window 64
PADDING_ROWS, PADDING_BATCH, PADDING_WINDOW = 20_000, 64, 64
_streams = itertools.count()


@dataclass
class Pair:
    """The interleaved repetitions of one compared kind and of the fixed-width baseline."""

    baseline: Series
    compared: Series


@dataclass
class Varlen:
    """Figure 7, filled as it goes (a failure keeps what was measured)."""

    rows: int
    kinds: dict[str, dict] = field(default_factory=dict)      # kind -> how Spark stores it
    pairs: dict[str, Pair] = field(default_factory=dict)      # compared kind -> its runs and the baseline's
    refused: dict[str, str] = field(default_factory=dict)     # kind (or "padding") -> the feeder's error
    padding: PaddingShares | None = None


def run(children: Children, spark: Any, sizes: Sizes, work: Path, log=print, out: Varlen | None = None) -> Varlen:
    """Both comparisons and the padding share, filled into ``out`` as it goes (a new record if None). A kind the
    feeder refuses (before protocol v4) is not measured; the others are."""
    out = Varlen(sizes.varlen_rows) if out is None else out
    broker = children.broker(MAX_BUFFER)
    frames: dict[str, Any] = {}
    try:
        frames[BASELINE] = _prepare(spark, BASELINE, sizes, broker, out, log)
        for kind in COMPARED:
            try:
                frames[kind] = _prepare(spark, kind, sizes, broker, out, log)
            except (TypeError, FeedError) as exc:       # a feeder without variable-length columns (protocol < 4)
                out.refused[kind] = str(exc).split("failed: ")[-1][:300]
                log(f"  {kind}: not measured, the feeder refused it: {out.refused[kind]}")
                continue
            pair = out.pairs[kind] = Pair(Series(BASELINE), Series(kind))
            for rep in range(sizes.reps):
                order = (BASELINE, kind) if rep % 2 == 0 else (kind, BASELINE)
                for name in order:
                    result = _feed(children, broker, frames[name], out.kinds[name], work, sizes)
                    (pair.baseline if name == BASELINE else pair.compared).runs.append(result)
                b, c = pair.baseline.runs[-1], pair.compared.runs[-1]
                log(f"  {kind} vs {BASELINE}, rep {rep + 1}/{sizes.reps}: {c['mb_per_s']:,.0f} vs "
                    f"{b['mb_per_s']:,.0f} MB/s ({c['mb_per_s'] / b['mb_per_s']:.2f} x); first batch "
                    f"{c['first']:.2f} vs {b['first']:.2f} s")
            frames.pop(kind).unpersist(blocking=True)
        _padding(spark, broker, sizes, out, log)
    finally:
        for df in frames.values():
            df.unpersist()
        children.discard(broker)
    return out


def _padding(spark: Any, broker, sizes: Sizes, out: Varlen, log) -> None:
    """The padding share with and without ``bucket_by`` (``padding.measure``) on a ``tokens`` frame, one run."""
    from . import padding

    df, info = spark_data.kind_frame(spark, "tokens", PADDING_ROWS, PARTITIONS)
    try:
        shares = padding.measure(df, "tokens", batch_size=PADDING_BATCH, bucket_window=PADDING_WINDOW,
                                 feed_address=broker.feed, ranks_address=broker.ranks, stream="varlen-padding",
                                 timeout=min(sizes.timeout, 120.0))
    except (TypeError, FeedError) as exc:           # a feeder without ragged= and bucket_by= (protocol < 4)
        out.refused["padding"] = str(exc).split("failed: ")[-1][:300]
        log(f"  padding: not measured, the feeder refused it: {out.refused['padding']}")
        return
    finally:
        df.unpersist()
    out.padding = shares
    log(f"  padding share, {shares.rows:,} rows of tokens in batches of {shares.batch_size}: Spark's order "
        f"{shares.plain:.1%}, bucket_by (window {shares.bucket_window}) {shares.bucketed:.1%}: {shares.ratio:.2f} x")


def _prepare(spark: Any, kind: str, sizes: Sizes, broker, out: Varlen, log) -> Any:
    """Cache ``kind``'s frame, scan it once and feed a small sample of every partition that no rank reads."""
    df, info = spark_data.kind_frame(spark, kind, sizes.varlen_rows, PARTITIONS)
    out.kinds[kind] = info
    spark_data.arrow_limit(df)
    try:
        spark_data.warm_up_feed(df, info["rows"], broker.feed, f"varlen-warm-up-{kind}", batch_size=4)
    except Exception:
        df.unpersist()
        raise
    log(f"  {kind} ({spark_data.KINDS[kind]}): {info['rows']:,} rows, {info['payload_bytes'] / 1e6:,.0f} MB cached "
        f"({info['cached_memory_bytes'] / 1e6:,.0f} MB in memory, {info['cached_disk_bytes'] / 1e6:,.0f} MB on "
        "disk) and warmed up")
    return df


def _feed(children: Children, broker, df: Any, info: dict, work: Path, sizes: Sizes) -> dict:
    stream = f"varlen-{next(_streams)}"

    def start():
        return spark_data.timed_feed(df, broker.feed, stream, BATCH_SIZE, min(sizes.timeout, 120.0), **OPTIONS)

    result = end_to_end.run_fed_ranks(children, [broker], stream, start, info["rows"], RANKS, work, sizes.timeout,
                                      touch=True)
    result["payload_bytes"] = info["payload_bytes"]
    result["mb_per_s"] = info["payload_bytes"] / result["last"] / 1e6
    # Spark's own hand-off of the same frame right after (mapInArrow + drop): Spark turns array<int> rows into
    # Arrow element by element and binary rows with one copy each, so the kinds differ before sparkbus starts
    seconds, _ = spark_data.arrow_limit(df)
    result["limit_mb_per_s"] = info["payload_bytes"] / seconds / 1e6
    if not result["dropped_rows"] and result["touched_bytes"] < info["payload_bytes"]:     # every row reached a loop
        raise BenchError(f"stream {stream}: the ranks saw {result['touched_bytes']:,} bytes of "
                         f"{info['payload_bytes']:,}")
    return result


def ratio(pair: Pair) -> float:
    """compared MB/s / baseline MB/s, medians of the repetitions."""
    return pair.compared.med("mb_per_s") / pair.baseline.med("mb_per_s")


# ---- the section ------------------------------------------------------------------------------------------

VARLEN_RATIOS = {"binary": 0.9, "varints": 0.8}  # compared kind / the fixed-width path at the same bytes, at least
PADDING_RATIO = 0.3                              # padding share with bucket_by / in Spark's order, at most
VARLEN_LABELS = {"binary": "binary rows of 64 KiB, end to end, vs the fixed-width path at the same bytes",
                 "varints": "variable-length int arrays averaging 64 KiB, end to end, vs the fixed-width path"}


class VarlenSection(Section[Varlen]):
    """Figure 7: binary and variable-length int columns vs the fixed-width path, and the padding share."""

    name, title, figure, spark = "varlen", "7. variable-length columns", "7", "session"

    def measure(self, ctx: Context) -> Varlen:
        out = ctx.results[self.name] = Varlen(ctx.sizes.varlen_rows)
        return run(ctx.children, ctx.spark, ctx.sizes, ctx.work, log=ctx.log, out=out)

    def targets(self, run: Run, result: Varlen | None) -> list[Target]:
        out = []
        for kind, goal in VARLEN_RATIOS.items():
            pair = result.pairs.get(kind) if result else None
            goal_text = f">= {goal} x"
            if pair and pair.compared.runs and pair.baseline.runs:
                r = ratio(pair)
                out.append(Target(VARLEN_LABELS[kind], goal_text, f"{r:.2f} x ({pair.compared.med('mb_per_s'):,.0f} "
                                  f"vs {pair.baseline.med('mb_per_s'):,.0f} MB/s)",
                                  at_least(r, goal)))
            else:
                out.append(Target(VARLEN_LABELS[kind], goal_text, not_measured(result, kind), None))
        what = "padding share with length bucketing (bucket_by, window 64) vs Spark's order, batches of 64"
        pad = result.padding if result else None
        if pad:
            out.append(Target(what, f"<= {PADDING_RATIO} x", f"{pad.ratio:.2f} x ({pad.bucketed:.1%} vs "
                              f"{pad.plain:.1%})", at_most(pad.ratio, PADDING_RATIO)))
        else:
            out.append(Target(what, f"<= {PADDING_RATIO} x", not_measured(result, "padding"), None))
        return out

    def markdown(self, run: Run, result: Varlen) -> list[str]:
        if not (result.pairs or result.refused):
            return []
        v = result
        parts = ["", "## 7. Variable-length columns", "",
                 f"{v.rows:,} rows of `id` long plus one column of 64 KiB a row, cached in the benchmark's Spark "
                 f"local[2] session, fed by `feeder.feed` (batch_size {BATCH_SIZE}, max_batch_bytes 1 MiB) "
                 "through one broker to 2 ranks that add up each column's bytes (numpy `nbytes`; a `RaggedColumn`'s "
                 "values and offsets) without per-row Python. MB/s = payload (id and values, not offsets) / time from "
                 "the call of `feed` to the last batch at any rank. Each compared kind runs interleaved with "
                 f"`{BASELINE}` (the fixed-width path), alternating which goes first.", ""]
        rows = []
        for kind, pair in v.pairs.items():
            if not (pair.compared.runs and pair.baseline.runs):
                continue
            b, c = pair.baseline, pair.compared
            rows.append([f"`{kind}`: {spark_data.KINDS[kind]}", num(c.med("mb_per_s")), num(c.med("rows_per_s")),
                         num(c.med("first"), ".2f"), num(b.med("mb_per_s")), f"**{ratio(pair):.2f}**",
                         f"{num(c.med('limit_mb_per_s'))} / {num(b.med('limit_mb_per_s'))}",
                         f"{num(c.med('mb_per_s') / c.med('limit_mb_per_s'), '.2f')} / "
                         f"{num(b.med('mb_per_s') / b.med('limit_mb_per_s'), '.2f')}"])
        parts.append(table(["kind", "MB/s", "rows/s", "first batch (s)",
                             f"`{BASELINE}` ({spark_data.KINDS[BASELINE]}) MB/s, same runs", "ratio",
                             f"Spark's hand-off MB/s: kind / `{BASELINE}`",
                             f"sparkbus / hand-off: kind / `{BASELINE}`"], rows))
        parts += ["", "The hand-off columns (Spark's `mapInArrow` + drop of the same frame, right after each feed) are "
                  "context, not targets: Spark turns `array<int>` rows into Arrow element by element and binary rows "
                  "with one copy each, so the kinds differ before sparkbus starts."]
        pad = v.padding
        if pad:
            parts += ["", f"Padding share (`benchmarks/padding.py`'s `measure`): {pad.rows:,} `tokens` rows "
                      f"({spark_data.KINDS['tokens']}) in batches of {pad.batch_size}, each padded to its longest row: "
                      f"**{pad.plain:.1%}** of the slots are padding in Spark's order ({pad.batches[0]} batches), "
                      f"**{pad.bucketed:.1%}** with `bucket_by=\"tokens\", bucket_window={pad.bucket_window}` "
                      f"({pad.batches[1]} batches): **{pad.ratio:.2f} x**."]
        for kind, why in v.refused.items():
            parts += ["", f"`{kind}` ({spark_data.KINDS.get(kind, 'the padding share')}) was not measured: the feeder "
                      f"refused it: {why}"]
        return parts

    def json(self, run: Run, result: Varlen) -> dict:
        return {"varlen": {"rows": result.rows, "kinds": result.kinds, "refused": result.refused,
                           "padding": {**result.padding.as_dict(), "kind": "tokens"} if result.padding else None,
                           "pairs": {k: {"baseline": p.baseline.runs, "compared": p.compared.runs}
                                     for k, p in result.pairs.items()}}}

    def plots(self, result: Varlen) -> bool:
        return any(p.compared.runs for p in result.pairs.values())

    def plot(self, ax, run: Run, result: Varlen) -> None:
        pairs = [(k, p) for k, p in result.pairs.items() if p.compared.runs and p.baseline.runs]
        labels, values, colors = [], [], []
        for kind, pair in pairs:
            labels += [f"{BASELINE}\n(vs {kind})", kind]
            values += [pair.baseline.med("mb_per_s"), pair.compared.med("mb_per_s")]
            colors += ["#999999", "#2ca02c"]
        bars = ax.bar(labels, values, color=colors)
        for i, (_, pair) in enumerate(pairs):
            bar = bars[2 * i + 1]
            ax.annotate(f"{ratio(pair):.2f} x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("MB/s of payload to the ranks")
        ax.set_title("64 KiB rows: variable-length vs fixed width", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
        ax.margins(y=0.2)
