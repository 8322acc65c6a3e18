"""The driver's side of a feed: open the epoch, run one Spark job whose tasks stream, close the epoch.

:func:`feed` builds one :class:`feeder.options.FeedOptions` of its arguments and feeds in one :class:`Way`: a new
epoch (at every broker, or around brokers gone for good), a resume, or the recovery of an epoch fed before. The
pieces it calls have modules of their own: the schema checks (:mod:`feeder.schema`), the Spark job
(:mod:`feeder.jobs`), what it asks the brokers around the job (:mod:`feeder.brokers`), Spark's commits
(:mod:`feeder.commits`) and the watched, recovered epoch (:mod:`feeder.recovery`).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from enum import Enum
from typing import Any, NamedTuple

from sparkbus.broker.client import ControlClient
from sparkbus.broker.partitions import MAX_PARTITIONS
from sparkbus.feeder.brokers import (
    REFUSED_AFTER,
    NoRanksWarning,
    check_epoch_unfed,
    greet_brokers,
    raise_if_a_broker_restarted,
    warn_if_no_ranks,
)
from sparkbus.feeder.cancel import JobCancel
from sparkbus.feeder.commits import Committer
from sparkbus.feeder.jobs import (
    ARROW_BATCH_CONF,
    PARTITIONS_HINT,
    FeedJob,
    arrow_rows_for,
    explain_job_failure,
    feed_job,
    is_connect_dataframe,
    is_dataframe,
    refuse_data,
    spark_conf,
)
from sparkbus.feeder.options import DEFAULT_MAX_BATCH_BYTES, FeedOptions
from sparkbus.feeder.recovery import EpochFeed, Outcome, taken_figures
from sparkbus.feeder.schema import check_spark_type, prepare_dataframe
from sparkbus.feeder.task import DEFAULT_PACK_BYTES, PartitionReport
from sparkbus.feeder.waits import WaitsWatch
from sparkbus.feeder.watch import Loss
from sparkbus.wire.errors import BrokerError, FeedError
from sparkbus.wire.protocol import Kind
from sparkbus.wire.verdict import RankWaits, SlowTask, Verdict, of_pipeline

log = logging.getLogger("sparkbus.feeder")
# EPOCH_OPEN's partitions when the count is known only once the job has run (Spark Connect): the broker's limit,
# an upper bound that EPOCH_CLOSE lowers to the count of the job's reports (docs/PROTOCOL.md)
UNKNOWN_PARTITIONS = MAX_PARTITIONS


class DivergedPartitionsWarning(UserWarning):
    """Spark recomputed partitions differently across task attempts; in stream delivery rows may be off."""


SLOWEST_TASKS = 3           # the slowest feeding tasks a FeedReport names


class TaskTiming(NamedTuple):
    """One feeding task that Spark declared successful: its partition, the executor's host, when it began (the
    executor's clock, ``time.time()``), its seconds and, of them, the seconds its sends were held back by full
    brokers."""

    partition: int
    host: str
    started: float
    seconds: float
    blocked: float


class FeedReport(NamedTuple):
    """What :func:`feed` sent: partitions, batches, rows, payload bytes, wall-clock seconds, and the partitions
    whose task attempts produced different batches (see :class:`DivergedPartitionsWarning`)."""

    partitions: int
    batches: int
    rows: int
    bytes: int
    seconds: float
    diverged: tuple[int, ...] = ()
    brokers: tuple[int, ...] = ()     # partitions streamed through each broker, in the order of the addresses
    task_seconds: float = 0.0         # the feeding tasks' time, summed (of the attempts Spark declared successful)
    blocked_seconds: float = 0.0      # ... of it, held back by full brokers: backpressure from the ranks
    slowest: tuple[SlowTask, ...] = ()   # the slowest tasks: (partition, executor host, seconds)
    ranks: tuple[RankWaits, ...] = ()   # each rank's seconds while this feed ran: data wait, peer wait, own work
    queued_share: float | None = None   # ... the share of their data wait while the brokers held batches for them
    tasks: tuple[TaskTiming, ...] = ()  # every feeding task, by partition: host, start, seconds, held back

    @property
    def backpressure(self) -> float:
        """The share of the feeding tasks' time their sends were held back by full brokers. Near 1: the ranks
        are the bottleneck (compute-bound: Spark waits for them). Near 0 while ranks wait for data: Spark is
        (input-bound; ``slowest`` names the slowest tasks and their hosts). See docs/OPERATIONS.md, "Why
        training waits"."""
        return self.blocked_seconds / self.task_seconds if self.task_seconds > 0 else 0.0

    @property
    def verdict(self) -> Verdict:
        """Why training waited while this epoch was fed, and who to look at: ``input-bound`` (the ranks waited
        for data; the slowest tasks and executors named, or the window round trip when the brokers held batches
        for the ranks meanwhile), ``compute-bound`` (Spark was held back by the ranks; the
        slowest rank named) or ``balanced``; ``unknown`` when no rank reported its figures. ``str()`` of it is one
        line. See :func:`sparkbus.wire.verdict.of_pipeline` and docs/OPERATIONS.md, "Why training waits"."""
        return of_pipeline(self.ranks, self.backpressure if self.task_seconds > 0 else None, self.slowest,
                           self.queued_share)


def feed(data: Any, address: str | Sequence[str] | None = None, stream: str = "train", epoch: int = 0,
         batch_size: int = 1024, columns: Sequence[str] | None = None, timeout: float = 60.0, *,
         delivery: str = "stream", control: str | Sequence[str] | None = None,
         max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, pack_bytes: int = DEFAULT_PACK_BYTES,
         ragged: Sequence[str] = (), bucket_by: str | None = None, bucket_window: int = 64,
         arrow_batch_rows: int | None = None, key: str | None = None,
         broker_key: str | None = None, recover: bool = True, resume: bool = False,
         batch_tokens: int | None = None, tokens_by: str | None = None,
         bucket_bounds: Sequence[int] | None = None) -> FeedReport:
    """Stream every row of a DataFrame or RDD to the broker as one epoch of ``stream``.

    Opens the epoch with the partition count, runs one Spark job whose tasks push their partitions in batches
    (each task returns once the broker has confirmed every batch of its partition), and closes the epoch when
    the job has succeeded. Ranks see the epoch end only after that.

    A DataFrame of a Spark Connect session (no RDD, no SparkContext) is fed by the same job, run with
    ``collect()``: the Spark executors reach the broker, the client only talks to it. Its partition count is known
    only from the job's reports (one per task, empty partitions too), so the epoch is opened with an upper bound
    and closed with the count; the job itself is the only pass over the data, as on a classic session.

    Args:
        data: a DataFrame (of a classic or a Spark Connect session) or an RDD of dicts or tuples (classic sessions
            only: Spark Connect has no RDDs). Columns may be numbers, booleans, binary, strings,
            dates, timestamps, arrays of those of any length (nested to any depth), structs (they arrive as
            ``parent.child`` columns) and ML vectors, with nulls anywhere. RDD values may be the Python
            equivalents (``bytes``, ``str``, lists, None, dicts, numpy arrays). Decimals and maps are refused
            (see ``TypeError``).
        address: the broker's feed address, e.g. ``tcp://broker-host:5555``; or several brokers' (a list, or a
            comma-separated string): each partition then streams through one of them, the emptiest when its
            first attempt starts. None: the variable ``SPARKBUS_FEED_ADDRESS``.
        stream: the stream name ("train", "val", a job id).
        epoch: the epoch number; each (stream, epoch) is fed once.
        batch_size: rows per batch (the last batch of a partition may be shorter).
        columns: DataFrame columns to send (default: all).
        timeout: seconds any single wait may take: the broker's replies, and a task blocked by backpressure.
        delivery: ``"stream"`` forwards batches as they arrive; ``"atomic"`` forwards a partition's batches only
            once its task has committed, exactly-once even if Spark recomputes a partition in another order
            (costs a partition's worth of latency and broker memory). See docs/GUARANTEES.md.
        control: the brokers' control addresses, in the same order, if they are not the feed ports + 2.
        max_batch_bytes: cap on a batch's payload, counted per row, so it holds for variable-length rows too;
            wide rows get fewer than ``batch_size`` rows per batch. A single row larger than the cap travels as
            a batch of its own.
        pack_bytes: consecutive batches smaller than half of this (512 KiB) travel as packs of up to this
            size (1 MiB), one message each: the broker's and the ranks' cost is per message. Ranks still yield
            the batches one by one, with ``batch_size`` rows each. 0 packs nothing.
        ragged: columns that always arrive as :class:`worker.RaggedColumn`, even in a batch whose arrays happen
            to share one length (undeclared array columns arrive as numpy ``[n, k]`` in such a batch). Declare
            every array column whose lengths vary, so that a training loop meets one form only.
        bucket_by: a column of arrays, strings or binary: rows of similar length are batched together within
            windows of ``bucket_window`` batches' worth of rows of a partition (sorted by length, then the
            window's batches in a shuffled order), so padding to the longest row of a batch wastes little.
            Deterministic: a retried task sends the same batches.
        batch_tokens, tokens_by: token-budget batches: a batch also ends before the sum of the lengths of column
            ``tokens_by`` (arrays, strings or binary; default ``bucket_by``, else the one ``ragged`` column) would
            exceed ``batch_tokens``; a row longer than the budget is a batch of its own. ``batch_size`` still caps
            the rows: set it high to let the tokens decide. With ``bucket_by``, rows of similar length fill each
            budget (less padding on the rank).
        bucket_bounds: coordinated buckets across ranks (with ``bucket_by``): rising lengths of ``bucket_by``'s
            column, e.g. ``(64, 128, 256, 512)``, the same for every partition; bucket ``i`` holds the rows of length
            at most ``bounds[i]``, the last one those longer than every bound (at most 63 bounds). Each batch holds
            rows of one bucket (a partition's short end of a bucket joins the next bucket's rows) and says which
            in its header, travels alone (no packs), and the broker gives the
            batches of one global step (one per rank) from one bucket, so that the ranks' steps hold similar
            token counts; the steps at the epoch's end that no bucket can fill, and its remainder, are not
            (docs/TRAINING.md, "Coordinated buckets").
        arrow_batch_rows: rows of the Arrow record batches Spark hands to the feeding tasks
            (``spark.sql.execution.arrow.maxRecordsPerBatch``, set for this job and restored after it). By default
            a whole number of batches, at most 8 and at most Spark's default of 10,000 rows: no batch then spans
            two record batches (which costs a copy), and the first batch leaves a task after 8 batches' worth of
            rows, not 10,000 (a large share of a partition of images). 0 leaves Spark's setting alone.
        key, broker_key: for a broker run with ``--auth``: this client's ``.key_secret`` file and the broker's
            ``.key`` file (a feeder key; the same paths must exist on the executors), or the variables
            ``SPARKBUS_KEY`` and ``SPARKBUS_BROKER_KEY`` (pass them to executors with ``spark.executorEnv.*``).
        recover: watch the brokers while the job runs (a HELLO each second) and recover from a lost one: a
            broker that restarted without ``--journal``, or one silent for ``timeout``. The job is cancelled and
            the partitions no live broker committed are fed again from Spark (to the restarted broker, or to
            the first live one), while the ranks say what they already used (docs/design/RECOVERY.md). False:
            such a loss fails the feed (``BrokerError``).
        resume: feed the epoch again for ranks that resume from a checkpoint (``BatchStream(resume=state)``):
            every broker first drops what it had of the epoch, delivered or not, then every partition is fed
            again to its home broker and the brokers deliver only what no rank's checkpoint used. The only way
            an epoch that was delivered is fed again (``EPOCH_OPEN`` refuses it).
    Returns:
        A :class:`FeedReport`.
    Raises:
        BrokerError: the broker is unreachable within ``timeout`` or refused the epoch; no broker is left to
            recover to (every broker lost, or the only one silent past ``timeout``: the message says what to
            do); a broker restarted without a journal and cannot recover (an older broker, or ``recover=False``:
            its batches are lost, feed the epoch again).
        FeedError: the Spark job failed (a task could not reach the broker, an RDD value is unsupported, ...),
            with the cause from the executors' traceback, on a classic and a Spark Connect session alike; or
            brokers kept being lost through ``len(brokers) + 2`` rounds of recovery. Or the
            job succeeded but the broker took fewer (or more) rows than Spark's successful tasks produced: a
            failure upstream of the feed in the same task cut an attempt's input short, and that attempt
            committed first. The epoch is then closed with what the broker holds (the ranks are not left waiting).
        TypeError: a DataFrame column of a type sparkbus cannot carry (named, with what to do), or a
            ``ragged``/``bucket_by`` name that is not such a column: found from the schema, before any job runs.
            Or ``data`` is neither a DataFrame nor an RDD.
        ValueError: ``bucket_window`` below 1; ``batch_tokens`` below 1 or without a column to count;
            ``bucket_bounds`` without ``bucket_by`` or not rising lengths (at most 63); ``resume``
            on Spark Connect with several brokers (the partition count is needed: feed through
            ``feed_epochs(..., partitions=...)``).
    """
    return _feed(data, FeedOptions(address=address, stream=stream, epoch=epoch, batch_size=batch_size, columns=columns,
                                   timeout=timeout, delivery=delivery, control=control,
                                   max_batch_bytes=max_batch_bytes, pack_bytes=pack_bytes, ragged=ragged,
                                   bucket_by=bucket_by, bucket_window=bucket_window,
                                   arrow_batch_rows=arrow_batch_rows, key=key, broker_key=broker_key,
                                   recover=recover, resume=resume, batch_tokens=batch_tokens,
                                   tokens_by=tokens_by, bucket_bounds=bucket_bounds))


def feed_watched(data: Any, address: str | Sequence[str] | None, stream: str, epoch: int,
                 losses: Sequence[Loss] = (), on_recovery: Callable[[list[Loss]], None] | None = None,
                 without: Sequence[Loss] = (), **feed_kwargs: Any) -> FeedReport:
    """:func:`feed` for ``feed_epochs`` (``feed_kwargs`` as :func:`feed`'s keywords).

    Args:
        losses: the epoch was fed and closed before, and these losses of its brokers came since: only the
            partitions no live broker committed are fed again.
        without: a new epoch, and these brokers of the feed are gone for good (an earlier epoch lost them): it is
            opened and fed at the others only, its partitions routed over them.
        on_recovery: called with the feed's losses so far before each round of recovery, so that epochs fed
            before are recovered first (a broker delivers epochs in order: the ranks need the older one's end).
    """
    options = FeedOptions(address=address, stream=stream, epoch=epoch, **feed_kwargs)
    return _feed(data, options, EpochRun(tuple(losses), tuple(without), on_recovery))


class Way(Enum):
    """How an epoch is fed, decided once per feed (:meth:`EpochRun.way`)."""

    NEW = "a new epoch, opened at every broker"
    AROUND = "a new epoch, opened at the live brokers only: others are gone for good"
    RESUME = "an epoch fed again for ranks resuming from a checkpoint"
    REFEED = "an epoch fed and closed before, lost since: only its recovery"


class EpochRun(NamedTuple):
    """What ``feed_epochs`` knows of its run when it feeds an epoch (nothing, for a plain :func:`feed`)."""

    losses: tuple[Loss, ...] = ()           # the epoch was fed before, and these losses came since
    without: tuple[Loss, ...] = ()          # brokers an earlier epoch lost (only those gone for good count)
    on_recovery: Callable[[list[Loss]], None] | None = None

    def way(self, options: FeedOptions) -> Way:
        if options.resume:
            return Way.RESUME
        if self.losses:
            return Way.REFEED
        return Way.AROUND if self.gone() else Way.NEW

    def gone(self) -> tuple[Loss, ...]:
        """The brokers gone for good before this feed."""
        return tuple(loss for loss in self.without if loss.gone)

    def adopted(self, way: Way) -> tuple[Loss, ...]:
        """The losses the feed's watch starts with: those to recover from, or the brokers to feed around."""
        return self.losses if way is Way.REFEED else self.gone() if way is Way.AROUND else ()


NO_RUN = EpochRun()     # a plain feed(): no epochs before it


def _feed(data: Any, options: FeedOptions, run: EpochRun = NO_RUN) -> FeedReport:
    """:func:`feed` as ``options`` say, in the :class:`Way` that ``run`` (``feed_epochs``) and ``options.resume``
    choose: a REFEED has no EPOCH_OPEN and no first job, only the recovery of what no live broker committed."""
    started = time.monotonic()
    stream, epoch = options.stream, options.epoch
    way = run.way(options)
    adopted = run.adopted(way)
    opens = way in (Way.NEW, Way.AROUND)        # a resume's EPOCH_RECOVER(reset) opens the epoch
    with ExitStack() as stack:
        refuse_data(data, options)     # the schema's refusals first: they need neither a broker nor a job
        # What can be checked before Spark runs anything is checked first: planning a DataFrame's RDD may already
        # run its shuffle stages (adaptive execution). An unreachable broker (refused within REFUSED_AFTER), ...
        clients = [stack.enter_context(ControlClient(c, options.timeout, key=options.key,
                                                     broker_key=options.broker_key, refused_after=REFUSED_AFTER))
                   for c in options.controls]
        gone = {loss.broker for loss in adopted if loss.gone}
        # ... an absent broker (but one already found gone), ...
        brokers = greet_brokers(clients, list(options.feeds), options.control_derived, stream, gone)
        waits = stack.enter_context(WaitsWatch([c for i, c in enumerate(options.controls) if i not in gone],
                                               stream, options.timeout, options.key, options.broker_key))
        if opens:        # ... an epoch already delivered, a stream name refused
            for i, client in enumerate(clients):
                if i not in gone:
                    check_epoch_unfed(client, stream, epoch)
        if is_dataframe(data):
            arrow_rows = arrow_rows_for(options.batch_size) if options.arrow_batch_rows is None \
                else options.arrow_batch_rows
            if arrow_rows:      # Spark reads it when it plans the job: set before, restored after the job
                stack.enter_context(spark_conf(data.sparkSession, ARROW_BATCH_CONF, str(arrow_rows)))
        job = feed_job(data, options)
        if job.reports is not None:
            stack.callback(job.reports.close)
        if not opens and job.partitions is None:     # Spark Connect: the count its maker knew, if it said
            job = job._replace(partitions=getattr(data, PARTITIONS_HINT, None))
        opened = UNKNOWN_PARTITIONS if job.partitions is None else job.partitions
        if run.on_recovery is not None:
            run.on_recovery([])     # feed_epochs: an epoch fed before and lost since goes first (a broker's order)
        if opens:
            for i, client in enumerate(clients):
                if i not in gone:
                    client.request(Kind.EPOCH_OPEN, stream=stream, epoch=epoch, partitions=opened,
                                   delivery=options.delivery, commit="driver")
        # Spark's word commits each partition (feeder.commits): from the running job, to the broker that streamed it
        committer = stack.enter_context(Committer(list(options.controls), stream, epoch, options.timeout,
                                                  job.reports, options.key, options.broker_key))
        if options.recover or way in (Way.RESUME, Way.REFEED):
            connect = is_connect_dataframe(data)
            session = data.sparkSession if connect else \
                data.sparkSession.sparkContext if is_dataframe(data) else data.context
            cancel = stack.enter_context(JobCancel(session, connect))
            watched = EpochFeed(clients, brokers, stream, epoch, options.delivery, options.timeout, cancel,
                                options.key, options.broker_key, losses=adopted, on_recovery=run.on_recovery,
                                committer=committer, before_close=waits.read_now)
            entry = {Way.NEW: watched.run, Way.AROUND: watched.feed_around, Way.RESUME: watched.resume,
                     Way.REFEED: watched.recover_fed}[way]
            try:
                outcome = entry(job)
            except (BrokerError, FeedError, ValueError):
                raise
            except Exception as exc:
                raise FeedError(explain_job_failure(exc, stream, epoch)) from exc
        else:
            outcome = _feed_unwatched(job, clients, brokers, stream, epoch, committer, waits.read_now)
        if way is not Way.REFEED:
            warn_if_no_ranks(clients, gone, stream, epoch, started)
        waits.stop()             # the last reading of the ranks' figures, with the feed's end
    partitions, reports, shares, diverged, held, taken = outcome
    produced = sum(r.rows for r in reports)
    if held is not None and held != produced:
        # Closed all the same: the ranks finish the epoch with what the broker has, instead of waiting for ever
        raise FeedError(f"stream {stream!r} epoch {epoch}: Spark's successful tasks produced {produced} rows, the "
                        f"broker took {held}. A task attempt whose input was cut short committed first: a failure "
                        f"upstream of the feed in the same task (a Python UDF, a file or shuffle read) ends the "
                        f"feeding task's input as if it were complete. {_cut_short_partitions(diverged)}The "
                        f"epoch is closed as it is; feed the data again as a new epoch (see docs/GUARANTEES.md)")
    differed = tuple(sorted(diverged))
    if differed:
        message = (f"stream {stream!r} epoch {epoch}: Spark task attempts of partitions {list(differed)} produced "
                   f"different batches (recomputed in another order?)")
        if options.delivery == "stream":
            message += "; rows of these partitions may be missing or repeated. Use delivery='atomic'."
        log.warning(message)
        warnings.warn(message, DivergedPartitionsWarning, stacklevel=2)
    if way is Way.REFEED:
        log.info("stream %r epoch %d, fed before, recovered: %d partitions fed again", stream, epoch, len(reports))
    # After a recovery whose first job was cancelled, the partitions it committed have no report: the brokers'
    # figures count the epoch instead (payload bytes, without the headers a report counts)
    batches, rows, nbytes = (sum(r.batches for r in reports), produced, sum(r.bytes for r in reports)) \
        if held is not None else taken
    streamed = [r for r in reports if r.attempt != -1]
    slowest = tuple(SlowTask(r.partition, r.host, round(r.seconds, 3))
                    for r in sorted(streamed, key=lambda r: r.seconds, reverse=True)[:SLOWEST_TASKS])
    tasks = tuple(TaskTiming(r.partition, r.host, r.started, round(r.seconds, 3), round(r.blocked, 3))
                  for r in sorted(streamed, key=lambda r: r.partition))
    return FeedReport(partitions, batches, rows, nbytes, time.monotonic() - started, differed, tuple(shares),
                      sum(r.seconds for r in streamed), sum(r.blocked for r in streamed), slowest, waits.spans(),
                      waits.queued_share(), tasks)


def _feed_unwatched(job: FeedJob, clients: list[ControlClient], brokers: list[dict], stream: str,
                    epoch: int, committer: Committer, before_close: Callable[[], None]) -> Outcome:
    """``recover=False``: the job, then the close (``before_close`` called first: the feed's last look at the
    ranks, while none can have left the epoch); a broker that restarted without a journal fails the feed."""
    try:
        reports = [PartitionReport(*r) for r in job.collect()]
    except Exception as exc:
        raise_if_a_broker_restarted(clients, brokers, stream, epoch, exc)
        raise FeedError(explain_job_failure(exc, stream, epoch)) from exc
    committer.add(reports)
    committer.flush()
    partitions = len(reports) if job.partitions is None else job.partitions     # a report per task
    shares = [sum(1 for r in reports if r.broker == i) for i in range(len(clients))]
    held = sum(taken_figures(client, stream, epoch).rows for client in clients)
    before_close()
    diverged: set[int] = set()
    for client, share in zip(clients, shares):
        try:
            closed = client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=epoch, partitions=partitions,
                                    expected=share)
        except BrokerError as exc:
            raise_if_a_broker_restarted(clients, brokers, stream, epoch, exc)
            raise
        diverged.update(closed.get("diverged", ()))
    return Outcome(partitions, reports, tuple(shares), diverged, held)


def _cut_short_partitions(diverged: set[int]) -> str:
    # The retry of a partition cut short sends seqs its committed attempt never sent: the broker calls it diverged
    return f"Partitions {sorted(diverged)[:10]} had such attempts. " if diverged else ""


# check_spark_type and prepare_dataframe live in feeder.schema now; importable from here as before
__all__ = ["feed", "FeedReport", "TaskTiming", "DivergedPartitionsWarning", "NoRanksWarning", "check_spark_type",
           "prepare_dataframe", "is_connect_dataframe"]
