"""Arrow columns to wire columns: the buffers of Spark's record batches, straight to frames.

A column becomes a :class:`~broker.ragged.WireColumn` whose buffers are slices of the Arrow array's own buffers
(validity bitmaps, offsets, values), without per-row Python and, in the common case, without a copy. A copy is
made once where the wire needs another layout than the array has:

* offsets of a slice that does not start at the first value (the wire's offsets start at 0): ``n + 1`` integers;
* a validity bitmap that starts at a bit offset inside a byte: ``n / 8`` bytes;
* booleans (Arrow's are bits, numpy's bytes) and dates (Arrow's ``date32`` is 4 bytes, numpy's ``datetime64[D]`` 8).

Which form a list column takes is decided here, per batch: arrays that share one length (and have no null
array) are *dense* (a numpy ``[n, k]`` on the rank, one values frame, as before), unless the column is declared
``ragged``; other lists, binary and strings carry their offsets (a :class:`~broker.ragged.RaggedColumn`).
Structs are flattened to ``parent.child`` columns before this (:func:`flatten_structs`).

A :class:`ColumnPlan` reads a column's buffers once per record batch (numpy views, its form over the whole
batch), so that cutting a batch out of it costs numpy slicing only: per batch, no pyarrow call is made.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from sparkbus.wire.ragged import WireColumn, bitmap_slice, unpack_bits

_TIME_UNITS = ("s", "ms", "us", "ns")


class UnsupportedColumn(TypeError):
    """A column of a type sparkbus cannot carry exactly; the message names it and what to do."""


def flatten_structs(name: str, array: pa.Array) -> Iterator[tuple[str, pa.Array]]:
    """``(name, array)``, or for a struct each field as ``parent.child`` (recursively), null where the struct is."""
    if pa.types.is_struct(array.type):
        for field, child in zip(array.type, array.flatten()):      # flatten() merges the struct's nulls
            yield from flatten_structs(f"{name}.{field.name}", child)
    else:
        yield name, array


def check_type(name: str, kind: pa.DataType, inside: str = "") -> None:
    """Raise :class:`UnsupportedColumn` for a type sparkbus cannot carry (named, with what to do about it)."""
    if pa.types.is_dictionary(kind):
        return check_type(name, kind.value_type, inside)
    if _is_list(kind):
        return check_type(name, kind.value_type, "an array of ")
    if pa.types.is_struct(kind):
        if inside:
            raise UnsupportedColumn(
                f"column {name!r} holds arrays of structs ({kind}), which sparkbus cannot carry: select each field "
                f"as an array of its own (e.g. transform({name}, x -> x.field)) or use to_json")
        for field in kind:
            check_type(f"{name}.{field.name}", field.type)
        return
    if _leaf_dtype(kind) is not None or _is_byte_string(kind):
        return
    if pa.types.is_decimal(kind):
        raise UnsupportedColumn(
            f"column {name!r} is {inside}{kind}, which sparkbus cannot carry exactly: cast it in Spark, e.g. "
            f"df.withColumn({name!r}, df[{name!r}].cast('double')) (SQL literals such as id * 1.5 make decimals)")
    if pa.types.is_map(kind):
        raise UnsupportedColumn(
            f"column {name!r} is {inside}a map ({kind}), which sparkbus cannot carry: send map_keys({name}) and "
            f"map_values({name}) as two array columns, or to_json({name}) as a string")
    if pa.types.is_null(kind):
        raise UnsupportedColumn(f"column {name!r} has no type (only nulls, e.g. lit(None)): cast it to the type "
                                f"its values would have")
    raise UnsupportedColumn(f"column {name!r} is {inside}{kind}, which sparkbus cannot carry exactly (numbers, "
                            f"booleans, binary, strings, dates, timestamps, arrays and structs of those)")


class _Level(NamedTuple):
    """One list level of a column: its entries' offsets into the next level, and its validity."""

    offsets: np.ndarray | None     # int32/int64, one per entry + 1, into the next level's positions; None: fixed
    size: int                      # a fixed-size list's length (offsets None), else 0
    base: int                      # a fixed-size list's offset in its values (Arrow's ``values`` ignore slices)
    bitmap: np.ndarray | None      # validity bits (uint8), or None when the level has no null
    bit_offset: int                # the first entry's bit in ``bitmap``

    def child_range(self, lo: int, hi: int) -> tuple[int, int]:
        if self.offsets is None:
            return (self.base + lo) * self.size, (self.base + hi) * self.size
        return int(self.offsets[lo]), int(self.offsets[hi])


class ColumnPlan:
    """One Arrow column of a record batch, analysed once so that each batch cut from it is numpy slicing only.

    :meth:`wire` gives rows ``start .. start + n`` in wire form: views of the Arrow buffers (a copy only for
    rebased offsets and unaligned bitmaps), its :meth:`form` decides how the rank will see them.

    Args:
        ragged: carry offsets in every batch, even where a batch's arrays share one length.
    Raises:
        UnsupportedColumn: a type sparkbus cannot carry (structs must be flattened first).
    """

    def __init__(self, name: str, array: pa.Array, ragged: bool = False):
        check_type(name, array.type)
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        self.name, self.rows, self.ragged = name, len(array), ragged
        levels = []
        node = array
        while _is_list(node.type):
            bitmap, bit = _bitmap(node)
            if pa.types.is_fixed_size_list(node.type):
                levels.append(_Level(None, node.type.list_size, node.offset, bitmap, bit))
            else:
                levels.append(_Level(_offsets(node), 0, 0, bitmap, bit))
            node = node.values                 # the whole child: the offsets above index it
        self.levels = levels
        self.bytes_leaf = _is_byte_string(node.type)
        self.leaf_bitmap, self.leaf_bit = _bitmap(node)
        if self.bytes_leaf:
            self.dtype = "str" if pa.types.is_string(node.type) or pa.types.is_large_string(node.type) else "bin"
            self.leaf_offsets = _offsets(node)
            data = node.buffers()[2]
            self.values = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        else:
            dtype = _leaf_dtype(node.type)
            if dtype is None:                     # check_type above let through only what has one
                raise UnsupportedColumn(f"column {name!r}: {node.type} cannot be carried")
            self.dtype = dtype
            self.values = _leaf_values(node)
        # The form over the whole column; batches cut from it share it when every level is dense (or none can be).
        self._whole = self._dense(0, self.rows)
        self.stable = ragged or self.bytes_leaf or len(self._whole) == len(levels)

    # ---- the form of a batch ------------------------------------------------------------------------------

    def _ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The range of positions rows ``start .. stop`` span at each level, the leaf's last."""
        ranges = [(start, stop)]
        for level in self.levels:
            ranges.append(level.child_range(*ranges[-1]))
        return ranges

    def _dense(self, start: int, stop: int, ranges: list | None = None) -> list[int]:
        """The sizes of the innermost levels whose arrays share one length in these rows and hold no null."""
        if self.ragged or self.bytes_leaf:
            return []
        ranges = ranges or self._ranges(start, stop)
        dense: list[int] = []
        for depth in range(len(self.levels) - 1, -1, -1):
            level, (lo, hi) = self.levels[depth], ranges[depth]
            width = level.size if level.offsets is None else _uniform(level.offsets[lo:hi + 1])
            if width is None or _has_null(level.bitmap, level.bit_offset + lo, hi - lo):
                break
            dense.insert(0, width)
        return dense

    def form(self, start: int, n: int) -> tuple[int, ...]:
        """What decides the rank's form for these rows: levels of offsets and the dense inner shape."""
        dense = self._whole if self.stable else self._dense(start, start + n)
        return (len(self.levels) - len(dense), *dense)

    # ---- wire form ----------------------------------------------------------------------------------------

    def wire(self, start: int = 0, n: int | None = None) -> WireColumn:
        """Rows ``start .. start + n`` in wire form."""
        n = self.rows - start if n is None else n
        ranges = self._ranges(start, start + n)
        dense = self._whole if self.stable else self._dense(start, start + n, ranges)
        ragged_levels = len(self.levels) - len(dense)
        levels: list[list] = []
        buffers: list[Any] = []
        for level, (lo, hi) in zip(self.levels[:ragged_levels], ranges):
            validity = _validity(level.bitmap, level.bit_offset + lo, hi - lo)
            nulls = validity is not None
            if nulls:
                buffers.append(validity)
            if level.offsets is None:
                bounds = np.arange(hi - lo + 1, dtype=np.int32) * level.size
            else:
                bounds = level.offsets[lo:hi + 1]
            buffers.append(bounds - bounds[0] if bounds[0] else bounds)
            levels.append([hi - lo, bounds.dtype.itemsize, nulls])
        lo, hi = ranges[-1]
        validity = _validity(self.leaf_bitmap, self.leaf_bit + lo, hi - lo)
        nulls = validity is not None
        if nulls:
            buffers.append(validity)
        if self.bytes_leaf:
            bounds = self.leaf_offsets[lo:hi + 1]
            buffers.append(bounds - bounds[0] if bounds[0] else bounds)
            levels.append([hi - lo, bounds.dtype.itemsize, nulls])
            data = self.values[int(bounds[0]):int(bounds[-1])]
            buffers.append(data)
            return WireColumn(self.dtype, [len(data)], levels, False, buffers)
        values = self.values[lo:hi]
        buffers.append(values.view(np.uint8) if len(values) else b"")
        first = ranges[ragged_levels]
        return WireColumn(self.dtype, [first[1] - first[0], *dense], levels, nulls, buffers)

    def row_bytes(self) -> np.ndarray | int:
        """Payload bytes of each row (an int when every row has the same size), without per-row Python."""
        itemsize = 1 if self.bytes_leaf else self.values.itemsize
        if not self.levels and not self.bytes_leaf:
            return itemsize
        if not self.bytes_leaf and len(self._whole) == len(self.levels):
            return int(np.prod(self._whole, dtype=np.int64)) * itemsize
        bounds = np.arange(self.rows + 1)
        for level in self.levels:
            bounds = (level.base + bounds) * level.size if level.offsets is None else level.offsets[bounds]
        if self.bytes_leaf:
            bounds = self.leaf_offsets[bounds]
        return np.diff(bounds).astype(np.int64) * itemsize


def wire_column(name: str, array: pa.Array, ragged: bool = False) -> WireColumn:
    """One Arrow column (not a struct) in wire form, over the array's own buffers where it can be.

    Args:
        ragged: always carry offsets (the rank's RaggedColumn form), even where the arrays share one length.
    Raises:
        UnsupportedColumn: a type sparkbus cannot carry.
    """
    return ColumnPlan(name, array, ragged).wire()


def _offsets(array: pa.Array) -> np.ndarray:
    """A list, binary or string array's offsets (``len + 1``, this slice's), a view of its buffer."""
    kind = array.type
    large = pa.types.is_large_list(kind) or pa.types.is_large_binary(kind) or pa.types.is_large_string(kind)
    offsets = np.frombuffer(array.buffers()[1], dtype="<i8" if large else "<i4")
    return offsets[array.offset:array.offset + len(array) + 1]


def _bitmap(array: pa.Array) -> tuple[np.ndarray | None, int]:
    if not array.null_count:
        return None, 0
    return np.frombuffer(array.buffers()[0], dtype=np.uint8), array.offset


def _has_null(bitmap: np.ndarray | None, start: int, count: int) -> bool:
    if bitmap is None or count == 0:
        return False
    return not unpack_bits(bitmap, start, count).all()


def _validity(bitmap: np.ndarray | None, start: int, count: int) -> np.ndarray | None:
    """The bitmap of entries ``start .. start + count`` (from bit 0), or None when none of them is null."""
    if not _has_null(bitmap, start, count):
        return None
    assert bitmap is not None
    return bitmap_slice(bitmap, start, count)


def _leaf_values(array: pa.Array) -> np.ndarray:
    """A fixed-width array's values as numpy (from its first value): a view, except for booleans (Arrow's are
    bits) and dates (``date32`` has 4 bytes, ``datetime64[D]`` 8), converted once per record batch."""
    kind = array.type
    dtype = np.dtype(_leaf_dtype(kind))
    data = array.buffers()[1]
    if data is None or not len(array):
        return np.zeros(0, dtype=dtype)
    if pa.types.is_boolean(kind):
        return unpack_bits(np.frombuffer(data, dtype=np.uint8), array.offset, len(array))
    if pa.types.is_date32(kind):
        days = np.frombuffer(data, dtype="<i4")[array.offset:array.offset + len(array)]
        return days.astype("<i8").view(dtype)
    return np.frombuffer(data, dtype=dtype)[array.offset:array.offset + len(array)]


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def _is_byte_string(kind: pa.DataType) -> bool:
    return (pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_string(kind)
            or pa.types.is_large_string(kind))


def _leaf_dtype(kind: pa.DataType) -> str | None:
    """The wire dtype of a fixed-width Arrow type, or None."""
    if pa.types.is_boolean(kind):
        return "|b1"
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return np.dtype(kind.to_pandas_dtype()).newbyteorder("<").str
    if pa.types.is_date32(kind):
        return "<M8[D]"
    if pa.types.is_date64(kind):
        return "<M8[ms]"
    if pa.types.is_timestamp(kind) and kind.unit in _TIME_UNITS:   # stored as UTC; the time zone is a label
        return f"<M8[{kind.unit}]"
    if pa.types.is_duration(kind) and kind.unit in _TIME_UNITS:
        return f"<m8[{kind.unit}]"
    return None


def _uniform(bounds: np.ndarray) -> int | None:
    """The one length of every array between ``bounds``, or None when they differ, are all empty (no shape to
    speak of: the column stays ragged) or there are none."""
    if len(bounds) < 2:
        return None
    lengths = np.diff(bounds)
    first = int(lengths[0])
    return first if first and (lengths == first).all() else None


