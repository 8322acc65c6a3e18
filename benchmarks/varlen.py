"""Figure 7, variable-length columns end to end: rows of 64 KiB as ``binary`` and as ``array<int>`` of varying length
(``varints``) against the fixed-width path (``ints``, ``array<int>[16384]``), each fed through one broker to 2 ranks
that add up every column's bytes, interleaved with the ``ints`` runs it is compared with; Spark's own hand-off of
each frame for context; then the padding share with and without ``bucket_by`` (``padding.measure``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.bench.e2e import hand_off
from sparkbus.bench.figures import Figure, figure

from . import end_to_end, spark_data
from .common import BenchError, Children, MiB, Sizes
from .end_to_end import RANKS, Series
from .padding import PaddingShares
from .sections import Context, Run, Section

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
    padding: PaddingShares | None = None


def run(children: Children, spark: Any, sizes: Sizes, work: Path, log=print, out: Varlen | None = None) -> Varlen:
    """Both comparisons and the padding share, filled into ``out`` as it goes (a new record if None)."""
    out = Varlen(sizes.varlen_rows) if out is None else out
    broker = children.broker(MAX_BUFFER)
    frames: dict[str, Any] = {}
    try:
        frames[BASELINE] = _prepare(spark, BASELINE, sizes, broker, out, log)
        for kind in COMPARED:
            frames[kind] = _prepare(spark, kind, sizes, broker, out, log)
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
    finally:
        df.unpersist()
    out.padding = shares
    log(f"  padding share, {shares.rows:,} rows of tokens in batches of {shares.batch_size}: Spark's order "
        f"{shares.plain:.1%}, bucket_by (window {shares.bucket_window}) {shares.bucketed:.1%}: {shares.ratio:.2f} x")


def _prepare(spark: Any, kind: str, sizes: Sizes, broker, out: Varlen, log) -> Any:
    """Cache ``kind``'s frame, scan it once and feed a small sample of every partition that no rank reads."""
    df, info = spark_data.kind_frame(spark, kind, sizes.varlen_rows, PARTITIONS)
    out.kinds[kind] = info
    hand_off(df)
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
    if not result["dropped_rows"] and result["touched_bytes"] < info["payload_bytes"]:     # every row reached a loop
        raise BenchError(f"stream {stream}: the ranks saw {result['touched_bytes']:,} bytes of "
                         f"{info['payload_bytes']:,}")
    return result


class VarlenSection(Section[Varlen]):
    """Figure 7: binary and variable-length int columns vs the fixed-width path, and the padding share."""

    name, title, figure, spark = "varlen", "7. variable-length columns", "7", "session"

    def measure(self, ctx: Context) -> Varlen:
        out = ctx.results[self.name] = Varlen(ctx.sizes.varlen_rows)
        return run(ctx.children, ctx.spark, ctx.sizes, ctx.work, log=ctx.log, out=out)

    def figures(self, run: Run, result: Varlen) -> list[Figure]:
        """MB/s of each compared kind against the fixed-width runs interleaved with it; the padding share with
        length bucketing against Spark's order."""
        out = []
        for kind, pair in result.pairs.items():
            if pair.compared.runs and pair.baseline.runs:
                anchor = pair.baseline.figure("varlen", f"{BASELINE} beside {kind}", "mb_per_s", "MB/s")
                out += [anchor, pair.compared.figure("varlen", kind, "mb_per_s", "MB/s", anchor)]
        pad = result.padding
        if pad:
            plain = figure("varlen", "padding share, Spark's order", [pad.plain * 100], "%")
            out += [plain, figure("varlen", "padding share, bucket_by", [pad.bucketed * 100], "%", plain)]
        return out
