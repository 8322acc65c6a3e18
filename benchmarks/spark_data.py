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
