"""The cached DataFrames the benchmark measures (its SparkSession is ``launch.spark.local_session``)."""

from __future__ import annotations

import time
from typing import Any

FEATURES = 64
ROW_BYTES = 8 + FEATURES * 4          # id long + 64 float32: what reaches a rank per row


def cached_frame(spark: Any, rows: int, partitions: int, seed: int = 7) -> tuple[Any, dict]:
    """``id`` long and ``features`` array<float>[64] of uniform randoms, cached in Spark memory and materialised.

    Random values, so that Parquet cannot compress them away. Returns the DataFrame and how it is stored.
    """
    from pyspark.sql import functions as F

    started = time.monotonic()
    df = spark.range(0, rows, numPartitions=partitions).select(
        F.col("id"), F.array(*[F.rand(seed + i).cast("float") for i in range(FEATURES)]).alias("features"))
    df = df.cache()
    counted = df.count()
    storage = storage_of(spark)
    return df, {"rows": counted, "partitions": df.rdd.getNumPartitions(), "payload_bytes": counted * ROW_BYTES,
                "build_seconds": time.monotonic() - started, **storage}


def storage_of(spark: Any) -> dict:
    """Memory and disk used by Spark's cached data right now (to show the set really is in memory)."""
    mem = disk = 0
    for info in spark.sparkContext._jsc.sc().getRDDStorageInfo():
        mem += info.memSize()
        disk += info.diskSize()
    return {"cached_memory_bytes": mem, "cached_disk_bytes": disk}


def warm_up(df: Any) -> None:
    """Start the Python workers and JIT the scan once, outside any timing."""
    df.limit(1000).mapInArrow(_dropper(), "rows long").collect()


def _dropper():
    """The mapInArrow function of the limit: count the rows handed to Python, keep nothing.

    Made in a closure so that cloudpickle ships it by value (the executors cannot import this module).
    """
    def drop(batches):
        import pyarrow as pa

        rows = 0
        for batch in batches:
            rows += batch.num_rows
        yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))

    return drop


def arrow_limit(df: Any) -> tuple[float, int]:
    """The cached DataFrame handed to Python through mapInArrow and dropped there: (seconds, rows)."""
    started = time.time()
    rows = sum(r["rows"] for r in df.mapInArrow(_dropper(), "rows long").collect())
    return time.time() - started, rows


def warm_up_feed(df: Any, rows: int, feed_address: str | list[str], stream: str, batch_size: int = 1024) -> None:
    """Feed a small sample of every partition into ``stream``, which no rank reads (its rows stay in the broker).

    Every task of ``df`` runs, so every executor slot that will feed gets a Python worker that has imported
    sparkbus (a cold one pays seconds of imports on its first task). About 16 batches in all.
    """
    from feeder import feed

    fraction = min(1.0, 16 * batch_size / max(1, rows))
    feed(df.sample(fraction=fraction, seed=1), feed_address, stream=stream, epoch=0, batch_size=batch_size,
         timeout=60.0)


def timed_feed(df: Any, feed_address: str | list[str], stream: str, batch_size: int,
               timeout: float) -> tuple[float, float, dict]:
    """``feeder.feed`` of ``df`` as epoch 0 of ``stream``: (wall-clock start, wall-clock end, FeedReport as dict)."""
    from feeder import feed

    started = time.time()
    report = feed(df, feed_address, stream=stream, epoch=0, batch_size=batch_size, timeout=timeout)
    return started, time.time(), report._asdict()
