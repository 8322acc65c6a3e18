"""Mixtures of DataFrames into one stream, at exact ratios: :func:`feed_mixture` (docs/MIXTURES.md).

Two parts. :class:`MixturePlan` is pure (numpy, no Spark): which row of which source fills each slot of an epoch.
:func:`mixture_epoch` builds one deterministic DataFrame per epoch from it, and :func:`feed_mixture` feeds those
epochs as ``feed_epochs`` does (one Spark job an epoch, resume, lineage recovery, several brokers, backpressure).

The plan, in short:

- **Counts per window.** A window of ``W`` consecutive slots holds ``c_s`` rows of source ``s``, ``sum c_s = W``,
  by largest remainder over ``weights`` (ties to the source first by name). Every window of every epoch alike.
- **Layout.** Where in the window each source's rows sit: a smooth weighted round-robin, fixed per plan, so that
  slot ``i`` of an epoch is (source ``s``, its ``d``-th draw of the epoch).
- **Draws and passes.** Source ``s`` draws ``D_s`` rows an epoch; its ``k``-th draw since the first epoch
  (``k = epoch * D_s + d``) is in pass ``p = k // n_s``, at position ``k % n_s`` of that pass's order: a
  permutation of the source's ``n_s`` rows fixed by ``(seed, source, p)``, so reshuffled for every pass. Passes
  count on across epochs: a large source is read without replacement until its pass ends (which may be epochs
  later), a small one repeats, each repetition in a new order.
- **Rows.** A source's row ``j`` is its ``j``-th row in partition order (``spark_partition_id`` and
  ``monotonically_increasing_id``, with offsets counted once): a source must give the same rows in the same
  partitions in the same order whenever Spark computes it (read from files or a table, ``spark.range``, cached).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

from sparkbus.feeder.driver import FeedReport
from sparkbus.feeder.epochs import default_partitions, feed_each_epoch, resumed_epoch
from sparkbus.feeder.jobs import with_partitions

log = logging.getLogger("sparkbus.feeder")

ROW_COLUMN = "__sparkbus_row"          # a source's row number, 0 .. n_s - 1 (dropped before the feed)
SLOT_COLUMN = "__sparkbus_slot"        # a row's slot in the epoch (kept under slot_column= if asked)
KEY_COLUMN = "__sparkbus_part"         # the key that places a block of slots in its partition
EXACT_WINDOW_MAX = 100                 # with batch_tokens: the smallest window up to this that is exact


# ---- the plan: pure ---------------------------------------------------------------------------------------------

def window_counts(weights: Sequence[float], window: int) -> tuple[int, ...]:
    """Rows of each source in a window of ``window`` rows: largest remainder over ``weights`` (ties: the first).

    Raises:
        ValueError: a negative weight, none positive, ``window`` below 1, or a positive weight that gets no row in
            the window (make the window larger).
    """
    if window < 1:
        raise ValueError(f"window must be at least 1 row, not {window}")
    if any(w < 0 or not math.isfinite(w) for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights must be finite, not negative, and one at least positive: {list(weights)}")
    total = math.fsum(weights)
    quotas = [w / total * window for w in weights]
    counts = [math.floor(q + 1e-9) for q in quotas]
    remainders = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in remainders[:window - sum(counts)]:
        counts[i] += 1
    starved = [i for i, (w, c) in enumerate(zip(weights, counts)) if w > 0 and c == 0]
    if starved:
        raise ValueError(f"a window of {window} rows gives no row to weights {[weights[i] for i in starved]}: "
                         f"pass a larger window=")
    return tuple(counts)


def smooth_layout(counts: Sequence[int]) -> tuple[int, ...]:
    """The source of each slot of a window: smooth weighted round-robin (each source's rows spread evenly)."""
    window = sum(counts)
    current = [0] * len(counts)
    layout = []
    for _ in range(window):
        for i, c in enumerate(counts):
            current[i] += c
        chosen = max(range(len(counts)), key=lambda i: (current[i], -i))
        current[chosen] -= window
        layout.append(chosen)
    return tuple(layout)


def exact_window(weights: Sequence[float], largest: int = EXACT_WINDOW_MAX) -> int:
    """The smallest window up to ``largest`` rows in which ``weights`` are whole numbers of rows, else ``largest``."""
    total = math.fsum(weights)
    for window in range(1, largest + 1):
        if all(abs(w / total * window - round(w / total * window)) < 1e-9 for w in weights):
            return window
    return largest


_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class PassPermutation:
    """A permutation of ``0 .. n - 1`` fixed by ``(seed, source, pass)``: a 4-round Feistel network on the
    smallest even power of two ``>= n``, cycle-walked into range. ``forward(rows)`` is each row's position in the
    pass; ``backward(positions)`` the row at each position. A pure function of its arguments and of the rows
    alone: any subset of rows is placed without the others (a Spark task sees its partition only)."""

    n: int
    seed: int
    source: str
    number: int

    @cached_property
    def _keys(self) -> tuple[np.uint64, ...]:
        name = f"{self.seed}/{self.source}/{self.number}".encode()
        return tuple(np.uint64(xxhash.xxh64_intdigest(name, seed=r)) for r in range(4))

    @cached_property
    def _half(self) -> int:
        return max(1, (max(self.n - 1, 1).bit_length() + 1) // 2)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self._half), np.uint64((1 << self._half) - 1)
        left, right = x >> half, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & mask)
        return (left << half) | right

    def _backward(self, x: np.ndarray) -> np.ndarray:
        # the rounds in reverse, each undone (left and right swap roles)
        half, mask = np.uint64(self._half), np.uint64((1 << self._half) - 1)
        left, right = x >> half, x & mask
        for key in reversed(self._keys):
            left, right = right ^ (_mix(left ^ key) & mask), left
        return (left << half) | right

    def _walk(self, x: np.ndarray, rounds: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """``rounds`` on the power-of-two domain, applied again to what falls outside ``0 .. n - 1`` (cycle walking:
        a bijection of the range, since each cycle that leaves it comes back)."""
        x = rounds(np.asarray(x, dtype=np.uint64))
        out = x >= np.uint64(self.n)
        while out.any():
            x[out] = rounds(x[out])
            out = x >= np.uint64(self.n)
        return x.astype(np.int64)

    def forward(self, rows: np.ndarray) -> np.ndarray:
        return self._walk(rows, self._forward)

    def backward(self, positions: np.ndarray) -> np.ndarray:
        return self._walk(positions, self._backward)


@dataclass(frozen=True)
class MixturePlan:
    """Which row of which source fills each slot of each epoch (module notes). Sources are indexed in sorted name
    order, so the plan does not depend on the order of a dict.

    Build with :meth:`make`; every method takes and returns numpy arrays (or ints) and needs no Spark.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]             # rows of each source
    counts: tuple[int, ...]            # rows of each source per window
    rows_per_epoch: int
    seed: int = 0

    @classmethod
    def make(cls, sizes: Mapping[str, int], weights: Mapping[str, float], window: int,
             rows_per_epoch: int | None = None, seed: int = 0) -> MixturePlan:
        """The plan of ``sizes`` (rows per source) mixed by ``weights`` in windows of ``window`` rows;
        ``rows_per_epoch`` defaults to the sources' rows together.

        Raises:
            ValueError: weights not for exactly the sources, bad weights or window (:func:`window_counts`), an
                empty source with a positive weight, ``rows_per_epoch`` below 1.
        """
        if set(weights) != set(sizes):
            raise ValueError(f"weights are for {sorted(weights)}, the sources are {sorted(sizes)}: give one weight "
                             f"per source")
        names = tuple(sorted(sizes))
        counts = window_counts([float(weights[name]) for name in names], window)
        empty = [name for name, c in zip(names, counts) if c and not sizes[name]]
        if empty:
            raise ValueError(f"source {empty[0]!r} has no rows but a weight: drop it or give it rows")
        rows = sum(sizes.values()) if rows_per_epoch is None else rows_per_epoch
        if rows < 1:
            raise ValueError(f"rows_per_epoch must be at least 1, not {rows}")
        return cls(names, tuple(int(sizes[n]) for n in names), counts, int(rows), int(seed))

    @property
    def window(self) -> int:
        return sum(self.counts)

    @cached_property
    def layout(self) -> tuple[int, ...]:
        """The source of each slot of a window."""
        return smooth_layout(self.counts)

    @cached_property
    def _offsets(self) -> tuple[np.ndarray, ...]:
        """Per source, its slots in a window, ascending."""
        layout = np.asarray(self.layout, dtype=np.int64)
        return tuple(np.flatnonzero(layout == s) for s in range(len(self.names)))

    @cached_property
    def _rank(self) -> np.ndarray:
        """Per slot of a window, how many slots of its source come before it in the window."""
        rank = np.zeros(self.window, dtype=np.int64)
        for offsets in self._offsets:
            rank[offsets] = np.arange(len(offsets))
        return rank

    def source(self, name: str) -> int:
        return self.names.index(name)

    def draws(self, source: int) -> int:
        """Rows source ``source`` gives each epoch (``D_s``): ``c_s`` a whole window and its slots in the epoch's
        last, partial window."""
        whole, tail = divmod(self.rows_per_epoch, self.window)
        return whole * self.counts[source] + int(np.count_nonzero(self._offsets[source] < tail))

    def window_of(self, epoch_slots: int) -> int:
        return epoch_slots // self.window

    def slots(self, source: int, epoch: int, k: np.ndarray) -> np.ndarray:
        """The slots in ``epoch`` of source ``source``'s draws ``k`` (counted since epoch 0; each must be one of the
        epoch's, ``epoch * D_s <= k < (epoch + 1) * D_s``)."""
        d = np.asarray(k, dtype=np.int64) - epoch * self.draws(source)
        w, r = np.divmod(d, self.counts[source])
        return w * self.window + self._offsets[source][r]

    def at(self, epoch: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, k)`` of each slot of ``epoch``: the inverse of :meth:`slots`."""
        w, i = np.divmod(np.asarray(slots, dtype=np.int64), self.window)
        source = np.asarray(self.layout, dtype=np.int64)[i]
        counts = np.asarray(self.counts, dtype=np.int64)[source]
        draws = np.asarray([self.draws(s) for s in range(len(self.names))], dtype=np.int64)[source]
        return source, epoch * draws + w * counts + self._rank[i]

    def permutation(self, source: int, number: int) -> PassPermutation:
        """Pass ``number`` of source ``source``'s order."""
        return PassPermutation(self.sizes[source], self.seed, self.names[source], number)

    def passes(self, source: int, k: np.ndarray) -> np.ndarray:
        return np.asarray(k, dtype=np.int64) // self.sizes[source]

    def rows(self, source: int, k: np.ndarray) -> np.ndarray:
        """The row (0 .. n_s - 1) of source ``source`` drawn at each ``k``."""
        k = np.asarray(k, dtype=np.int64)
        out = np.empty(len(k), dtype=np.int64)
        number, position = np.divmod(k, self.sizes[source])
        for p in np.unique(number):
            at = number == p
            out[at] = self.permutation(source, int(p)).backward(position[at])
        return out

    def epoch_draws(self, source: int, epoch: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which of ``rows`` (row numbers of source ``source``, any subset) ``epoch`` draws, and where:
        ``(index, slot)``, ``index`` into ``rows`` (a row drawn twice, in two passes, is there twice)."""
        rows = np.asarray(rows, dtype=np.int64)
        n, draws = self.sizes[source], self.draws(source)
        first, last = epoch * draws, (epoch + 1) * draws          # the epoch's draws: first <= k < last
        index, ks = [], []
        for number in range(first // n, (last - 1) // n + 1 if draws else first // n):
            k = number * n + self.permutation(source, number).forward(rows)
            inside = np.flatnonzero((k >= first) & (k < last))
            index.append(inside)
            ks.append(k[inside])
        if not index:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        at, k = np.concatenate(index), np.concatenate(ks)
        return at, self.slots(source, epoch, k)


# ---- Spark: one DataFrame an epoch -------------------------------------------------------------------------------

@dataclass(frozen=True)
class IndexedSource:
    """A source with its row number column (``ROW_COLUMN``) and its row count."""

    name: str
    frame: Any
    rows: int


def index_source(name: str, df: Any) -> IndexedSource:
    """``df`` with each row's number in partition order: one job counts the rows of each partition (Spark
    Connect too), and the number is ``offset[partition] + the row's place in its partition``."""
    from pyspark.sql import functions as F

    for reserved in (ROW_COLUMN, SLOT_COLUMN, KEY_COLUMN):
        if reserved in df.columns:
            raise ValueError(f"source {name!r} has a column named {reserved!r}, which feed_mixture uses")
    counts = {r[0]: r[1] for r in df.select(F.spark_partition_id().alias("p")).groupBy("p").count().collect()}
    offsets, total = [], 0
    for partition in range(max(counts, default=-1) + 1):
        offsets.append(total)
        total += counts.get(partition, 0)
    part = F.spark_partition_id()
    place = F.monotonically_increasing_id() - F.shiftleft(part.cast("long"), 33)
    offset = F.element_at(F.array(*[F.lit(o) for o in offsets or [0]]).cast("array<long>"), part + 1)
    return IndexedSource(name, df.select("*", (offset + place).alias(ROW_COLUMN)), total)


def _drawing(plan: MixturePlan, name: str, epoch: int, source_column: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The ``mapInArrow`` function that keeps a source's rows ``epoch`` draws, each with its source and slot."""
    source = plan.source(name)

    def draw(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for batch in batches:
            rows = batch.column(ROW_COLUMN).to_numpy(zero_copy_only=False)
            if len(rows) and (rows.min() < 0 or rows.max() >= plan.sizes[source]):
                raise ValueError(f"source {name!r} gave row {int(rows.max())} of {plan.sizes[source]} counted: it "
                                 f"changed since it was counted (a source must be deterministic: docs/MIXTURES.md)")
            at, slots = plan.epoch_draws(source, epoch, rows)
            kept = batch.drop_columns([ROW_COLUMN]).take(pa.array(at))
            yield kept.append_column(source_column, pa.array([name] * len(at), pa.string())) \
                      .append_column(SLOT_COLUMN, pa.array(slots, pa.int64()))

    return draw


def partition_keys(spark: Any, partitions: int) -> list[int]:
    """A key per partition ``b`` that ``repartition(partitions, key)`` places in partition ``b`` (Spark's own
    ``pmod(hash(key), partitions)``, asked once): blocks of slots land in their partitions exactly, with no
    sampling job (a range partitioning would run one per epoch, computing the sources twice)."""
    from pyspark.sql import functions as F

    keys: dict[int, int] = {}
    start, span = 0, 32 * partitions + 64
    while len(keys) < partitions:
        rows = (spark.range(start, start + span).select("id", F.pmod(F.hash("id"), F.lit(partitions)).alias("b"))
                .groupBy("b").agg(F.min("id")).collect())
        for b, key in rows:
            keys.setdefault(int(b), int(key))
        start += span
    return [keys[b] for b in range(partitions)]


def mixture_epoch(sources: Sequence[IndexedSource], plan: MixturePlan, epoch: int, block: int, keys: Sequence[int],
                  source_column: str = "source", slot_column: str | None = None) -> Any:
    """Epoch ``epoch`` of the mixture as one DataFrame: the sources' columns, ``source_column`` (the source's name)
    and, with ``slot_column``, each row's slot. Partition ``b`` holds slots ``b * block .. (b + 1) * block - 1``
    (``len(keys)`` partitions), sorted: batches of ``batch_size`` rows cut from it (``block`` a multiple of it)
    hold whole windows when the window divides ``batch_size``."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    parts = []
    for source in sources:
        fields = [f for f in source.frame.schema.fields if f.name != ROW_COLUMN]
        schema = StructType([*fields, StructField(source_column, StringType(), False),
                             StructField(SLOT_COLUMN, LongType(), False)])
        parts.append(source.frame.mapInArrow(_drawing(plan, source.name, epoch, source_column), schema))
    data = parts[0]
    for part in parts[1:]:
        data = data.unionByName(part)
    key = F.element_at(F.array(*[F.lit(k) for k in keys]).cast("array<long>"),
                       (F.floor(F.col(SLOT_COLUMN) / block) + 1).cast("int"))
    data = (data.withColumn(KEY_COLUMN, key).repartition(len(keys), KEY_COLUMN)
            .sortWithinPartitions(SLOT_COLUMN).drop(KEY_COLUMN))
    return data.withColumnRenamed(SLOT_COLUMN, slot_column) if slot_column else data.drop(SLOT_COLUMN)


def block_rows(rows_per_epoch: int, partitions: int, align: int) -> int:
    """Rows of each partition of an epoch: ``rows_per_epoch`` over ``partitions``, rounded up to ``align``."""
    per = -(-rows_per_epoch // max(partitions, 1))
    return -(-per // align) * align


# ---- feed_mixture ------------------------------------------------------------------------------------------------

def feed_mixture(sources: Mapping[str, Any], address: str | Sequence[str] | None, *, weights: Mapping[str, float],
                 rows_per_epoch: int | None = None, epochs: int = 1, stream: str = "train", seed: int = 0,
                 first_epoch: int = 0, window: int | None = None, source_column: str = "source",
                 slot_column: str | None = None, partitions: int | None = None,
                 on_epoch: Callable[[int, FeedReport], None] | None = None,
                 resume: Mapping[str, Any] | Sequence[Mapping[str, Any]] | int | None = None,
                 wait_delivered: bool = False, **feed_kwargs: Any) -> list[FeedReport]:
    """Feed epochs of a mixture of DataFrames to ``stream``, each source at its weight, exactly per window.

    One Spark job an epoch over every source (docs/MIXTURES.md): a deterministic plan from ``seed`` decides which
    row of which source fills each slot of an epoch; the epoch's DataFrame is fed as :func:`feeder.feed_epochs`
    feeds one (the next epoch's Spark work overlapping the ranks' training, resume, lineage recovery, several
    brokers, backpressure).

    Args:
        sources: name → Spark DataFrame, all with the same columns. Each must be deterministic: the same rows in
            the same partitions in the same order whenever Spark computes it (files, tables, ``spark.range``, or
            cached). Each is counted once (one small job).
        address: the brokers' feed address(es), as :func:`feeder.feed`.
        weights: name → weight (any positive scale; normalised). One per source.
        rows_per_epoch: rows of an epoch; default: the sources' rows together.
        epochs: how many epochs to feed.
        stream: the stream name.
        seed: the plan's seed (the order of every pass of every source).
        first_epoch: the first epoch number; the plan depends on the epoch's number, not on where the run started.
        window: rows per window of exact counts. Default: ``batch_size`` (every full batch holds the counts), or
            with ``batch_tokens`` the smallest window up to 100 rows in which the weights are whole numbers.
        source_column: the column naming each row's source (a string), added to every batch.
        slot_column: if given, also each row's slot in its epoch (int64), e.g. to check the plan.
        partitions: tasks per epoch (default: the sources' partitions together); each a contiguous run of slots.
        on_epoch: called with ``(epoch, report)`` after each epoch is fed.
        resume: a rank's ``state_dict()``, every rank's (a list), or an epoch number, as ``feed_epochs``: the
            resumed epoch delivers exactly what no rank's checkpoint used, and the plan goes on from there.
        wait_delivered: as ``feed_epochs``.
        **feed_kwargs: passed to :func:`feeder.feed` (``batch_size``, ``ragged``, ``batch_tokens``, ``timeout``, ...).
    Returns:
        One :class:`FeedReport` per epoch fed.
    Raises:
        ValueError: weights not one per source, or bad (:func:`window_counts`); sources of different columns; a
            column named like the internal ones; ``resume`` of another stream or outside the epochs.
        BrokerError, FeedError, TypeError: as :func:`feeder.feed`.
    """
    check_sources(sources, weights, source_column, slot_column)
    if epochs < 0 or first_epoch < 0:
        raise ValueError(f"epochs ({epochs}) and first_epoch ({first_epoch}) must not be negative")
    start = first_epoch if resume is None else resumed_epoch(resume, stream)
    if not first_epoch <= start < first_epoch + max(epochs, 1):
        raise ValueError(f"resume at epoch {start} is not one of the epochs to feed, {first_epoch} to "
                         f"{first_epoch + epochs - 1}")
    batch_size = feed_kwargs.get("batch_size", 1024)
    by_tokens = feed_kwargs.get("batch_tokens") is not None
    if window is None:
        window = exact_window(list(weights.values())) if by_tokens else batch_size
    window_counts([float(w) for w in weights.values()], window)          # refused before any Spark job
    if feed_kwargs.get("columns") is not None:
        feed_kwargs["columns"] = [*feed_kwargs["columns"], *[c for c in (source_column, slot_column)
                                                             if c and c not in feed_kwargs["columns"]]]
    indexed = [index_source(name, sources[name]) for name in sorted(sources)]
    plan = MixturePlan.make({s.name: s.rows for s in indexed}, weights, window, rows_per_epoch, seed)
    if partitions is None:
        partitions = sum(default_partitions(sources[s.name]) for s in indexed)
    block = block_rows(plan.rows_per_epoch, partitions, window if by_tokens else batch_size)
    keys = partition_keys(indexed[0].frame.sparkSession, -(-plan.rows_per_epoch // block))
    log.info("stream %r: a mixture of %s, %s rows per window of %d, %d rows an epoch in %d partitions, seed %d",
             stream, ", ".join(plan.names), "/".join(map(str, plan.counts)), plan.window, plan.rows_per_epoch,
             len(keys), seed)
    # the loop of feed_epochs, with a DataFrame of its own each epoch
    return feed_each_epoch(
        lambda epoch: with_partitions(mixture_epoch(indexed, plan, epoch, block, keys, source_column, slot_column),
                                      len(keys)),
        address, stream, range(start, first_epoch + epochs), resume is not None, feed_kwargs, on_epoch,
        wait_delivered)


def check_sources(sources: Mapping[str, Any], weights: Mapping[str, float], source_column: str,
                  slot_column: str | None) -> None:
    """What ``feed_mixture`` refuses before any Spark job: no source, weights not one per source, sources of other
    columns, a column named like the source or slot column.

    Raises:
        ValueError: saying which.
    """
    if not sources:
        raise ValueError("feed_mixture needs at least one source")
    if set(weights) != set(sources):
        raise ValueError(f"weights are for {sorted(weights)}, the sources are {sorted(sources)}: give one weight per "
                         f"source")
    columns = {name: list(df.columns) for name, df in sources.items()}
    if len({tuple(sorted(c)) for c in columns.values()}) > 1:
        raise ValueError(f"the sources' columns differ: {columns}")
    clash = [c for c in (source_column, slot_column) if c and c in next(iter(columns.values()))]
    if clash or source_column == slot_column:
        raise ValueError(f"the sources have a column {(clash or [source_column])[0]!r}: pass another "
                         f"source_column= or slot_column=")


__all__ = ["MixturePlan", "PassPermutation", "feed_mixture", "mixture_epoch", "window_counts", "smooth_layout"]
