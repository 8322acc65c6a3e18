"""Figure 7, variable-length columns end to end: rows of 64 KiB as ``binary`` and as ``array<int>`` of varying length
(``varints``) against the fixed-width path (``ints``, ``array<int>[16384]``), each fed through one broker to 2 ranks
that add up every column's bytes, interleaved with the ``ints`` runs it is compared with; then the padding share
with and without ``bucket_by`` (``padding.measure``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from sparkbus.bench.e2e import hand_off
from sparkbus.bench.figures import Figure, figure

from . import padding, spark_data
from .common import BenchError, MiB
from .end_to_end import RANKS, Series, run_fed_ranks
from .sections import Context, Run, Section

BASELINE = "ints"
COMPARED = ("binary", "varints")
PARTITIONS = 4
BATCH_SIZE = 1024
# The padding share (padding.measure): tokens rows, batches of 64, bucket_by window 64
PADDING_ROWS, PADDING_BATCH, PADDING_WINDOW = 20_000, 64, 64
_streams = itertools.count()


@dataclass
class Varlen:
    """Figure 7, filled as it goes (a failure keeps what was measured)."""

    pairs: dict[str, dict[str, Series]] = field(default_factory=dict)    # compared kind -> its runs, the baseline's
    padding: padding.PaddingShares | None = None


def run(ctx: Context, out: Varlen) -> Varlen:
    """Both comparisons, then the padding share, filled into ``out`` as it goes."""
    sizes = ctx.sizes
    broker = ctx.children.broker("256MiB")
    frames: dict[str, tuple[Any, dict]] = {}
    try:
        for kind in (BASELINE, *COMPARED):
            df, info = frames[kind] = spark_data.kind_frame(ctx.spark, kind, sizes.varlen_rows, PARTITIONS)
            hand_off(df)                       # the first full scan of a cache is slower than later ones
            spark_data.warm_up_feed(df, info["rows"], broker.feed, f"varlen-warm-up-{kind}", batch_size=4)
            ctx.log(f"  {kind} ({spark_data.KINDS[kind]}): {info['rows']:,} rows, {info['payload_bytes'] / 1e6:,.0f} "
                    f"MB cached ({info['cached_disk_bytes'] / 1e6:,.0f} MB on disk) and warmed up")
            if kind == BASELINE:
                continue
            pair = out.pairs[kind] = {BASELINE: Series(BASELINE), kind: Series(kind)}
            for rep in range(sizes.reps):
                for name in (BASELINE, kind) if rep % 2 == 0 else (kind, BASELINE):
                    pair[name].runs.append(_feed(ctx, broker, *frames[name]))
                b, c = pair[BASELINE].runs[-1], pair[kind].runs[-1]
                ctx.log(f"  {kind} vs {BASELINE}, rep {rep + 1}/{sizes.reps}: {c['mb_per_s']:,.0f} vs "
                        f"{b['mb_per_s']:,.0f} MB/s; first batch {c['first']:.2f} vs {b['first']:.2f} s")
            frames.pop(kind)[0].unpersist(blocking=True)
        df, _ = spark_data.kind_frame(ctx.spark, "tokens", PADDING_ROWS, PARTITIONS)
        try:
            out.padding = shares = padding.measure(
                df, "tokens", batch_size=PADDING_BATCH, bucket_window=PADDING_WINDOW, feed_address=broker.feed,
                ranks_address=broker.ranks, stream="varlen-padding", timeout=min(sizes.timeout, 120.0))
        finally:
            df.unpersist()
        ctx.log(f"  padding share, {shares.rows:,} rows of tokens in batches of {PADDING_BATCH}: Spark's order "
                f"{shares.plain:.1%}, bucket_by (window {PADDING_WINDOW}) {shares.bucketed:.1%}")
    finally:
        for df, _ in frames.values():
            df.unpersist()
        ctx.children.discard(broker)
    return out


def _feed(ctx: Context, broker, df: Any, info: dict) -> dict:
    stream = f"varlen-{next(_streams)}"

    def start() -> tuple:
        return spark_data.timed_feed(df, broker.feed, stream, BATCH_SIZE, min(ctx.sizes.timeout, 120.0),
                                     max_batch_bytes=MiB)

    result = run_fed_ranks(ctx.children, [broker], stream, start, info["rows"], RANKS, ctx.work, ctx.sizes.timeout,
                           touch=True)
    result["mb_per_s"] = info["payload_bytes"] / result["last"] / 1e6
    if not result["dropped_rows"] and result["touched_bytes"] < info["payload_bytes"]:     # every row reached a loop
        raise BenchError(f"stream {stream}: the ranks saw {result['touched_bytes']:,} bytes of "
                         f"{info['payload_bytes']:,}")
    return result


class VarlenSection(Section[Varlen]):
    """Figure 7: binary and variable-length int columns vs the fixed-width path, and the padding share."""

    name, title, spark = "varlen", "7. variable-length columns", "session"

    def measure(self, ctx: Context) -> Varlen:
        return run(ctx, ctx.results.setdefault(self.name, Varlen()))

    def figures(self, run: Run, result: Varlen) -> list[Figure]:
        """MB/s of each compared kind against the fixed-width runs interleaved with it; the padding share with
        length bucketing against Spark's order."""
        out = []
        for kind, pair in result.pairs.items():
            if pair[kind].runs and pair[BASELINE].runs:
                anchor = pair[BASELINE].figure("varlen", f"{BASELINE} beside {kind}", "mb_per_s", "MB/s")
                out += [anchor, pair[kind].figure("varlen", kind, "mb_per_s", "MB/s", anchor)]
        if result.padding:
            pad = result.padding
            plain = figure("varlen", "padding share, Spark's order", [pad.plain * 100], "%")
            out += [plain, figure("varlen", "padding share, bucket_by", [pad.bucketed * 100], "%", plain)]
        return out
