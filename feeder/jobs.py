"""A feed's Spark job: the tasks that stream the partitions, built once per feed and run by the driver.

:func:`feed_job` makes a :class:`FeedJob` of a DataFrame (one ``mapInArrow``: collected on Spark Connect, run
through its RDD on a classic session) or of an RDD (``mapPartitionsWithIndex``); its ``rerun`` is the recovery job
over fixed routes (:mod:`feeder.recovery`). Also here: what the driver must know of the data to run it (a Connect
DataFrame or not, its partition count if its maker said), the Arrow batch size asked of Spark, and the one line a
failed job is explained with.
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, get_type_hints

from sparkbus.feeder.columns import partition_messages, record_batches_from_rows
from sparkbus.feeder.commits import AccumulatorReports, ReportChannel, StreamedReports
from sparkbus.feeder.options import FeedOptions
from sparkbus.feeder.routes import Routes
from sparkbus.feeder.schema import prepare_dataframe
from sparkbus.feeder.task import PartitionReport, attempt_id, stream_messages


class FeedJob(NamedTuple):
    """A feed's Spark job as the recovery needs it: the partition count if Spark knows it before the job,
    the first job, and the recovery job over fixed routes (either returns the tasks' report rows), and where the
    reports of successful tasks come from while a job runs (``feeder.commits``; None: only from its rows)."""

    partitions: int | None
    collect: Callable[[], list]
    rerun: Callable[[Routes], list]
    reports: ReportChannel | None = None


# PartitionReport's fields as Spark and Arrow types: a DataFrame's feeding tasks return their reports as rows
REPORT_TYPES = {int: ("long", "int64"), float: ("double", "float64"), str: ("string", "string")}
REPORT_FIELDS = tuple(get_type_hints(PartitionReport).items())
REPORT_SCHEMA = ", ".join(f"{name} {REPORT_TYPES[kind][0]}" for name, kind in REPORT_FIELDS)
ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
SPARK_ARROW_BATCH_ROWS = 10_000         # Spark's default of that setting


def arrow_rows_for(batch_size: int) -> int:
    """Rows of the Arrow record batches a feed asks Spark for: a whole number of batches (see ``feed``)."""
    return batch_size * max(1, min(8, SPARK_ARROW_BATCH_ROWS // batch_size))


@contextmanager
def spark_conf(session: Any, key: str, value: str) -> Iterator[None]:
    """A Spark SQL setting for the length of a ``with`` block, then what it was (or unset) again."""
    before = session.conf.get(key, None)
    session.conf.set(key, value)
    try:
        yield
    finally:
        if before is None:
            session.conf.unset(key)
        else:
            session.conf.set(key, before)


def is_dataframe(data: Any) -> bool:
    return hasattr(data, "mapInArrow") and hasattr(data, "schema")


def is_connect_dataframe(data: Any) -> bool:
    """Whether ``data`` is a DataFrame of a Spark Connect session, which has no RDD and no SparkContext.

    Decided by its type, ``pyspark.sql.connect.dataframe.DataFrame``, without importing that module: if it is not
    imported, no Connect DataFrame exists, and importing it needs Connect's client (grpcio), which a classic
    installation may lack.
    """
    connect = sys.modules.get("pyspark.sql.connect.dataframe")
    return connect is not None and isinstance(data, connect.DataFrame)


PARTITIONS_HINT = "_sparkbus_partitions"


def with_partitions(df: Any, partitions: int) -> Any:
    """``df``, marked with its partition count (known to who made it, e.g. :func:`feeder.epoch_order`), for a
    Spark Connect DataFrame, which does not tell it: a resume over several brokers routes by it."""
    if is_connect_dataframe(df):
        setattr(df, PARTITIONS_HINT, partitions)
    return df


def spark_job(data: Any, make: Callable[[int, Routes | None, ReportChannel], Any]) -> FeedJob:
    """The feed's DataFrame (``make(run, routes, channel)``: the job's DataFrame), run by ``collect()``; on a classic
    session through its RDD, whose partition count Spark knows before the job runs.

    On a classic session the count comes from the very RDD that is then collected: with adaptive query
    execution, planning that RDD runs the shuffle stages below it (once), and a DataFrame ``collect()`` after it
    would plan and run them again. Spark Connect has no RDD: the count is the number of the job's reports.
    (Counting first, e.g. ``spark_partition_id()`` over the DataFrame, would be a second pass over all of its
    lineage: as costly as the feed itself for a DataFrame that is not cached.)

    The tasks' reports reach the driver while the job runs (:mod:`feeder.commits`): on a classic session through
    an accumulator, on Spark Connect as the job's results, streamed (``toLocalIterator``).

    The recovery job (``rerun``) is the same DataFrame with fixed routes and a new run (its attempts must not
    look like the first job's): on a classic session over the re-fed partitions only (``SparkContext.runJob``),
    on Spark Connect over every partition, the others sending nothing.
    """
    if is_connect_dataframe(data):
        streamed = StreamedReports()

        def collect_streaming(routes: Routes | None) -> list:
            rows = []
            for row in make(secrets.randbits(31), routes, streamed).toLocalIterator():
                rows.append(tuple(row))
                streamed.put(PartitionReport(*row))
            return rows

        return FeedJob(None, lambda: collect_streaming(None), collect_streaming, streamed)
    context = data.sparkSession.sparkContext
    channel = AccumulatorReports(context)
    rdd = make(secrets.randbits(31), None, channel).rdd

    def rerun(routes: Routes) -> list:
        return context.runJob(make(secrets.randbits(31), routes, channel).rdd, _listed, routes.partitions())

    return FeedJob(rdd.getNumPartitions(), rdd.collect, rerun, channel)


def _listed(rows: Iterator[Any]) -> list:
    return list(rows)


def dataframe_job(df: Any, columns: Sequence[str] | None, cutting: dict, run: int, settings: dict,
                   channel: ReportChannel, routes: Routes | None = None):
    import pyarrow as pa

    prepared = prepare_dataframe(df, columns, cutting["ragged"], cutting["bucket_by"], cutting["tokens_by"])
    report_schema = pa.schema([(name, getattr(pa, REPORT_TYPES[kind][1])()) for name, kind in REPORT_FIELDS])
    accumulated = channel if isinstance(channel, AccumulatorReports) else None
    epoch = settings["epoch"]

    def stream_arrow_partition(record_batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        task = task_context()
        part = task.partitionId()
        route = None if routes is None else routes.route(part)
        if routes is not None and route is None:        # a recovery that does not re-feed this partition
            report = PartitionReport(part, -1, 0, 0, 0.0, -1)
        else:
            messages = partition_messages(record_batches, seed=(epoch, part), **cutting)
            report = stream_messages(messages, partition=part, attempt=attempt_id(run, task.taskAttemptId()),
                                     route=route, **settings)
            if accumulated is not None:
                accumulated.add(report)     # merged at the driver only if Spark declares this attempt successful
        yield pa.RecordBatch.from_pylist([report._asdict()], schema=report_schema)

    return prepared.mapInArrow(stream_arrow_partition, REPORT_SCHEMA)


def _require_rdd(data: Any) -> None:
    if not hasattr(data, "mapPartitionsWithIndex"):
        raise TypeError(f"feed() takes a Spark DataFrame (of a classic or a Spark Connect session) or an RDD "
                        f"(of a classic session only: Spark Connect has no RDDs; make a DataFrame of the rows, "
                        f"e.g. spark.createDataFrame), not {type(data).__name__}")


def rdd_job(rdd: Any, cutting: dict, settings: dict) -> FeedJob:
    _require_rdd(rdd)
    epoch = settings["epoch"]
    channel = AccumulatorReports(rdd.context)

    def mapped(run: int, routes: Routes | None) -> Any:
        def stream_rows(index: int, rows: Iterator[Any]) -> list[tuple]:
            route = None if routes is None else routes.route(index)
            if routes is not None and route is None:
                return [tuple(PartitionReport(index, -1, 0, 0, 0.0, -1))]
            attempt = attempt_id(run, task_context().taskAttemptId())
            record_batches = record_batches_from_rows(rows, cutting["batch_size"])
            messages = partition_messages(record_batches, seed=(epoch, index), **cutting)
            report = stream_messages(messages, partition=index, attempt=attempt, route=route, **settings)
            channel.add(report)             # merged at the driver only if Spark declares this attempt successful
            return [tuple(report)]

        return rdd.mapPartitionsWithIndex(stream_rows)

    job = mapped(secrets.randbits(31), None)

    def rerun(routes: Routes) -> list:
        return rdd.context.runJob(mapped(secrets.randbits(31), routes), _listed, routes.partitions())

    return FeedJob(job.getNumPartitions(), job.collect, rerun, channel)


def task_context() -> Any:
    """The running Spark task's context (inside a task only)."""
    from pyspark import TaskContext

    task = TaskContext.get()
    if task is None:
        raise RuntimeError("sparkbus's feed function runs inside a Spark task only")
    return task


def explain_job_failure(exc: Exception, stream: str, epoch: int) -> str:
    # A classic session raises Py4JJavaError or PythonException, Spark Connect its own PythonException or
    # SparkConnectGrpcException (pyspark.errors.exceptions.connect): all carry the executors' Python traceback in
    # their message, which is read, never their type. A JVM stack trace, when Spark is set to append one, is not.
    text = str(exc).split("\nJVM stacktrace:", 1)[0]
    hint = ""
    if "No module named" in text:
        hint = (" Hint: the executors' Python cannot import sparkbus or its dependencies; set PYSPARK_PYTHON "
                "(or spark.pyspark.python) to the interpreter sparkbus is installed in, before the SparkSession "
                "starts.")
    # The last "SomeError: message" line of a Python traceback is the cause; lines of code above it may say "Error" too
    causes = re.findall(r"^\s*([\w.]*(?:Error|Exception|Timeout): .*)$", text, re.MULTILINE)
    first = causes[-1] if causes else next((line for line in text.splitlines() if "Error" in line), text[:300])
    return f"the Spark job feeding stream {stream!r} epoch {epoch} failed: {first.strip()[:500]}{hint}"


def refuse_data(data: Any, options: FeedOptions) -> None:
    """Raise what is wrong with ``data`` itself, before any broker is asked or any job planned: the schema's
    refusals (:func:`feeder.schema.prepare_dataframe`), or data that is neither a DataFrame nor an RDD.

    Raises:
        TypeError: as :func:`feeder.schema.prepare_dataframe`, or neither a DataFrame nor an RDD.
    """
    if is_dataframe(data):
        prepare_dataframe(data, options.columns, options.ragged, options.bucket_by, options.tokens_by)
    else:
        _require_rdd(data)


def feed_job(data: Any, options: FeedOptions) -> FeedJob:
    """The feed's job over ``data`` (a DataFrame or an RDD) as ``options`` say it is cut and streamed.

    Raises:
        TypeError: ``data`` is neither a DataFrame nor an RDD (of a classic session: Spark Connect has none).
    """
    cutting, settings = options.cutting(), options.task_settings()
    if is_dataframe(data):
        return spark_job(data, lambda run, routes, channel: dataframe_job(data, options.columns, cutting, run,
                                                                          settings, channel, routes))
    return rdd_job(data, cutting, settings)


__all__ = ["FeedJob", "feed_job", "refuse_data", "is_connect_dataframe", "with_partitions", "arrow_rows_for",
           "ARROW_BATCH_CONF"]
