"""Feed several epochs of one DataFrame, reshuffled globally in Spark each epoch, back to back.

``feed_epochs`` calls :func:`feeder.feed` once per epoch. ``feed`` returns as soon as the broker holds every
batch of the epoch, not when the ranks have consumed them, so epoch ``e + 1`` is fed while the ranks still
train on epoch ``e``: the Spark work of the next epoch overlaps the training of this one. The broker's
``--max-buffer`` holds the feed back when it runs ahead (backpressure reaches the Spark tasks), and the broker
delivers epochs whole and in order, so the ranks see no difference.

Order guarantees of the reshuffle (:func:`epoch_order`)
-------------------------------------------------------
Every row gets ``h = xxhash64(seed, epoch, key columns)``. Rows go to partition ``pmod(murmur3(h), P)`` and are
sorted by ``h`` (then by the key columns, when a key is given) within their partition. Both are functions of the
row's key values alone, so for the same ``(shuffle_seed, epoch, key values, partitions)``:

- **reproducible**: which rows each partition holds and their order in it, hence (with the same ``batch_size``)
  the rows of every batch ``(partition, seq)`` and their order in it. This holds however the input DataFrame is
  partitioned or ordered, and when Spark recomputes it (nothing depends on ``rand()`` or on task order).
- **not reproducible**: which rank receives which batch, and in what order batches reach a rank. That depends
  on task scheduling and on how fast each rank trains (credits). A rank's sequence of batches is different on
  every run, even with the same seed.
- **ties**: rows with equal key values get the same ``h``; their relative order follows the input. With the
  default key (every column) only identical rows tie, and swapping identical rows changes nothing. Distinct
  keys collide in 64 bits with probability about ``n**2 / 2**65`` over ``n`` rows; with an explicit unique key
  the key itself breaks such ties.

Each (row, epoch) pair hashes independently, so each epoch's order is as good as a uniformly random permutation,
unrelated to the order of any other epoch.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sparkbus.broker.client import ControlClient
from sparkbus.feeder.brokers import REFUSED_AFTER, greet_brokers
from sparkbus.feeder.driver import FeedReport, feed, feed_watched
from sparkbus.feeder.jobs import is_connect_dataframe, with_partitions
from sparkbus.feeder.recovery import CANNOT_RECOVER
from sparkbus.feeder.routes import read_query
from sparkbus.feeder.watch import WATCH_INTERVAL, BrokerWatch, Loss
from sparkbus.wire.address import feed_and_control_addresses
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.protocol import Kind

log = logging.getLogger("sparkbus.feeder")

ORDER_COLUMN = "__sparkbus_order"


def epoch_order(df: Any, epoch: int, seed: int, key: Sequence[str] | None = None,
                partitions: int | None = None) -> Any:
    """``df`` reordered for one epoch: a global shuffle fixed by ``(seed, epoch, key)`` (see the module notes).

    Args:
        df: a Spark DataFrame.
        epoch: the epoch number; each epoch gets an independent order.
        seed: the shuffle seed.
        key: columns whose values identify a row (e.g. ``["id"]``); default: every column. A key must not
            change when the DataFrame is recomputed.
        partitions: partitions of the result (tasks of the feed job); default: :func:`default_partitions`.
    Returns:
        A DataFrame with the same columns and rows as ``df``, ``partitions`` partitions, in the epoch's order.
    Raises:
        TypeError: a key column that is not in ``df``.
        ValueError: ``partitions`` below 1, or no default on a Spark Connect session (see
            :func:`default_partitions`).
    """
    from pyspark.sql import functions as F

    names = list(key) if key is not None else list(df.columns)
    missing = [name for name in names if name not in df.columns]
    if missing or not names:
        raise TypeError(f"shuffle key {missing or names!r} is not a set of columns of the DataFrame "
                        f"(columns: {', '.join(df.columns)})")
    count = partitions if partitions is not None else default_partitions(df)
    if count < 1:
        raise ValueError(f"partitions must be at least 1, not {count}")
    order = F.xxhash64(F.lit(int(seed)), F.lit(int(epoch)), *[df[name] for name in names])
    # repartition(n, col) places rows by murmur3(col) mod n: a function of the row alone, and with an explicit
    # n adaptive query execution keeps the n partitions. No sampling job, unlike a range partitioning.
    tie_break = names if key is not None else []
    return (df.withColumn(ORDER_COLUMN, order)
            .repartition(count, ORDER_COLUMN)
            .sortWithinPartitions(ORDER_COLUMN, *tie_break)
            .drop(ORDER_COLUMN))


def default_partitions(df: Any) -> int:
    """The partitions of a reshuffled epoch when none are asked for.

    On a classic session: those of ``df`` (its RDD's). A Spark Connect session has no RDD to ask, and a
    DataFrame does not tell its partition count; there it is ``spark.sql.shuffle.partitions``, the count that
    Spark gives a shuffle itself (``df.repartition(column)``). Counting ``df``'s partitions instead (a job over
    ``spark_partition_id()``) would read all of its lineage once more before every epoch.

    Raises:
        ValueError: on Spark Connect, ``spark.sql.shuffle.partitions`` is not a number (Databricks' ``auto``):
            pass ``partitions``.
    """
    if not is_connect_dataframe(df):
        return df.rdd.getNumPartitions()
    setting = df.sparkSession.conf.get("spark.sql.shuffle.partitions")
    try:
        return int(setting)
    except (TypeError, ValueError):
        raise ValueError(f"a Spark Connect DataFrame does not tell its partitions, and spark.sql.shuffle.partitions "
                         f"is {setting!r}: pass partitions= (the tasks of each epoch's feed)") from None


def feed_epochs(df: Any, address: str | Sequence[str] | None, epochs: int, stream: str = "train",
                shuffle_seed: int | None = None, first_epoch: int = 0, *, shuffle: bool = True,
                key: Sequence[str] | None = None, partitions: int | None = None,
                on_epoch: Callable[[int, FeedReport], None] | None = None,
                resume: Mapping[str, Any] | Sequence[Mapping[str, Any]] | int | None = None,
                wait_delivered: bool = False,
                **feed_kwargs: Any) -> list[FeedReport]:
    """Feed epochs ``first_epoch .. first_epoch + epochs - 1`` of ``df`` to ``stream``, one after the other.

    Each epoch is reshuffled with :func:`epoch_order` (unless ``shuffle`` is false) and streamed with
    :func:`feeder.feed`. The next epoch's feed starts as soon as the broker holds the previous one, while the
    ranks still train on it; ``--max-buffer`` bounds how far the feed runs ahead. Cache ``df`` (``df.cache()``)
    when it is expensive: each epoch reads it again.

    Args:
        df: a Spark DataFrame (see :func:`feeder.feed` for the column types).
        address: the broker's feed address, e.g. ``tcp://broker-host:5555``, or several (see :func:`feeder.feed`).
        epochs: how many epochs to feed.
        stream: the stream name.
        shuffle_seed: the seed of the reshuffle. ``None`` draws one at random and logs it (INFO), so a run can
            be repeated with the same order.
        first_epoch: the first epoch number (e.g. to resume: see docs/TRAINING.md). The order of an epoch
            depends on its number, not on where the run started.
        shuffle: false to feed ``df`` in its own order every epoch (e.g. a validation set).
        key: the columns identifying a row for the reshuffle (default: every column).
        partitions: tasks per reshuffled epoch (default: the partitions of ``df``; on Spark Connect, where a
            DataFrame does not tell them, ``spark.sql.shuffle.partitions``: see :func:`default_partitions`).
        on_epoch: called with ``(epoch, report)`` after each epoch is fed, e.g. to log progress.
        resume: resume mid-epoch from a checkpoint, exactly (docs/TRAINING.md): a rank's
            ``BatchStream.state_dict()`` saved with the model (its ``stream`` must be this one), or an epoch
            number. Epochs from that epoch to ``first_epoch + epochs - 1`` are fed; the resumed epoch is fed
            again whole (``feed(..., resume=True)``: the brokers drop what they had of it and of every later epoch,
            delivered or not, and deliver only what no rank's checkpoint used), the later ones as usual (the run
            that died may have fed them, and its ranks trained part of them: the model has seen none). Start the
            ranks with ``BatchStream(..., resume=state)``.
        wait_delivered: after the last epoch is fed, keep watching the epochs not delivered yet (every broker
            sent their end), and recover them from a lost broker, until they are delivered. By default
            ``feed_epochs`` returns when the last epoch is fed; the epochs fed before are watched while the later
            ones are fed.
        **feed_kwargs: passed to :func:`feeder.feed` (``batch_size``, ``columns``, ``timeout``, ``control``,
            ``max_batch_bytes``, ``recover``). ``timeout`` also bounds a task blocked by backpressure: make it
            longer than the longest pause of the ranks' consumption (a validation pass, a checkpoint).
    Returns:
        One :class:`FeedReport` per epoch fed, in order (from the resumed epoch on, with ``resume``).
    Raises:
        BrokerError, FeedError, TypeError: as :func:`feeder.feed` (a broker lost while an epoch is fed is
            recovered from; one that cannot be is a ``BrokerError``); the epochs fed before the failure stay fed.
        ValueError: a negative ``epochs`` or ``first_epoch``; no default ``partitions`` (see above); a
            ``resume`` state of another stream, or an epoch outside the epochs to feed.
    """
    if epochs < 0 or first_epoch < 0:
        raise ValueError(f"epochs ({epochs}) and first_epoch ({first_epoch}) must not be negative")
    seed = shuffle_seed if shuffle_seed is not None else secrets.randbits(31)
    if shuffle and shuffle_seed is None:
        log.info("stream %r: shuffle seed %d (pass shuffle_seed=%d to feed the same orders again)",
                 stream, seed, seed)
    if shuffle and partitions is None and epochs:
        partitions = default_partitions(df)     # once: every epoch gets the same count
    start = first_epoch if resume is None else resumed_epoch(resume, stream)
    if not first_epoch <= start < first_epoch + max(epochs, 1):
        raise ValueError(f"resume at epoch {start} is not one of the epochs to feed, {first_epoch} to "
                         f"{first_epoch + epochs - 1}")

    def epoch_data(epoch: int) -> Any:
        data = epoch_order(df, epoch, seed, key, partitions) if shuffle else df
        return with_partitions(data, partitions) if partitions is not None else data

    return feed_each_epoch(epoch_data, address, stream, range(start, first_epoch + epochs),
                           resume is not None, feed_kwargs, on_epoch, wait_delivered)


def feed_each_epoch(epoch_data: Callable[[int], Any], address: str | Sequence[str] | None, stream: str,
                    epochs: range, resume: bool, feed_kwargs: dict[str, Any],
                    on_epoch: Callable[[int, FeedReport], None] | None = None,
                    wait_delivered: bool = False) -> list[FeedReport]:
    """The loop of :func:`feed_epochs` (and of ``feed_mixture``): each epoch's data (``epoch_data(epoch)``, the
    same whenever it is asked for) fed in turn, the first as a resume if ``resume``; the epochs fed before
    watched (:class:`FedEpochs`) and fed again from a lost broker, until delivered."""
    reports = []
    watching = feed_kwargs.get("recover", True) and len(epochs) > 0
    fed = FedEpochs(address, stream, feed_kwargs) if watching else None
    try:
        for epoch in epochs:
            data = epoch_data(epoch)
            again = resume and epoch == epochs.start
            if fed is None:
                report = feed(data, address, stream=stream, epoch=epoch, resume=again, **feed_kwargs)
            else:
                fed.check()           # a loss since the last epoch: recover the epochs fed before first
                while True:
                    try:
                        report = feed_watched(data, address, stream, epoch, on_recovery=fed.recover, resume=again,
                                              without=fed.gone(), **feed_kwargs)
                        break
                    except BrokerError as exc:
                        # A broker that went silent just as this epoch began fails its HELLO (a feed fails fast
                        # on an absent broker): if it is gone for good, the epoch goes through the others
                        if exc.code is not None or not fed.lost_another():
                            raise
            log.info("stream %r epoch %d fed: %d rows in %d batches from %d partitions in %.1f s",
                     stream, epoch, report.rows, report.batches, report.partitions, report.seconds)
            reports.append(report)
            if fed is not None:
                fed.add(epoch, data)
                fed.check()
            if on_epoch is not None:
                on_epoch(epoch, report)
        while fed is not None and wait_delivered and fed.pending:
            fed.wait()
    finally:
        if fed is not None:
            fed.close()
    return reports


class FedEpochs:
    """The epochs ``feed_epochs`` fed that not every live broker has delivered yet (``EPOCH_QUERY.ended``),
    watched (:class:`feeder.watch.BrokerWatch`): a broker lost after an epoch was fed loses that epoch's
    batches too, and :meth:`check` feeds again what no live broker committed (:func:`feeder.driver.feed_watched`,
    the same ``epoch_order``), as the feed itself does for the epoch it is feeding."""

    def __init__(self, address: str | Sequence[str] | None, stream: str, feed_kwargs: dict[str, Any]) -> None:
        self.address, self.stream, self.feed_kwargs = address, stream, feed_kwargs
        feeds, controls = feed_and_control_addresses(address, feed_kwargs.get("control"))
        timeout = feed_kwargs.get("timeout", 60.0)
        key, broker_key = feed_kwargs.get("key"), feed_kwargs.get("broker_key")
        self.clients = [ControlClient(c, timeout, key=key, broker_key=broker_key, refused_after=REFUSED_AFTER)
                        for c in controls]
        try:      # an address where nothing listens fails the run before any Spark job
            welcomes = greet_brokers(self.clients, feeds, not feed_kwargs.get("control"), stream)
        except BrokerError:
            self.close()
            raise
        self.watch = BrokerWatch(controls, welcomes, stream, timeout, key, broker_key).start()
        self.pending: dict[int, Any] = {}
        self.handled: set[tuple[int, str]] = set()       # losses recovered from: (broker, incarnation)

    def add(self, epoch: int, data: Any) -> None:
        self.pending[epoch] = data

    def gone(self) -> list[Loss]:
        """The brokers of the run found gone for good: the next epochs are fed at the others."""
        return [loss for loss in self.watch.losses if loss.gone]

    def lost_another(self) -> bool:
        """Ask every broker once more (a silent one until its timeout is up): whether one more is gone for good."""
        mark = self.watch.mark()
        self.watch.sweep(self.clients)
        return any(loss.gone for loss in self.watch.losses_since(mark))

    def recover(self, losses: list[Loss]) -> None:
        """Re-feed the pending epochs after losses not recovered from yet (each is recovered from once): those
        given (a feed's) and those this watch found, asking every broker now. Called by the next epoch's feed
        before it opens its epoch and before each of its rounds of recovery: a broker that lost an epoch must be
        given it again before the next one, which it would deliver in its place."""
        self.watch.sweep(self.clients)
        self.watch.adopt([loss for loss in losses if loss not in self.watch.losses])    # the feed's watch saw them
        losses = list(dict.fromkeys([*self.watch.losses, *losses]))
        new = [loss for loss in losses if (loss.broker, loss.incarnation) not in self.handled]
        if not new:
            return
        self.handled.update((loss.broker, loss.incarnation) for loss in new)
        for epoch, data in sorted(self.pending.items()):
            log.warning("stream %r epoch %d, fed before, is recovered after losing %s", self.stream, epoch,
                        ", ".join(loss.incarnation for loss in new))
            feed_watched(data, self.address, self.stream, epoch, losses, **self.feed_kwargs)

    def check(self) -> None:
        """Re-feed the pending epochs after a loss; forget those every live broker has delivered."""
        self.recover([])
        live = self.watch.live()
        for epoch in sorted(self.pending):
            try:
                ended = all(read_query(self.clients[i].request(Kind.EPOCH_QUERY, stream=self.stream,
                                                               epoch=epoch)).ended for i in live)
            except BrokerError as exc:
                if exc.code in CANNOT_RECOVER:
                    self.pending.clear()        # an older broker: nothing to watch with
                    return
                continue                        # silent: the watch decides whether it is gone
            if ended:
                del self.pending[epoch]

    def wait(self) -> None:
        """One more look after a watch interval (``wait_delivered``)."""
        time.sleep(WATCH_INTERVAL)
        self.check()

    def close(self) -> None:
        if getattr(self, "watch", None) is not None:
            self.watch.stop()
        for client in self.clients:
            client.close()


def resumed_epoch(resume: Mapping[str, Any] | Sequence[Mapping[str, Any]] | int, stream: str) -> int:
    """The epoch a resume starts at: a rank's ``BatchStream.state_dict()`` (of ``stream``), every rank's (a list:
    a resume on another number of ranks), or an epoch number.

    Raises:
        ValueError: a state of another stream, without an epoch, or a negative epoch.
        TypeError: neither a state nor an int.
    """
    if isinstance(resume, Sequence) and not isinstance(resume, (str, bytes)) and resume:
        epochs = {resumed_epoch(one, stream) for one in resume}          # every rank's state of one checkpoint
        if len(epochs) != 1:
            raise ValueError(f"the resume states are of epochs {sorted(epochs)}: pass the states of one checkpoint")
        return epochs.pop()
    if isinstance(resume, Mapping):
        if resume.get("stream") != stream:
            raise ValueError(f"the resume state is of stream {resume.get('stream')!r}, not {stream!r}: pass the "
                             f"state_dict() of a rank of this stream")
        epoch = resume.get("epoch")
    else:
        epoch = resume
    if type(epoch) is not int:
        raise TypeError(f"resume takes a BatchStream.state_dict() or an epoch number, not {type(resume).__name__}")
    if epoch < 0:
        raise ValueError(f"resume at a negative epoch ({epoch})")
    return epoch


__all__ = ["epoch_order", "feed_epochs", "default_partitions", "ORDER_COLUMN"]
