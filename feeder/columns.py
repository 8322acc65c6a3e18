"""A partition's rows to messages: Arrow record batches cut into batches, packed, and put in wire form.

The path of a DataFrame partition, without per-row Python:

1. :func:`flatten_record_batch`: structs become ``parent.child`` columns; every type is checked once.
2. :func:`cut`: batches of ``batch_size`` rows, fewer where ``max_bytes`` would be exceeded (bytes counted per row,
   so the cap holds for variable-length rows; a single row larger than the cap travels alone). A batch is a slice
   of a record batch; only a batch that spans two record batches is concatenated (one copy).
   :func:`bucketed` instead sorts windows of rows by the length of one column first (length bucketing);
   :func:`bucketed_by_bounds` also keeps each batch within one length bucket of fixed bounds (coordinated buckets).
3. :func:`messages`: consecutive small batches as packs (one message, several batches: see ``pack_bytes``). The
   batches of a pack that are slices of one record batch are one slice of it: no copy.
4. :meth:`RecordBatchPlan.wire`: each column's Arrow buffers, sliced, become the frames. A record batch's
   columns are read once (:class:`~feeder.arrow.ColumnPlan`); cutting a batch out of them is numpy slicing.

RDD rows take the same path once :func:`record_batches_from_rows` has made record batches of them (that step is
Python per row, as any RDD of Python objects is).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkbus.feeder.arrow import ColumnPlan, UnsupportedColumn, check_type, flatten_structs
from sparkbus.wire.codec import BucketColumns
from sparkbus.wire.ragged import WireColumn

Columns = dict[str, np.ndarray]
Message = tuple[dict[str, WireColumn], "list[int] | None"]
MAX_PACK_BATCHES = 64


class RecordBatchPlan:
    """A (flattened) record batch with a :class:`~feeder.arrow.ColumnPlan` per column: what batches are cut from."""

    def __init__(self, batch: pa.RecordBatch, ragged: frozenset = frozenset()):
        self.batch, self.ragged = batch, ragged
        self.columns = [ColumnPlan(name, array, name in ragged)
                        for name, array in zip(batch.schema.names, batch.columns)]

    @property
    def rows(self) -> int:
        return self.batch.num_rows

    def row_bytes(self) -> np.ndarray | int:
        """Payload bytes of each row (an int when all rows have the same size)."""
        return sum((c.row_bytes() for c in self.columns), 0)

    def form(self, start: int, n: int) -> tuple:
        return tuple(c.form(start, n) for c in self.columns)

    def wire(self, start: int, n: int) -> dict[str, WireColumn]:
        return {c.name: c.wire(start, n) for c in self.columns}


class Batch(NamedTuple):
    """One batch cut from a partition: rows ``start .. start + rows`` of one record batch's plan."""

    plan: RecordBatchPlan
    start: int
    rows: int
    nbytes: int                       # payload bytes, as counted for ``max_bytes`` and ``pack_bytes``

    def record_batch(self) -> pa.RecordBatch:
        return self.plan.batch.slice(self.start, self.rows)


# ---- 1. types and structs ---------------------------------------------------------------------------------

def flatten_record_batch(batch: pa.RecordBatch, checked: dict | None = None) -> pa.RecordBatch:
    """``batch`` with struct columns flattened to ``parent.child`` columns (nested structs the same way).

    Args:
        checked: a dict kept by the caller: schemas already checked are not checked again.
    Raises:
        UnsupportedColumn: a column sparkbus cannot carry (named, with what to do).
    """
    schema = batch.schema
    has_structs = None if checked is None else checked.get(schema)
    if has_structs is None:
        for field in schema:
            check_type(field.name, field.type)
        has_structs = any(pa.types.is_struct(f.type) for f in schema)
        if checked is not None:
            checked[schema] = has_structs
    if not has_structs:
        return batch
    names, arrays = [], []
    for field, column in zip(schema, batch.columns):
        for name, array in flatten_structs(field.name, column):
            names.append(name)
            arrays.append(array)
    return pa.RecordBatch.from_arrays(arrays, names=names)


# ---- 2. cutting ---------------------------------------------------------------------------------------------

def cut(plans: Iterable[RecordBatchPlan], batch_size: int, max_bytes: int, tokens_by: str | None = None,
        batch_tokens: int = 0) -> Iterator[Batch]:
    """Batches of exactly ``batch_size`` rows, fewer where ``max_bytes`` would be exceeded (or, with
    ``batch_tokens``, the sum of the lengths of column ``tokens_by``); the last may be short.

    A row larger than ``max_bytes`` (or longer than ``batch_tokens``) is a batch of its own (the broker's
    ``--max-message`` still bounds it). A batch that spans two record batches is concatenated (one copy); every
    other batch is a row range of one.
    """
    pending: list[Batch] = []
    pending_rows = pending_bytes = pending_tokens = 0

    def emit() -> Batch:
        nonlocal pending, pending_rows, pending_bytes, pending_tokens
        batch = pending[0] if len(pending) == 1 else _joined(pending)
        pending, pending_rows, pending_bytes, pending_tokens = [], 0, 0, 0
        return batch

    for plan in plans:
        n = plan.rows
        if not n:
            continue
        if pending and pending[0].plan.batch.schema != plan.batch.schema:
            yield emit()                  # RDD chunks may infer other types: batches do not mix them
        sizes = plan.row_bytes()
        fixed = sizes if isinstance(sizes, int) else None           # bytes of every row, when they are equal
        cumulative = np.cumsum(sizes) if fixed is None else np.zeros(0, np.int64)
        tokens = np.cumsum(row_lengths(_column(plan.batch, tokens_by))) if batch_tokens and tokens_by else None
        start = 0
        while start < n:
            room_rows, room_bytes = batch_size - pending_rows, max_bytes - pending_bytes
            if fixed is not None:
                take = min(room_rows, n - start, room_bytes // max(fixed, 1))
            else:
                base = int(cumulative[start - 1]) if start else 0
                fits = int(np.searchsorted(cumulative, base + room_bytes, side="right")) - start
                take = min(room_rows, n - start, fits)
            if tokens is not None:
                base = int(tokens[start - 1]) if start else 0
                room = batch_tokens - pending_tokens
                take = min(take, int(np.searchsorted(tokens, base + room, side="right")) - start)
            if take <= 0:
                if pending:
                    yield emit()
                    continue
                take = 1
            taken = take * fixed if fixed is not None else \
                int(cumulative[start + take - 1]) - (int(cumulative[start - 1]) if start else 0)
            pending.append(Batch(plan, start, take, taken))
            pending_rows += take
            pending_bytes += taken
            if tokens is not None:
                pending_tokens += int(tokens[start + take - 1]) - (int(tokens[start - 1]) if start else 0)
            start += take
            if pending_rows >= batch_size or start < n:
                yield emit()
    if pending:
        yield emit()


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    if name not in batch.schema.names:
        raise KeyError(f"batch_tokens counts the lengths of {name!r}, which is not a column (columns: "
                       f"{', '.join(batch.schema.names)})")
    return batch.column(name)


def _joined(pieces: list[Batch]) -> Batch:
    """Row ranges of several record batches as one batch (the one copy of a batch that spans them)."""
    data = pa.concat_batches([p.record_batch() for p in pieces])
    return Batch(RecordBatchPlan(data, pieces[0].plan.ragged), 0, data.num_rows, sum(p.nbytes for p in pieces))


def bucketed(record_batches: Iterable[pa.RecordBatch], batch_size: int, max_bytes: int, column: str,
             window: int, seed: Sequence[int], ragged: frozenset = frozenset(), tokens_by: str | None = None,
             batch_tokens: int = 0) -> Iterator[Batch]:
    """Length bucketing: windows of ``window * batch_size`` rows, each sorted by the length of ``column`` (stable),
    cut into batches, and yielded in an order shuffled by ``(seed, window number)``.

    Rows of similar length share a batch, so padding to the longest row of a batch wastes little. Everything
    depends on the partition's rows alone, so a retried task sends the very same batches. The sort is one copy.
    """
    for number, (held, _) in enumerate(_windows(record_batches, window * batch_size)):
        if held:
            yield from _sorted_window(held, batch_size, max_bytes, column, (*seed, number), ragged, tokens_by,
                                      batch_tokens)


def _windows(record_batches: Iterable[pa.RecordBatch], window_rows: int
             ) -> Iterator[tuple[list[pa.RecordBatch], bool]]:
    """The rows of ``record_batches`` in windows of ``window_rows`` (slices, no copy), each with whether it is the
    last: every full window as it fills, then what is left (perhaps nothing) as the last."""
    held: list[pa.RecordBatch] = []
    rows = 0
    for record_batch in record_batches:
        while record_batch.num_rows:
            take = min(window_rows - rows, record_batch.num_rows)
            held.append(record_batch.slice(0, take))
            rows += take
            record_batch = record_batch.slice(take)
            if rows == window_rows:
                yield held, False
                held, rows = [], 0
    yield held, True


def _sorted_window(pieces: list[pa.RecordBatch], batch_size: int, max_bytes: int, column: str,
                   seed: Sequence[int], ragged: frozenset, tokens_by: str | None = None,
                   batch_tokens: int = 0) -> Iterator[Batch]:
    data = pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)
    if column not in data.schema.names:
        raise KeyError(f"bucket_by names {column!r}, which is not a column (columns: {', '.join(data.schema.names)})")
    order = np.argsort(row_lengths(data.column(column)), kind="stable")
    batches = list(cut([RecordBatchPlan(data.take(pa.array(order)), ragged)], batch_size, max_bytes, tokens_by,
                       batch_tokens))
    rng = np.random.default_rng([abs(int(s)) for s in seed])
    for i in rng.permutation(len(batches)):
        yield batches[i]


def bucketed_by_bounds(record_batches: Iterable[pa.RecordBatch], batch_size: int, max_bytes: int, column: str,
                       bounds: Sequence[int], window: int, seed: Sequence[int], ragged: frozenset = frozenset(),
                       tokens_by: str | None = None, batch_tokens: int = 0) -> Iterator[tuple[int, Batch]]:
    """Coordinated buckets: batches that each hold rows of one length bucket, with the bucket's index.

    Bucket ``i`` holds the rows whose length of ``column`` is at most ``bounds[i]`` (and above ``bounds[i - 1]``);
    the last bucket (``len(bounds)``) the rows longer than every bound. The bounds are the feed's, the same in every
    partition, so that the broker can give the ranks one step's batches from one bucket. As :func:`bucketed`: windows
    of ``window * batch_size`` rows, sorted by length (stable), cut into batches, yielded in an order shuffled by
    ``(seed, window number)``. A bucket's last batch of a window is carried into the next window (it is likely
    short); in the partition's last window, a bucket's last batch, if short, joins the next bucket's rows instead
    (a short batch would make its step far from its peers'), except into the last bucket, which has no bound to
    keep the lengths together: a partition has at most two short batches. A batch of bucket ``i`` holds no row
    longer than ``bounds[i]``; one batch per bucket of the last window may hold rows of the buckets below too.
    Everything depends on the partition's rows alone, so a retried task sends the very same batches.

    Yields:
        ``(bucket, batch)``.
    """
    carried: list[pa.RecordBatch] = []
    for number, (held, last) in enumerate(_windows(record_batches, window * batch_size)):
        pieces = carried + held
        if pieces:
            out, carried = _bucketed_window(pieces, batch_size, max_bytes, column, bounds, ragged, tokens_by,
                                            batch_tokens, last)
            rng = np.random.default_rng([abs(int(s)) for s in (*seed, number)])
            for i in rng.permutation(len(out)):
                yield out[i]


def _bucketed_window(pieces: list[pa.RecordBatch], batch_size: int, max_bytes: int, column: str,
                     bounds: Sequence[int], ragged: frozenset, tokens_by: str | None, batch_tokens: int,
                     last: bool) -> tuple[list[tuple[int, Batch]], list[pa.RecordBatch]]:
    """One window of :func:`bucketed_by_bounds`: its batches, and (unless ``last``) each bucket's last batch's
    rows, carried into the next window; in the ``last``, a bucket's short last batch goes on into the next bucket
    (not into the last bucket)."""
    data = pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)
    if column not in data.schema.names:
        raise KeyError(f"bucket_by names {column!r}, which is not a column (columns: {', '.join(data.schema.names)})")
    lengths = row_lengths(data.column(column))
    order = np.argsort(lengths, kind="stable")
    ordered = data.take(pa.array(order))
    edges = [0, *np.searchsorted(lengths[order], bounds, side="right").tolist(), ordered.num_rows]
    out: list[tuple[int, Batch]] = []
    carried: list[pa.RecordBatch] = []
    end: tuple[int, Batch] | None = None      # the last window: the short end so far, into the next bucket's rows
    for bucket, (lo, hi) in enumerate(zip(edges, edges[1:])):
        if hi <= lo:
            continue
        rows = ordered.slice(lo, hi - lo)
        if end is not None:
            rows = pa.concat_batches([end[1].record_batch(), rows])
        batches = list(cut([RecordBatchPlan(rows, ragged)], batch_size, max_bytes, tokens_by, batch_tokens))
        end = None
        if not last:
            carried.append(batches.pop().record_batch())
        elif bucket < len(bounds) - 1 and _short(batches[-1], batch_size, tokens_by, batch_tokens):
            end = (bucket, batches.pop())     # into the next bucket's rows; not the last bucket's, which has no bound
        out.extend((bucket, batch) for batch in batches)
    if end is not None:
        out.append(end)
    return out, carried


def _short(batch: Batch, batch_size: int, tokens_by: str | None, batch_tokens: int) -> bool:
    """Whether a bucket's last batch is short: fewer rows than ``batch_size`` and, with a token budget, under half
    of it (a budget's batch seldom holds ``batch_size`` rows)."""
    if batch.rows >= batch_size:
        return False
    if batch_tokens and tokens_by:
        return 2 * int(row_lengths(_column(batch.record_batch(), tokens_by)).sum()) < batch_tokens
    return True


def row_lengths(array: pa.Array) -> np.ndarray:
    """The length of each row of a list, binary or string column (0 for a null row), as numpy int64."""
    kind = array.type
    if pa.types.is_binary(kind) or pa.types.is_string(kind) or pa.types.is_large_binary(kind) \
            or pa.types.is_large_string(kind):
        lengths = pc.binary_length(array)
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        lengths = pc.list_value_length(array)
    else:
        raise TypeError(f"bucket_by needs a column of arrays, binary or strings, not {kind}")
    return lengths.fill_null(0).to_numpy().astype(np.int64, copy=False)


# ---- 3. packs and 4. wire form --------------------------------------------------------------------------

def messages(batches: Iterable[Batch], pack_bytes: int, max_batches: int = MAX_PACK_BATCHES) -> Iterator[Message]:
    """Each batch as a message of wire columns, or consecutive small batches as one pack.

    A batch smaller than ``pack_bytes / 2`` joins the pack of the batches before it while the pack stays within
    ``pack_bytes`` and ``max_batches`` and its batches have the same forms (a list column dense in all of them
    with the same shape, or ragged in all), so that every batch arrives on the rank in the form it would have
    alone. The batches of a pack that follow each other in one record batch are one row range of it: no copy.
    Packs depend on the batches alone, never on timing, so a retried task sends the very same packs.

    Yields:
        ``(columns, splits)``: ``splits`` is None for a batch alone, and the rows of each batch for a pack.
    """
    group: list[Batch] = []
    group_bytes = 0
    group_form: Any = None
    for batch in batches:
        alone = 2 * batch.nbytes >= pack_bytes
        form = None if alone else batch.plan.form(batch.start, batch.rows)
        if group and (alone or group_bytes + batch.nbytes > pack_bytes or len(group) == max_batches
                      or form != group_form or batch.plan.batch.schema != group[0].plan.batch.schema):
            yield _pack(group)
            group, group_bytes = [], 0
        if alone:
            yield batch.plan.wire(batch.start, batch.rows), None
        else:
            if not group:
                group_form = form
            group.append(batch)
            group_bytes += batch.nbytes
    if group:
        yield _pack(group)


def _pack(group: list[Batch]) -> Message:
    first = group[0]
    if len(group) == 1:
        return first.plan.wire(first.start, first.rows), None
    splits = [b.rows for b in group]
    contiguous = all(b.plan is first.plan and b.start == first.start + sum(splits[:i]) for i, b in enumerate(group))
    if contiguous:
        return first.plan.wire(first.start, sum(splits)), splits
    joined = _joined(group)
    return joined.plan.wire(0, joined.rows), splits


def wire_columns(batch: pa.RecordBatch, ragged: frozenset | Sequence[str] = ()) -> dict[str, WireColumn]:
    """Every column of a (flattened) record batch in wire form."""
    return RecordBatchPlan(batch, frozenset(ragged)).wire(0, batch.num_rows)


def partition_messages(record_batches: Iterable[pa.RecordBatch], batch_size: int, max_bytes: int, pack_bytes: int,
                       ragged: Sequence[str] = (), bucket_by: str | None = None, bucket_window: int = 64,
                       seed: Sequence[int] = (0,), tokens_by: str | None = None,
                       batch_tokens: int | None = None, bucket_bounds: Sequence[int] | None = None
                       ) -> Iterator[Message]:
    """The whole path of a partition (steps 1-4 of the module notes): its record batches to wire messages.

    With ``bucket_bounds`` (coordinated buckets, :func:`bucketed_by_bounds`), every batch is a message of its own,
    never packed (a step of every rank is one batch of one bucket), its columns a
    :class:`~wire.codec.BucketColumns` that carries its bucket into the header."""
    checked: dict = {}
    declared = frozenset(ragged)
    budget = batch_tokens or 0
    flat = (flatten_record_batch(b, checked) for b in record_batches)
    if bucket_by and bucket_bounds:
        return ((BucketColumns(batch.plan.wire(batch.start, batch.rows), bucket), None)
                for bucket, batch in bucketed_by_bounds(flat, batch_size, max_bytes, bucket_by, bucket_bounds,
                                                        bucket_window, seed, declared, tokens_by, budget))
    batches = bucketed(flat, batch_size, max_bytes, bucket_by, bucket_window, seed, declared, tokens_by, budget) \
        if bucket_by else cut((RecordBatchPlan(b, declared) for b in flat), batch_size, max_bytes, tokens_by, budget)
    return messages(batches, pack_bytes)


# ---- RDD rows -----------------------------------------------------------------------------------------------

def record_batches_from_rows(rows: Iterable[Any], size: int) -> Iterator[pa.RecordBatch]:
    """Python rows of an RDD in record batches of ``size`` rows.

    Rows are dicts (keys are column names; a dict value is a struct) or tuples (columns ``_1``, ``_2``, … as Spark
    names them). Values are numbers, booleans, ``bytes``, ``str``, dates and datetimes, None, lists (of any
    length, nested), numpy arrays and dicts. A column's type is inferred by pyarrow per record batch; a column
    that holds only None in one keeps the type it had before.

    Raises:
        TypeError: rows that are neither dicts nor tuples, or whose keys or widths differ.
        UnsupportedColumn: values sparkbus cannot carry, or a column of only None before any typed value.
    """
    known: dict[str, pa.DataType] = {}
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield rows_to_record_batch(chunk, known)
            chunk = []
    if chunk:
        yield rows_to_record_batch(chunk, known)


def rows_to_record_batch(rows: list[Any], known: dict[str, pa.DataType] | None = None) -> pa.RecordBatch:
    """One record batch of Python rows (see :func:`record_batches_from_rows`)."""
    known = {} if known is None else known
    first = rows[0]
    if isinstance(first, Mapping):
        names = list(first.keys())
        try:
            values = [[row[name] for row in rows] for name in names]
        except (KeyError, TypeError) as exc:
            raise TypeError(f"RDD rows must all be dicts with the keys {names}: {exc!r}") from None
    elif isinstance(first, (tuple, list)):
        width = len(first)
        if any(not isinstance(row, (tuple, list)) or len(row) != width for row in rows):
            raise TypeError(f"RDD rows must all be tuples of {width} values")
        names = [f"_{i + 1}" for i in range(width)]
        values = [[row[i] for row in rows] for i in range(width)]
    else:
        raise TypeError(f"RDD rows must be dicts or tuples, got {type(first).__name__}")
    arrays = [_python_column(name, column, known) for name, column in zip(names, values)]
    return pa.RecordBatch.from_arrays(arrays, names=names)


def _python_column(name: str, values: list[Any], known: dict[str, pa.DataType]) -> pa.Array:
    sample = next((v for v in values if v is not None), None)
    if isinstance(sample, np.ndarray) and sample.ndim > 1 and all(
            isinstance(v, np.ndarray) and v.shape == sample.shape for v in values):
        array = _fixed_shape(np.stack(values))          # rows of one multi-dimensional shape, as numpy gives
    else:
        try:
            array = pa.array([v.tolist() if isinstance(v, np.ndarray) and v.ndim > 1 else v for v in values])
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise UnsupportedColumn(f"column {name!r}: its values cannot be carried as one Arrow type ({exc})") \
                from None
    if pa.types.is_null(array.type):
        if name not in known:
            raise UnsupportedColumn(f"column {name!r} holds only None in its first {len(values)} rows, so its type "
                                    f"is unknown: feed a DataFrame with a schema, or give the column a value")
        return pa.nulls(len(values), known[name])
    known.setdefault(name, array.type)
    return array


def _fixed_shape(stacked: np.ndarray) -> pa.Array:
    array: pa.Array = pa.array(np.ascontiguousarray(stacked).reshape(-1))
    for width in reversed(stacked.shape[1:]):
        array = pa.FixedSizeListArray.from_arrays(array, width)
    return array


# ---- numpy batches (stream_partition's own callers: tests, benchmarks) ------------------------------------

def pack_small(batches: Iterable[Columns], pack_bytes: int,
               max_batches: int = MAX_PACK_BATCHES) -> Iterator[tuple[Columns, list[int] | None]]:
    """Consecutive numpy batches smaller than ``pack_bytes / 2`` as packs of up to ``pack_bytes`` and
    ``max_batches`` (their columns concatenated: one copy), as :func:`messages` packs Arrow batches.

    Yields ``(columns, splits)``: a batch as it was with ``splits=None``, or a pack with the rows of each batch in
    ``splits``. ``pack_bytes=0`` packs nothing.
    """
    group: list[Columns] = []
    group_bytes = 0
    for batch in batches:
        nbytes = sum(a.nbytes for a in batch.values())
        alone = 2 * nbytes >= pack_bytes
        if group and (alone or group_bytes + nbytes > pack_bytes or len(group) == max_batches
                      or not _same_kind(group[0], batch)):
            yield _merge(group)
            group, group_bytes = [], 0
        if alone:
            yield batch, None
        else:
            group.append(batch)
            group_bytes += nbytes
    if group:
        yield _merge(group)


def _same_kind(a: Columns, b: Columns) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape[1:] == b[k].shape[1:] for k in a)


def _merge(group: list[Columns]) -> tuple[Columns, list[int] | None]:
    if len(group) == 1:
        return group[0], None
    splits = [len(next(iter(b.values()))) for b in group]
    return {name: np.concatenate([b[name] for b in group]) for name in group[0]}, splits
