"""The driver's side of a feed: open the epoch, run one Spark job whose tasks stream, close the epoch."""

from __future__ import annotations

import inspect
import logging
import re
import secrets
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

from sparkbus.broker.client import ControlClient
from sparkbus.broker.partitions import MAX_PARTITIONS
from sparkbus.feeder.columns import partition_messages, record_batches_from_rows
from sparkbus.feeder.commits import AccumulatorReports, Committer, ReportChannel, StreamedReports
from sparkbus.feeder.recovery import EpochFeed, FeedJob, JobCancel, Loss, Outcome, taken_figures
from sparkbus.feeder.routes import Routes
from sparkbus.feeder.task import DEFAULT_PACK_BYTES, PartitionReport, attempt_id, stream_messages
from sparkbus.wire.address import feed_and_control_addresses
from sparkbus.wire.errors import BrokerError, BrokerUnreachable, FeedError
from sparkbus.wire.protocol import ErrorCode, Kind

log = logging.getLogger("sparkbus.feeder")
DEFAULT_MAX_BATCH_BYTES = 16 << 20
REPORT_SCHEMA = ("partition long, batches long, rows long, bytes long, seconds double, broker long, attempt long, "
                 "messages long")
# EPOCH_OPEN's partitions when the count is known only once the job has run (Spark Connect): the broker's limit,
# an upper bound that EPOCH_CLOSE lowers to the count of the job's reports (docs/PROTOCOL.md)
UNKNOWN_PARTITIONS = MAX_PARTITIONS


class DivergedPartitionsWarning(UserWarning):
    """Spark recomputed partitions differently across task attempts; in stream delivery rows may be off."""


class NoRanksWarning(UserWarning):
    """A feed closed an epoch of a stream that no rank has joined, a grace after the feed started: the epoch waits
    for ranks of that stream. Right when the ranks start later; otherwise their ``stream=`` differs from the feed's."""


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


def feed(data: Any, address: str | Sequence[str] | None = None, stream: str = "train", epoch: int = 0,
         batch_size: int = 1024, columns: Sequence[str] | None = None, timeout: float = 60.0, *,
         delivery: str = "stream", control: str | Sequence[str] | None = None,
         max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES, pack_bytes: int = DEFAULT_PACK_BYTES,
         ragged: Sequence[str] = (), bucket_by: str | None = None, bucket_window: int = 64,
         arrow_batch_rows: int | None = None, key: str | None = None,
         broker_key: str | None = None, recover: bool = True, resume: bool = False) -> FeedReport:
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
            such a loss fails the feed (``BrokerError``), as before version 6.
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
        ValueError: ``bucket_window`` below 1; ``resume`` on Spark Connect with several brokers (the partition
            count is needed: feed through ``feed_epochs(..., partitions=...)``).
    """
    return _feed(data, address, stream, epoch, batch_size, columns, timeout, delivery, control, max_batch_bytes,
                 pack_bytes, ragged, bucket_by, bucket_window, arrow_batch_rows, key, broker_key, recover, resume)


def feed_watched(data: Any, address: str | Sequence[str] | None, stream: str, epoch: int,
                 losses: Sequence[Loss] = (), on_recovery: Callable[[list[Loss]], None] | None = None,
                 without: Sequence[Loss] = (), **feed_kwargs: Any) -> FeedReport:
    """:func:`feed` for ``feed_epochs`` (``feed_kwargs`` as :func:`feed`'s).

    Args:
        losses: the epoch was fed and closed before, and these losses of its brokers came since: only the
            partitions no live broker committed are fed again.
        without: a new epoch, and these brokers of the feed are gone for good (an earlier epoch lost them): it is
            opened and fed at the others only, its partitions routed over them.
        on_recovery: called with the feed's losses so far before each round of recovery, so that epochs fed
            before are recovered first (a broker delivers epochs in order: the ranks need the older one's end).
    """
    bound = inspect.signature(feed).bind(data, address, stream, epoch, **feed_kwargs)
    bound.apply_defaults()
    return _feed(**bound.arguments, losses=losses, on_recovery=on_recovery, without=without)


def _feed(data: Any, address: str | Sequence[str] | None, stream: str, epoch: int, batch_size: int,
          columns: Sequence[str] | None, timeout: float, delivery: str, control: str | Sequence[str] | None,
          max_batch_bytes: int, pack_bytes: int, ragged: Sequence[str], bucket_by: str | None, bucket_window: int,
          arrow_batch_rows: int | None, key: str | None, broker_key: str | None, recover: bool, resume: bool,
          losses: Sequence[Loss] = (), on_recovery: Callable[[list[Loss]], None] | None = None,
          without: Sequence[Loss] = ()) -> FeedReport:
    """:func:`feed`; with ``losses``, an epoch fed already whose brokers lost it since (``feed_epochs``): no
    EPOCH_OPEN, no first job, only the recovery of what no live broker committed."""

    started = time.monotonic()
    feeds, controls = feed_and_control_addresses(address, control)
    if bucket_window < 1:
        raise ValueError(f"bucket_window must be at least 1, not {bucket_window}")
    settings = dict(feed_address=feeds, control_address=controls, stream=stream, epoch=epoch, timeout=timeout,
                    key=key, broker_key=broker_key)
    cutting = dict(batch_size=batch_size, max_bytes=max_batch_bytes, pack_bytes=pack_bytes, ragged=tuple(ragged),
                   bucket_by=bucket_by, bucket_window=bucket_window)
    with ExitStack() as stack:
        if _is_dataframe(data):     # the schema's refusals first: they need neither a broker nor a job
            prepare_dataframe(data, columns, ragged, bucket_by)
        elif not hasattr(data, "mapPartitionsWithIndex"):
            _rdd_job(data, cutting, settings)       # raises the TypeError that says what feed() takes
        # What can be checked before Spark runs anything is checked first: planning a DataFrame's RDD may already
        # run its shuffle stages (adaptive execution). An unreachable broker (refused within REFUSED_AFTER), ...
        clients = [stack.enter_context(ControlClient(c, timeout, key=key, broker_key=broker_key,
                                                     refused_after=REFUSED_AFTER)) for c in controls]
        without = [] if losses or resume else [loss for loss in without if loss.gone]
        gone = {loss.broker for loss in [*losses, *without] if loss.gone}
        # ... an absent broker (but one already found gone), ...
        brokers = greet_brokers(clients, feeds, control is None, stream, gone)
        if not resume and not losses:        # ... an epoch already delivered, a stream name refused
            for i, client in enumerate(clients):
                if i not in gone:
                    check_epoch_unfed(client, stream, epoch)
        if _is_dataframe(data):
            arrow_rows = arrow_rows_for(batch_size) if arrow_batch_rows is None else arrow_batch_rows
            if arrow_rows:      # Spark reads it when it plans the job: set before, restored after the job
                stack.enter_context(_spark_conf(data.sparkSession, ARROW_BATCH_CONF, str(arrow_rows)))
            job = _spark_job(data, lambda run, routes, channel: _dataframe_job(data, columns, cutting, run, settings,
                                                                               channel, routes))
        else:
            job = _rdd_job(data, cutting, settings)
        if job.reports is not None:
            stack.callback(job.reports.close)
        if (resume or losses) and job.partitions is None:     # Spark Connect: the count its maker knew, if it said
            job = job._replace(partitions=getattr(data, PARTITIONS_HINT, None))
        opened = UNKNOWN_PARTITIONS if job.partitions is None else job.partitions
        if on_recovery is not None:
            on_recovery([])     # feed_epochs: an epoch fed before and lost since goes first (a broker's order)
        if not resume and not losses:      # a resume's EPOCH_RECOVER(reset) opens the epoch
            for i, client in enumerate(clients):
                if i not in gone:
                    client.request(Kind.EPOCH_OPEN, stream=stream, epoch=epoch, partitions=opened, delivery=delivery,
                                   commit="driver")
        # Spark's word commits each partition (feeder.commits): from the running job, to the broker that streamed it
        committer = stack.enter_context(Committer(controls, stream, epoch, timeout, job.reports, key, broker_key))
        if recover or resume or losses:
            connect = is_connect_dataframe(data)
            session = data.sparkSession if connect else \
                data.sparkSession.sparkContext if _is_dataframe(data) else data.context
            cancel = stack.enter_context(JobCancel(session, connect))
            watched = EpochFeed(clients, brokers, stream, epoch, delivery, timeout, cancel, key, broker_key,
                                losses=[*losses, *without], on_recovery=on_recovery, committer=committer)
            try:
                outcome = watched.run(job, resume=resume, fed=bool(losses), around=bool(without))
            except (BrokerError, FeedError, ValueError):
                raise
            except Exception as exc:
                raise FeedError(_explain_job_failure(exc, stream, epoch)) from exc
        else:
            outcome = _feed_unwatched(job, clients, brokers, stream, epoch, committer)
        if not losses:
            warn_if_no_ranks(clients, gone, stream, epoch, started)
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
        if delivery == "stream":
            message += "; rows of these partitions may be missing or repeated. Use delivery='atomic'."
        log.warning(message)
        warnings.warn(message, DivergedPartitionsWarning, stacklevel=2)
    if losses:
        log.info("stream %r epoch %d, fed before, recovered: %d partitions fed again", stream, epoch, len(reports))
    # After a recovery whose first job was cancelled, the partitions it committed have no report: the brokers'
    # figures count the epoch instead (payload bytes, without the headers a report counts)
    batches, rows, nbytes = (sum(r.batches for r in reports), produced, sum(r.bytes for r in reports)) \
        if held is not None else taken
    return FeedReport(partitions, batches, rows, nbytes, time.monotonic() - started, differed, tuple(shares))


def _feed_unwatched(job: FeedJob, clients: list[ControlClient], brokers: list[dict], stream: str,
                    epoch: int, committer: Committer) -> Outcome:
    """``recover=False``: the job, then the close; a broker that restarted without a journal fails the feed."""
    try:
        reports = [PartitionReport(*r) for r in job.collect()]
    except Exception as exc:
        _raise_if_a_broker_restarted(clients, brokers, stream, epoch, exc)
        raise FeedError(_explain_job_failure(exc, stream, epoch)) from exc
    committer.add(reports)
    committer.flush()
    partitions = len(reports) if job.partitions is None else job.partitions     # a report per task
    shares = [sum(1 for r in reports if r.broker == i) for i in range(len(clients))]
    held = sum(taken_figures(client, stream, epoch)[1] for client in clients)
    diverged: set[int] = set()
    for client, share in zip(clients, shares):
        try:
            closed = client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=epoch, partitions=partitions,
                                    expected=share)
        except BrokerError as exc:
            _raise_if_a_broker_restarted(clients, brokers, stream, epoch, exc)
            raise
        diverged.update(closed.get("diverged", ()))
    return Outcome(partitions, reports, tuple(shares), diverged, held)


REFUSED_AFTER = 3.0     # seconds of refused connections after which a feed fails, before any Spark job runs


def greet_brokers(clients: list[ControlClient], feeds: list[str], derived: bool, stream: str,
                  gone: set[int] | frozenset[int] = frozenset()) -> list[dict]:
    """Every broker's WELCOME (``{}`` for one in ``gone``): a feeder's HELLO, which proves the broker is there.

    Raises:
        BrokerUnreachable: a control address refused every connection for ``REFUSED_AFTER`` seconds: the message
            names the feed address as the user gave it and the control address that refused (``derived``: the
            feed port + 2, not given with ``control=``).
        BrokerError: as :meth:`ControlClient.hello` (a broker connected but silent for ``timeout``, a refusal).
    """
    try:
        return [{} if i in gone else client.hello("feeder", stream) for i, client in enumerate(clients)]
    except BrokerUnreachable as exc:
        i = next(i for i, c in enumerate(clients) if c.address == exc.address)
        raise BrokerUnreachable(unreachable_message(feeds[i], exc.address, derived, stream), exc.address) from None


def unreachable_message(feed_address: str, control: str, derived: bool, stream: str) -> str:
    """What a feed says when nothing listens at a broker's control address, naming the address the user typed."""
    if derived:
        how = "the feed port + 2" if control.startswith("tcp://") else "derived from it"
        where = (f"no sparkbus broker at {feed_address}: its control address {control} ({how}) refused every "
                 f"connection for {REFUSED_AFTER:g} s")
        fix = ("Start the broker (sparkbus broker), or give the feed address it listens on; a broker whose control "
               "address is not the feed port + 2 is named with control=")
    else:
        where = (f"no sparkbus broker at the control address {control} (given with control=, for the feed address "
                 f"{feed_address}): it refused every connection for {REFUSED_AFTER:g} s")
        fix = "Start the broker, or give the control address it listens on"
    return f"{where}, so no Spark job ran for stream {stream!r}. {fix}."


NO_RANKS_GRACE = 5.0    # seconds from a feed's start in which its stream's ranks may still join, before a warning
_warned_no_ranks: set[tuple[str, ...]] = set()     # (stream, control addresses...): warned once, waited for once


def warn_if_no_ranks(clients: list[ControlClient], gone: set[int], stream: str, epoch: int, started: float) -> None:
    """Once an epoch is closed: if no rank reads ``stream`` at any live broker (``WELCOME.ranks``), wait until
    ``NO_RANKS_GRACE`` seconds after the feed ``started`` for one to join, then warn (:class:`NoRanksWarning`),
    naming the streams the brokers' ranks do read. A broker that does not say (older, or silent) says nothing.
    Once per stream and brokers in a process: a run that feeds ahead of its ranks waits one grace, not one an epoch."""
    live = [client for i, client in enumerate(clients) if i not in gone]
    warned = (stream, *(client.address for client in live))
    if warned in _warned_no_ranks:
        return
    while True:
        try:
            counts = [client.hello("feeder", stream, timeout=min(client.timeout, 5.0)).get("ranks") for client in live]
        except BrokerError:
            return
        if not counts or any(count is None or count > 0 for count in counts) or _ended(live, stream, epoch):
            return
        left = started + NO_RANKS_GRACE - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(left, 0.5))
    _warned_no_ranks.add(warned)
    read: set[str] = set()
    for client in live:
        try:
            streams = client.request(Kind.STATS_REQUEST, timeout=min(client.timeout, 5.0))["stats"]["streams"]
        except (BrokerError, KeyError, TypeError):
            continue
        read.update(name for name, figures in streams.items() if figures.get("ranks") or figures.get("orphans"))
    reading = f"ranks read {', '.join(map(repr, sorted(read)))}" if read else "no rank has joined any stream"
    warnings.warn(f"stream {stream!r} epoch {epoch} is fed, but no rank reads stream {stream!r} at "
                  f"{', '.join(c.address for c in live)} ({reading}) {NO_RANKS_GRACE:g} s after the feed began: the "
                  f"epoch waits for ranks of stream {stream!r}. If they start later, ignore this; otherwise give the "
                  f"ranks and the feed the same stream=", NoRanksWarning, stacklevel=4)


def _ended(clients: list[ControlClient], stream: str, epoch: int) -> bool:
    """Whether a broker already ended the epoch on its ranks: they read it and left (a short epoch), not absent."""
    for client in clients:
        try:
            state = client.request(Kind.EPOCH_QUERY, timeout=min(client.timeout, 5.0), stream=stream, epoch=epoch)
        except BrokerError:
            continue
        if state.get("ended") or state.get("delivered"):
            return True
    return False


def check_epoch_unfed(client: ControlClient, stream: str, epoch: int) -> None:
    """Refuse, before any Spark job, an epoch the broker has delivered already (``EPOCH_QUERY``) or a stream name
    it would refuse: the same refusals as ``EPOCH_OPEN``'s, minutes of Spark start-up earlier."""
    answer = client.request(Kind.EPOCH_QUERY, stream=stream, epoch=epoch)
    if answer.get("ended") or answer.get("delivered"):
        raise BrokerError(f"the broker at {client.address} refused EPOCH_OPEN: stream {stream!r} has already "
                          f"delivered epoch {epoch}; feed a new epoch number or a new stream name (checked before "
                          f"any Spark job ran)", code=ErrorCode.REFUSED)


ARROW_BATCH_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
SPARK_ARROW_BATCH_ROWS = 10_000         # Spark's default of that setting


def arrow_rows_for(batch_size: int) -> int:
    """Rows of the Arrow record batches a feed asks Spark for: a whole number of batches (see ``feed``)."""
    return batch_size * max(1, min(8, SPARK_ARROW_BATCH_ROWS // batch_size))


@contextmanager
def _spark_conf(session: Any, key: str, value: str) -> Iterator[None]:
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


def _cut_short_partitions(diverged: set[int]) -> str:
    # The retry of a partition cut short sends seqs its committed attempt never sent: the broker calls it diverged
    return f"Partitions {sorted(diverged)[:10]} had such attempts. " if diverged else ""


def _raise_if_a_broker_restarted(clients: list[ControlClient], before: list[dict], stream: str, epoch: int,
                                 cause: Exception) -> None:
    for client, hello in zip(clients, before):
        try:
            now = client.hello("feeder", stream)
        except BrokerError:
            continue
        if now.get("incarnation") != hello.get("incarnation") and not now.get("journal"):
            raise BrokerError(f"the broker at {client.address} restarted while stream {stream!r} epoch {epoch} was "
                              f"being fed, and it runs without --journal: the batches it held are lost. Feed the "
                              f"epoch again (a new epoch number or stream), or run the broker with --journal to "
                              f"survive restarts") from cause


def _is_dataframe(data: Any) -> bool:
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


def _spark_job(data: Any, make: Callable[[int, Routes | None, ReportChannel], Any]) -> FeedJob:
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


def _dataframe_job(df: Any, columns: Sequence[str] | None, cutting: dict, run: int, settings: dict,
                   channel: ReportChannel, routes: Routes | None = None):
    import pyarrow as pa

    prepared = prepare_dataframe(df, columns, cutting["ragged"], cutting["bucket_by"])
    report_schema = pa.schema([("partition", pa.int64()), ("batches", pa.int64()), ("rows", pa.int64()),
                               ("bytes", pa.int64()), ("seconds", pa.float64()), ("broker", pa.int64()),
                               ("attempt", pa.int64()), ("messages", pa.int64())])
    accumulated = channel if isinstance(channel, AccumulatorReports) else None
    epoch = settings["epoch"]

    def stream_arrow_partition(record_batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        task = _task_context()
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


def _rdd_job(rdd: Any, cutting: dict, settings: dict) -> FeedJob:
    if not hasattr(rdd, "mapPartitionsWithIndex"):
        raise TypeError(f"feed() takes a Spark DataFrame (of a classic or a Spark Connect session) or an RDD "
                        f"(of a classic session only: Spark Connect has no RDDs; make a DataFrame of the rows, "
                        f"e.g. spark.createDataFrame), not {type(rdd).__name__}")
    epoch = settings["epoch"]
    channel = AccumulatorReports(rdd.context)

    def mapped(run: int, routes: Routes | None) -> Any:
        def stream_rows(index: int, rows: Iterator[Any]) -> list[tuple]:
            route = None if routes is None else routes.route(index)
            if routes is not None and route is None:
                return [tuple(PartitionReport(index, -1, 0, 0, 0.0, -1))]
            attempt = attempt_id(run, _task_context().taskAttemptId())
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


def _task_context() -> Any:
    """The running Spark task's context (inside a task only)."""
    from pyspark import TaskContext

    task = TaskContext.get()
    if task is None:
        raise RuntimeError("sparkbus's feed function runs inside a Spark task only")
    return task


def prepare_dataframe(df: Any, columns: Sequence[str] | None = None, ragged: Sequence[str] = (),
                      bucket_by: str | None = None) -> Any:
    """Select the columns to feed, turning ML vectors into arrays; refuse what sparkbus cannot carry, by name.

    Everything is decided from the schema, before any Spark job runs.

    Raises:
        TypeError: a column whose type sparkbus cannot carry (with what to do about it), a name that is not a
            column, or a ``ragged``/``bucket_by`` column that is not an array, binary or string column.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT

    names = list(columns) if columns is not None else df.columns
    fields = {f.name: f.dataType for f in df.schema.fields}
    selected = []
    for name in names:
        if name not in fields:
            raise TypeError(f"column {name!r} is not in the DataFrame (columns: {', '.join(df.columns)})")
        kind = fields[name]
        if isinstance(kind, VectorUDT):
            selected.append(vector_to_array(df[name]).alias(name))
            continue
        check_spark_type(name, kind)
        selected.append(df[name])
    if not selected:
        raise TypeError("no columns to feed")
    flat = flat_spark_fields(names, fields)
    for option, wanted in (("ragged", list(ragged)), ("bucket_by", [bucket_by] if bucket_by else [])):
        for name in wanted:
            if name not in flat:
                raise TypeError(f"{option} names {name!r}, which is not a fed column (fed: {', '.join(flat)})")
            if not flat[name]:
                raise TypeError(f"{option} names {name!r}, which is not a column of arrays, binary or strings")
    return df.select(*selected)


def check_spark_type(name: str, kind: Any, inside: str = "") -> None:
    """Raise TypeError, naming the column and what to do, for a Spark type sparkbus cannot carry exactly."""
    from pyspark.sql import types as T

    carried = (T.BooleanType, T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType,
               T.BinaryType, T.StringType, T.DateType, T.TimestampType, T.TimestampNTZType, T.DayTimeIntervalType)
    if isinstance(kind, carried):
        return
    if isinstance(kind, T.ArrayType):
        return check_spark_type(name, kind.elementType, "an array of ")
    if isinstance(kind, T.StructType):
        if inside:
            raise TypeError(f"column {name!r} holds arrays of structs ({kind.simpleString()}), which sparkbus "
                            f"cannot carry: select each field as an array of its own (e.g. "
                            f"transform({name}, x -> x.field)) or use to_json")
        for field in kind.fields:
            check_spark_type(f"{name}.{field.name}", field.dataType)
        return
    if isinstance(kind, T.DecimalType):
        raise TypeError(f"column {name!r} is {inside}{kind.simpleString()}, which sparkbus cannot carry exactly: "
                        f"cast it in Spark, e.g. df.withColumn({name!r}, df[{name!r}].cast('double')) (SQL "
                        f"literals such as id * 1.5 make decimals)")
    if isinstance(kind, T.MapType):
        raise TypeError(f"column {name!r} is {inside}a map ({kind.simpleString()}), which sparkbus cannot carry: "
                        f"send map_keys({name}) and map_values({name}) as two array columns, or to_json({name})")
    if isinstance(kind, T.NullType):
        raise TypeError(f"column {name!r} has no type (only nulls, e.g. lit(None)): cast it to the type its "
                        f"values would have")
    raise TypeError(f"column {name!r} is {inside}{kind.simpleString()}, which sparkbus cannot carry exactly "
                    f"(numbers, booleans, binary, strings, dates, timestamps, arrays and structs of those, "
                    f"ML vectors)")


def flat_spark_fields(names: Sequence[str], fields: dict[str, Any]) -> dict[str, bool]:
    """The columns as the ranks will see them (structs flattened to ``parent.child``), each with whether it is
    a column of arrays, binary or strings (which ``ragged`` and ``bucket_by`` may name)."""
    from pyspark.ml.linalg import VectorUDT
    from pyspark.sql import types as T

    flat: dict[str, bool] = {}

    def add(name: str, kind: Any) -> None:
        if isinstance(kind, T.StructType):
            for field in kind.fields:
                add(f"{name}.{field.name}", field.dataType)
        else:
            flat[name] = isinstance(kind, (T.ArrayType, T.BinaryType, T.StringType, VectorUDT))

    for name in names:
        add(name, fields[name])
    return flat


def _explain_job_failure(exc: Exception, stream: str, epoch: int) -> str:
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


__all__ = ["feed", "FeedReport", "DivergedPartitionsWarning", "NoRanksWarning", "check_spark_type", "prepare_dataframe",
           "is_connect_dataframe"]
