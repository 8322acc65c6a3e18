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
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from broker.ragged import WireColumn, bitmap_slice, unpack_bits

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


def wire_column(name: str, array: pa.Array, ragged: bool = False) -> WireColumn:
    """One Arrow column (not a struct) in wire form, over the array's own buffers where it can be.

    Args:
        ragged: always carry offsets (the rank's RaggedColumn form), even where the arrays share one length.
    Raises:
        UnsupportedColumn: a type sparkbus cannot carry.
    """
    chain, node, dense = _structure(array, ragged)
    byte_strings = _is_byte_string(node.type)
    dtype = "str" if pa.types.is_string(node.type) or pa.types.is_large_string(node.type) else \
        "bin" if byte_strings else _leaf_dtype(node.type)
    if dtype is None:
        check_type(name, array.type)
        raise UnsupportedColumn(f"column {name!r}: {array.type} cannot be carried")
    levels: list[list] = []
    buffers: list[Any] = []
    for level, bounds, size in chain[:len(chain) - len(dense)]:
        _add_validity(buffers, level)
        if bounds is None:
            bounds = np.arange(len(level) + 1, dtype=np.int32) * size
        buffers.append(bounds - bounds[0] if bounds[0] else bounds)
        levels.append([len(level), bounds.dtype.itemsize, level.null_count > 0])
    if byte_strings:
        _add_validity(buffers, node)
        bounds = _string_offsets(node)
        buffers.append(bounds - bounds[0] if bounds[0] else bounds)
        levels.append([len(node), bounds.dtype.itemsize, node.null_count > 0])
        data = node.buffers()[2]
        length = int(bounds[-1] - bounds[0])
        buffers.append(data.slice(int(bounds[0]), length) if data is not None else b"")
        return WireColumn(dtype, [length], levels, False, buffers)
    count = len(node)
    leaf_nulls = node.null_count > 0
    if leaf_nulls:
        _add_validity(buffers, node)
    buffers.append(_values(node))
    inner = int(np.prod(dense, dtype=np.int64)) if dense else 1
    return WireColumn(dtype, [count // inner if inner else len(chain[-len(dense)][0]), *dense], levels,
                      leaf_nulls, buffers)


def wire_form(array: pa.Array, ragged: bool = False) -> tuple[int, ...]:
    """What decides a column's form on the rank: its levels of offsets and its dense inner shape."""
    chain, _, dense = _structure(array, ragged)
    return (len(chain) - len(dense), *dense)


def _structure(array: pa.Array, ragged: bool) -> tuple[list, pa.Array, list[int]]:
    """The list levels of a column, outermost first, as ``(array, bounds or None, list_size)``; its leaf (sliced
    to the values the column uses); and its dense suffix: the sizes of the innermost list levels whose arrays all
    share one length and hold no null array (none when ``ragged``)."""
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    chain = []
    node = array
    while _is_list(node.type):
        if pa.types.is_fixed_size_list(node.type):
            size = node.type.list_size
            chain.append((node, None, size))
            node = node.values.slice(node.offset * size, len(node) * size)
        else:
            bounds = node.offsets.to_numpy()
            chain.append((node, bounds, 0))
            node = node.values.slice(int(bounds[0]), int(bounds[-1] - bounds[0]))
    dense: list[int] = []
    if not _is_byte_string(node.type) and not ragged:
        for level, bounds, size in reversed(chain):
            width = size if bounds is None else _uniform(bounds)
            if width is None or level.null_count:
                break
            dense.insert(0, width)
    return chain, node, dense


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
    """The one length of every array between ``bounds``, or None when they differ (or there are none)."""
    if len(bounds) < 2:
        return None
    lengths = np.diff(bounds)
    first = int(lengths[0])
    return first if (lengths == first).all() else None


def _add_validity(buffers: list[Any], array: pa.Array) -> None:
    if not array.null_count:
        return
    bitmap = array.buffers()[0]
    if array.offset % 8 == 0:
        buffers.append(bitmap.slice(array.offset // 8, (len(array) + 7) // 8))
    else:
        buffers.append(bitmap_slice(np.frombuffer(bitmap, dtype=np.uint8), array.offset, len(array)))


def _values(array: pa.Array) -> Any:
    """The values buffer of a fixed-width array, as the wire lays it out (a slice of Arrow's where it can be)."""
    kind = array.type
    data = array.buffers()[1]
    if data is None or not len(array):
        return b""
    if pa.types.is_boolean(kind):
        return unpack_bits(np.frombuffer(data, dtype=np.uint8), array.offset, len(array)).view(np.uint8)
    width = kind.bit_width // 8
    values = data.slice(array.offset * width, len(array) * width)
    if pa.types.is_date32(kind):
        return np.frombuffer(values, dtype="<i4").astype("<i8").view(np.uint8)
    return values


def byte_lengths(array: pa.Array) -> np.ndarray | int:
    """Payload bytes of each row of a column (an int when every row has the same), without per-row Python."""
    if pa.types.is_struct(array.type):
        return sum((byte_lengths(child) for child in array.flatten()), 0)
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if not _is_list(array.type) and not _is_byte_string(array.type):
        return _item_bytes(array.type)
    bounds = np.arange(len(array) + 1)     # each row's first and last entry, in the current level's positions
    node = array
    while _is_list(node.type):
        if pa.types.is_fixed_size_list(node.type):
            bounds = (bounds + node.offset) * node.type.list_size
        else:
            bounds = node.offsets.to_numpy()[bounds]
        node = node.values                   # the whole child: the offsets above index it
    if _is_byte_string(node.type):
        return np.diff(_string_offsets(node)[bounds]).astype(np.int64)
    return np.diff(bounds).astype(np.int64) * _item_bytes(node.type)


def _string_offsets(array: pa.Array) -> np.ndarray:
    """A binary or string array's offsets (``len + 1``, this slice's), a view of its buffer."""
    large = pa.types.is_large_binary(array.type) or pa.types.is_large_string(array.type)
    offsets = np.frombuffer(array.buffers()[1], dtype="<i8" if large else "<i4")
    return offsets[array.offset:array.offset + len(array) + 1]


def _item_bytes(kind: pa.DataType) -> int:
    if pa.types.is_boolean(kind):
        return 1
    if pa.types.is_date32(kind):
        return 8
    return max(1, kind.bit_width // 8)
