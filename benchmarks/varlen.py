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
from pathlib import Path
from typing import Any

import end_to_end
import spark_data
from broker.errors import FeedError
from common import MiB, BenchError, Children, Sizes
from end_to_end import RANKS, Series

BASELINE = "ints"
COMPARED = ("binary", "varints")
PARTITIONS = 4
BATCH_SIZE = 1024
OPTIONS = {"max_batch_bytes": MiB}
MAX_BUFFER = "256MiB"
# The padding share (benchmarks/padding.py, its defaults): tokens rows, batches of 64, bucket_by window 64
PADDING_ROWS, PADDING_BATCH, PADDING_WINDOW = 20_000, 64, 64
_streams = itertools.count()


def run(children: Children, spark: Any, sizes: Sizes, work: Path, log=print, out: dict | None = None) -> dict:
    """Both comparisons; fills and returns ``out``: ``{"rows", "kinds": {kind: stored info}, "pairs":
    {kind: {"baseline": Series, "compared": Series}}, "refused": {kind: the feeder's error}}`` (filled as it
    goes). A kind the feeder refuses (before protocol v4) is not measured; the others are."""
    out = {} if out is None else out
    out.update(rows=sizes.varlen_rows, kinds={}, pairs={}, refused={})
    broker = children.broker(MAX_BUFFER)
    frames: dict[str, Any] = {}
    try:
        frames[BASELINE] = _prepare(spark, BASELINE, sizes, broker, out, log)
        for kind in COMPARED:
            try:
                frames[kind] = _prepare(spark, kind, sizes, broker, out, log)
            except (TypeError, FeedError) as exc:       # a feeder without variable-length columns (protocol < 4)
                out["refused"][kind] = str(exc).split("failed: ")[-1][:300]
                log(f"  {kind}: not measured, the feeder refused it: {out['refused'][kind]}")
                continue
            pair = out["pairs"][kind] = {"baseline": Series(BASELINE), "compared": Series(kind)}
            for rep in range(sizes.reps):
                order = (BASELINE, kind) if rep % 2 == 0 else (kind, BASELINE)
                for name in order:
                    result = _feed(children, broker, frames[name], out["kinds"][name], work, sizes)
                    pair["baseline" if name == BASELINE else "compared"].runs.append(result)
                b, c = pair["baseline"].runs[-1], pair["compared"].runs[-1]
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


def _padding(spark: Any, broker, sizes: Sizes, out: dict, log) -> None:
    """The padding share with and without ``bucket_by`` (``padding.measure``) on a ``tokens`` frame, one run."""
    import padding

    df, info = spark_data.kind_frame(spark, "tokens", PADDING_ROWS, PARTITIONS)
    try:
        shares = padding.measure(df, "tokens", batch_size=PADDING_BATCH, bucket_window=PADDING_WINDOW,
                                 feed_address=broker.feed, ranks_address=broker.ranks, stream="varlen-padding",
                                 timeout=min(sizes.timeout, 120.0))
    except (TypeError, FeedError) as exc:           # a feeder without ragged= and bucket_by= (protocol < 4)
        out["refused"]["padding"] = str(exc).split("failed: ")[-1][:300]
        log(f"  padding: not measured, the feeder refused it: {out['refused']['padding']}")
        return
    finally:
        df.unpersist()
    out["padding"] = {**shares.as_dict(), "kind": "tokens"}
    log(f"  padding share, {shares.rows:,} rows of tokens in batches of {shares.batch_size}: Spark's order "
        f"{shares.plain:.1%}, bucket_by (window {shares.bucket_window}) {shares.bucketed:.1%}: {shares.ratio:.2f} x")


def _prepare(spark: Any, kind: str, sizes: Sizes, broker, out: dict, log) -> Any:
    """Cache ``kind``'s frame, scan it once and feed a small sample of every partition that no rank reads."""
    df, info = spark_data.kind_frame(spark, kind, sizes.varlen_rows, PARTITIONS)
    out["kinds"][kind] = info
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


def ratio(pair: dict) -> float:
    """compared MB/s / baseline MB/s, medians of the repetitions."""
    return pair["compared"].med("mb_per_s") / pair["baseline"].med("mb_per_s")


__all__ = ["run", "ratio", "BASELINE", "COMPARED"]
