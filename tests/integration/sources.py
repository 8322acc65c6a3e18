"""Data sources and consumers for the integration tests: frames whose values derive from their ids, RDDs and
DataFrames whose task attempts fail, crawl or reorder on purpose, and a consumer in a thread."""

import os
import threading
import time

import numpy as np

from sparkbus.worker import BatchStream


def labelled_frame(spark, rows: int, partitions: int, first_id: int = 0):
    """A DataFrame whose every value derives from its id, so arrival can be checked exactly.

    Columns: id long; x array<float>[8] = id*10 + j; y int = id % 7; flag boolean = id even;
    w double = id / 4; v ML vector = [w, y].
    """
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    df = spark.range(first_id, first_id + rows, numPartitions=partitions).select(
        F.col("id"),
        F.array(*[(F.col("id") * 10 + j).cast("float") for j in range(8)]).alias("x"),
        (F.col("id") % 7).cast("int").alias("y"),
        (F.col("id") % 2 == 0).alias("flag"),
        (F.col("id") / 4).alias("w"))
    return VectorAssembler(inputCols=["w", "y"], outputCol="v").transform(df)


def check_values(columns: dict[str, np.ndarray]) -> None:
    """Every value and dtype of a :func:`labelled_frame` batch matches its id."""
    ids = columns["id"]
    assert columns["id"].dtype == np.int64
    assert columns["x"].dtype == np.float32 and columns["x"].shape == (len(ids), 8)
    np.testing.assert_array_equal(columns["x"], (ids[:, None] * 10 + np.arange(8)).astype(np.float32))
    assert columns["y"].dtype == np.int32
    np.testing.assert_array_equal(columns["y"], ids % 7)
    assert columns["flag"].dtype == np.bool_
    np.testing.assert_array_equal(columns["flag"], ids % 2 == 0)
    assert columns["w"].dtype == np.float64
    np.testing.assert_array_equal(columns["w"], ids / 4)
    assert columns["v"].dtype == np.float64 and columns["v"].shape == (len(ids), 2)
    np.testing.assert_array_equal(columns["v"], np.stack([ids / 4, ids % 7], axis=1))


def staged_frame(spark, rows, partitions, *, slow=-1, slow_seconds=0.0, gate=None, gate_after=5):
    """ids 0..rows-1 in Arrow batches of 100, made in Python: partition ``slow`` sleeps ``slow_seconds`` per
    batch on its first attempt only, which makes Spark launch a speculative copy.

    With ``gate`` (a path), partition ``slow`` also stops after ``gate_after`` batches until that file exists
    (at most two minutes): a test holds the partition open until what it does to a broker has happened."""
    gate = None if gate is None else str(gate)

    def produce(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        task = TaskContext.get()
        part, attempt = task.partitionId(), task.attemptNumber()
        ids = np.concatenate([b.column("id").to_numpy() for b in batches] or [np.zeros(0, np.int64)])
        for start in range(0, len(ids), 100):
            if part == slow and attempt == 0:
                time.sleep(slow_seconds)
            if part == slow and gate is not None and start == gate_after * 100:
                deadline = time.monotonic() + 120
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.05)
            chunk = ids[start:start + 100]
            yield pa.RecordBatch.from_pydict({"id": chunk, "x": pa.array(chunk.astype(np.float32))})

    return spark.range(rows, numPartitions=partitions).mapInArrow(produce, "id long, x float")


def staged_rdd(spark, rows, partitions, *, fail=-1, fail_after=1500, reverse_on_retry=False, seen_at=(),
               stream=None):
    """Rows ``{"id", "x"}`` from an RDD, whose Python stages run in the feeding task itself: partition ``fail``
    raises on its first attempt after ``fail_after`` rows, when part of it has already been streamed (and with
    ``reverse_on_retry`` its retry yields the rows in reverse order).

    With ``seen_at`` (brokers' control addresses) and ``stream``, the failure waits (at most 30 s) until one of
    them has had a batch of the partition: what the task had sent before it failed has certainly arrived, and its
    retry's batches meet them there (ZeroMQ's I/O thread sends what the task queued while the stage waits)."""
    def produce(part, ids):
        from pyspark import TaskContext

        from sparkbus.broker.client import ControlClient
        from sparkbus.wire.protocol import Kind, unpack_ranges

        def seen() -> bool:     # in the closure: the executors cannot import this module
            for control in seen_at:
                with ControlClient(control, 5.0) as client:
                    reply = client.request(Kind.EPOCH_QUERY, stream=stream, epoch=0)
                if part in unpack_ranges(reply.get("seen") or []):
                    return True
            return False

        attempt = TaskContext.get().attemptNumber()
        ids = list(ids)
        if reverse_on_retry and part == fail and attempt > 0:
            ids.reverse()
        for i, value in enumerate(ids):
            if part == fail and attempt == 0 and i == fail_after:
                deadline = time.monotonic() + 30
                while seen_at and not seen() and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError("injected failure on the first attempt")
            yield {"id": value, "x": np.float32(value)}

    return spark.sparkContext.parallelize(range(rows), partitions).mapPartitionsWithIndex(produce)


class Collector:
    """A single independent consumer in a thread: every id it receives, per epoch."""

    def __init__(self, address, stream, epochs=1, timeout=60):
        self.ids = []
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(address, stream, epochs, timeout))
        self.thread.start()

    def _run(self, address, stream, epochs, timeout):
        try:
            with BatchStream(address, stream=stream, timeout=timeout) as s:
                for _ in range(epochs):
                    ids = []
                    for batch in s.epoch():
                        np.testing.assert_array_equal(batch["x"], batch["id"].astype(np.float32))
                        ids.append(batch["id"].copy())
                    self.ids.append(np.concatenate(ids) if ids else np.zeros(0, np.int64))
        except BaseException as exc:          # reported by result()
            self.error = exc

    def result(self, timeout=90):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "consumer did not finish"
        if self.error:
            raise self.error
        return self.ids


def failing_frame(spark, rows, partitions, *, fail, fail_after, control, stream, wait_rows, epoch=0, pad=1024):
    """ids ``0..rows-1`` as ``id long, x float, pad binary`` (``pad`` bytes of padding), made by a Python stage
    (``mapInArrow``) in Arrow batches of 100 rows: a DataFrame whose task attempts fail part-way, for sessions
    without RDDs (Spark Connect).

    On its first attempt, partition ``fail`` raises after ``fail_after`` rows, once the broker at ``control`` holds
    ``wait_rows`` rows of ``stream`` epoch ``epoch`` (or after 30 s), so that part of the partition has certainly
    been streamed and its retry's batches are duplicates there. The stage runs in a Python worker of its own, and
    rows pass from it to the JVM, and from there to the feeding task's worker, in writes of 64 KiB: the padding
    (feed it too, with ``arrow_batch_rows`` 100) makes each batch of 100 rows reach the feeder before the failure.
    """
    def produce(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        from sparkbus.broker.client import fetch_stats

        def held() -> int:
            epochs = fetch_stats(control, 5.0)["streams"].get(stream, {}).get("epochs", {})
            return epochs.get(str(epoch), {}).get("rows_in", 0)

        task = TaskContext.get()
        part, attempt = task.partitionId(), task.attemptNumber()
        ids = np.concatenate([b.column("id").to_numpy() for b in batches] or [np.zeros(0, np.int64)])
        for start in range(0, len(ids), 100):
            if part == fail and attempt == 0 and start >= fail_after:
                deadline = time.monotonic() + 30
                while held() < wait_rows and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError(f"injected failure in partition {part} after {start} rows")
            chunk = ids[start:start + 100]
            yield pa.RecordBatch.from_pydict({"id": chunk, "x": pa.array(chunk.astype(np.float32)),
                                              "pad": pa.array([b"\0" * pad] * len(chunk), pa.binary())})

    return spark.range(rows, numPartitions=partitions).mapInArrow(produce, "id long, x float, pad binary")
