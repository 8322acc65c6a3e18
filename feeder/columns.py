"""Rows to columns: Arrow record batches (DataFrames) and Python rows (RDDs) into wire-ready numpy batches.

Arrow columns become numpy arrays without per-row Python and, for primitive columns without nulls, without a
copy. Lists of equal length become ``[n, k]`` arrays (nested lists ``[n, k, m]``).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa

Columns = dict[str, np.ndarray]


def arrow_column(name: str, array: pa.Array) -> np.ndarray:
    """One Arrow column as numpy: ``[n]`` for numbers and booleans, ``[n, k, ...]`` for equal-length lists.

    Raises:
        ValueError: nulls, or lists of unequal length.
        TypeError: a type with no numpy equivalent sparkbus sends (strings, structs, maps, decimals, dates).
    """
    if array.null_count:
        raise ValueError(f"column {name!r} has {array.null_count} null values; fill or drop them in Spark first")
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        n = len(array)
        values = array.flatten()            # respects slicing, unlike .values
        if pa.types.is_fixed_size_list(kind):
            width = kind.list_size
        else:
            lengths = np.diff(array.offsets.to_numpy())
            width = int(lengths[0]) if n else 0
            if n and (lengths != width).any():
                raise ValueError(f"column {name!r} holds arrays of unequal lengths "
                                 f"({int(lengths.min())}..{int(lengths.max())}); sparkbus needs fixed-length arrays")
        inner = arrow_column(name, values)
        return inner.reshape(n, width, *inner.shape[1:])
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return array.to_numpy(zero_copy_only=False)
    raise TypeError(f"column {name!r} has type {kind}, which sparkbus cannot feed "
                    f"(numbers, booleans, fixed-length numeric arrays and ML vectors only)")


def arrow_columns(batch: pa.RecordBatch, names: Iterable[str] | None = None) -> Columns:
    """Every column of a record batch (or those named) as numpy arrays."""
    names = batch.schema.names if names is None else list(names)
    return {name: arrow_column(name, batch.column(name)) for name in names}


def batch_rows(columns: Mapping[str, np.ndarray], batch_size: int, max_bytes: int) -> int:
    """Rows per batch: ``batch_size``, fewer if a batch of that many rows would exceed ``max_bytes``."""
    row_bytes = sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in columns.values())
    return max(1, min(batch_size, max_bytes // max(row_bytes, 1)))


def rebatch(pieces: Iterable[Columns], batch_size: int, max_bytes: int) -> Iterator[Columns]:
    """Cut a stream of column chunks into batches of exactly ``batch_size`` rows (capped in bytes).

    Chunks are sliced, not copied; only a batch that spans two chunks is concatenated. The last batch of the
    stream may be shorter.
    """
    pending: list[Columns] = []
    pending_rows = 0
    for chunk in pieces:
        n = len(next(iter(chunk.values()))) if chunk else 0
        if n == 0:
            continue
        cap = batch_rows(chunk, batch_size, max_bytes)
        start = 0
        while start < n:
            take = min(cap - pending_rows, n - start) if pending_rows < cap else 0
            if take:
                pending.append({k: v[start:start + take] for k, v in chunk.items()})
                pending_rows += take
                start += take
            if pending_rows >= cap:
                yield _merge(pending)
                pending, pending_rows = [], 0
    if pending:
        yield _merge(pending)


def pack_small(batches: Iterable[Columns], pack_bytes: int,
               max_batches: int = 64) -> Iterator[tuple[Columns, list[int] | None]]:
    """Consecutive batches smaller than ``pack_bytes / 2`` as packs of up to ``pack_bytes`` and ``max_batches``.

    Yields ``(columns, splits)``: a batch as it was with ``splits=None``, or a pack (its batches' columns
    concatenated) with the rows of each batch in ``splits``. Per message, the broker and a rank pay tens of
    microseconds of Python whatever its size; packing makes that cost per pack instead of per small batch, at the
    price of one copy of the small batches. ``pack_bytes=0`` packs nothing.

    Packs depend on the batches alone, never on timing, so that a retried task sends the very same packs (the
    broker recognises duplicates by pack); ``max_batches`` bounds how long a pack waits for a slow producer.
    """
    group: list[Columns] = []
    group_bytes = 0
    for batch in batches:
        nbytes = sum(a.nbytes for a in batch.values())
        alone = 2 * nbytes >= pack_bytes
        if group and (alone or group_bytes + nbytes > pack_bytes or len(group) == max_batches
                      or not _same_kind(group[0], batch)):
            yield _pack(group)
            group, group_bytes = [], 0
        if alone:
            yield batch, None
        else:
            group.append(batch)
            group_bytes += nbytes
    if group:
        yield _pack(group)


def _same_kind(a: Columns, b: Columns) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape[1:] == b[k].shape[1:] for k in a)


def _pack(group: list[Columns]) -> tuple[Columns, list[int] | None]:
    if len(group) == 1:
        return group[0], None
    splits = [len(next(iter(b.values()))) for b in group]
    return _merge(group), splits


def _merge(pieces: list[Columns]) -> Columns:
    if len(pieces) == 1:
        return pieces[0]
    return {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}


def rows_to_columns(rows: list[Any]) -> Columns:
    """Python rows of an RDD (dicts, or tuples whose columns are named ``_1``, ``_2``, … as Spark does).

    Values are numbers or numpy arrays of one shape per column.

    Raises:
        TypeError: rows that are neither dicts nor tuples, or that do not all have the same keys.
    """
    first = rows[0]
    if isinstance(first, Mapping):
        names = list(first.keys())
        try:
            return {name: np.asarray([row[name] for row in rows]) for name in names}
        except (KeyError, TypeError) as exc:
            raise TypeError(f"RDD rows must all be dicts with the keys {names}: {exc!r}") from None
    if isinstance(first, (tuple, list)):
        width = len(first)
        if any(len(row) != width for row in rows):
            raise TypeError(f"RDD rows must all be tuples of {width} values")
        return {f"_{i + 1}": np.asarray([row[i] for row in rows]) for i in range(width)}
    raise TypeError(f"RDD rows must be dicts or tuples, got {type(first).__name__}")


def chunk_rows(rows: Iterable[Any], size: int) -> Iterator[Columns]:
    """Group an iterator of Python rows into column chunks of ``size`` rows."""
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) == size:
            yield rows_to_columns(chunk)
            chunk = []
    if chunk:
        yield rows_to_columns(chunk)
