"""The cached DataFrames the benchmark measures (its SparkSession is ``launch.spark.local_session``)."""

from __future__ import annotations

import time
import warnings
from typing import Any

from sparkbus.bench.e2e import synthetic_frame

ROW_BYTES = 8 + 64 * 4               # id long + 64 float32: what reaches a rank per row


def cached_frame(spark: Any, rows: int, partitions: int, seed: int = 7) -> tuple[Any, dict]:
    """``sparkbus.bench.e2e.synthetic_frame`` (``id`` long and ``features`` array<float>[64] of uniform randoms),
    cached in Spark memory and materialised. Returns the DataFrame and how it is stored."""
    started = time.monotonic()
    df = synthetic_frame(spark, rows, partitions, seed).cache()
    counted = df.count()
    return df, {"rows": counted, "partitions": df.rdd.getNumPartitions(), "payload_bytes": counted * ROW_BYTES,
                "build_seconds": time.monotonic() - started, **storage_of(spark)}


# Frames of other shapes, made by numpy inside Spark's Python workers (``mapInArrow`` over ``spark.range``), so that
# no row passes through Python one by one. Each is ``id`` long plus one column; ``row_bytes`` is its mean payload
# per row (the id's 8 bytes and the column's values; offsets not counted).
TOKENS_MEAN = 64                      # tokens: array<int> of 1..127 elements, 64 on average: 264 bytes a row
WIDE = 64 * 1024                      # binary rows and int arrays of 64 KiB
KINDS = {
    "fixed": "id long + features array<float>[64]",
    "tokens": f"id long + tokens array<int> of 1..{2 * TOKENS_MEAN - 1} (mean {TOKENS_MEAN})",
    "binary": "id long + data binary of 64 KiB",
    "ints": f"id long + values array<int>[{WIDE // 4}] (64 KiB)",
    "varints": f"id long + values array<int> of 1..{WIDE // 2 - 1} (mean {WIDE // 4}: 64 KiB)",
}


def kind_frame(spark: Any, kind: str, rows: int, partitions: int, seed: int = 7) -> tuple[Any, dict]:
    """A cached, materialised DataFrame of one of :data:`KINDS` (``fixed`` is :func:`cached_frame`), and how it is
    stored, with ``payload_bytes`` the id's and the values' bytes."""
    if kind == "fixed":
        df, info = cached_frame(spark, rows, partitions, seed)
        return df, {**info, "kind": kind}
    started = time.monotonic()
    column, ddl = {"tokens": ("tokens", "array<int>"), "binary": ("data", "binary"),
                   "ints": ("values", "array<int>"), "varints": ("values", "array<int>")}[kind]
    df = spark.range(0, rows, numPartitions=partitions).mapInArrow(_generator(kind, column, seed),
                                                                 f"id long, {column} {ddl}").cache()
    counted = df.count()
    payload = df.mapInArrow(_payload_counter(column), "bytes long").collect()
    return df, {"kind": kind, "rows": counted, "partitions": df.rdd.getNumPartitions(),
                "payload_bytes": sum(r["bytes"] for r in payload), "build_seconds": time.monotonic() - started,
                **storage_of(spark)}


def _generator(kind: str, column: str, seed: int):
    """The mapInArrow function that makes ``kind``'s column for the ids it is given (numpy, seeded by the ids)."""
    tokens_max, wide = 2 * TOKENS_MEAN - 1, WIDE

    def generate(batches):
        import numpy as np
        import pyarrow as pa

        for batch in batches:
            ids = batch.column(0)
            step = 256 if kind in ("binary", "ints", "varints") else 1 << 16      # Arrow batches of <= 16 MiB
            for start in range(0, len(ids), step):
                part = ids.slice(start, step)
                n = len(part)
                rng = np.random.default_rng([seed, int(part[0].as_py())])
                if kind == "binary":
                    data = np.frombuffer(rng.bytes(n * wide), dtype=np.uint8)
                    offsets = np.arange(0, n * wide + 1, wide, dtype=np.int32)
                    array = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
                else:
                    if kind == "ints":
                        lengths = np.full(n, wide // 4, dtype=np.int64)
                    else:
                        top = tokens_max if kind == "tokens" else wide // 2 - 1
                        lengths = rng.integers(1, top + 1, n)
                    offsets = np.zeros(n + 1, dtype=np.int32)
                    np.cumsum(lengths, out=offsets[1:])
                    values = rng.integers(0, 1 << 30, int(offsets[-1]), dtype=np.int32)
                    array = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
                yield pa.RecordBatch.from_arrays([part, array], names=["id", column])

    return generate


def _payload_counter(column: str):
    def count(batches):
        import pyarrow as pa
        import pyarrow.compute as pc

        total = 0
        for batch in batches:
            array = batch.column(column)
            if pa.types.is_list(array.type):
                total += array.flatten().nbytes          # flatten() respects a slice, .values does not
            else:
                total += pc.sum(pc.binary_length(array)).as_py() or 0
            total += 8 * batch.num_rows
        yield pa.RecordBatch.from_pydict({"bytes": [total]}, schema=pa.schema([("bytes", pa.int64())]))

    return count


def storage_of(spark: Any) -> dict:
    """Memory and disk used by Spark's cached data right now (to show the set really is in memory)."""
    mem = disk = 0
    for info in spark.sparkContext._jsc.sc().getRDDStorageInfo():
        mem += info.memSize()
        disk += info.diskSize()
    return {"cached_memory_bytes": mem, "cached_disk_bytes": disk}


def warm_up_feed(df: Any, rows: int, feed_address: str | list[str], stream: str, batch_size: int = 1024,
                 fraction: float | None = None, timeout: float = 60.0, **options: Any) -> None:
    """Feed a sample of every partition (about 16 batches, or ``fraction`` of the rows) into ``stream``, which no
    rank reads: every executor slot that will feed gets a Python worker that has imported sparkbus (a cold one pays
    seconds on its first task). ``options``: more of ``feed``'s arguments. The feed's warning that no rank reads
    the stream is expected here, and not shown."""
    from sparkbus.feeder import NoRanksWarning, feed

    fraction = min(1.0, 16 * batch_size / max(1, rows)) if fraction is None else fraction
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoRanksWarning)
        feed(df.sample(fraction=fraction, seed=1), feed_address, stream=stream, epoch=0, batch_size=batch_size,
             timeout=timeout, **options)


def timed_feed(df: Any, feed_address: str | list[str], stream: str, batch_size: int,
               timeout: float, **options: Any) -> tuple[float, float, dict]:
    """``feeder.feed`` of ``df`` (more arguments: ``options``) as epoch 0 of ``stream``: (wall-clock start, end,
    FeedReport as dict)."""
    from sparkbus.feeder import feed

    started = time.time()
    report = feed(df, feed_address, stream=stream, epoch=0, batch_size=batch_size, timeout=timeout, **options)
    return started, time.time(), report._asdict()
