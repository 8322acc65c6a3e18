"""Batches as frames: columns to the wire and back, with the XXH3-64 checksum that travels with them.

Feeders encode, ranks decode; the broker never calls this module (it forwards the frames as they came).

A column travels as Arrow lays it out (``docs/PROTOCOL.md``, "Column layouts"): a dense column of numbers is one
frame of ``[n, ...]`` values, as before; a column with nulls adds its validity bitmap; a variable-length column
(binary, string, arrays of varying length) adds one level of offsets per level of nesting. On the rank the
layout decides the form: numpy for dense columns, a numpy masked array for dense columns with nulls, and a
:class:`~broker.ragged.RaggedColumn` for the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import BYTE_STRINGS, WIRE_DTYPES, Kind, batch_id, check_batch_frames, pack_header
from sparkbus.wire.ragged import RaggedColumn, WireColumn, pack_bits

Column = Any      # numpy array, numpy masked array, RaggedColumn or WireColumn


def batch_checksum(buffers: Iterable[Any]) -> int:
    """XXH3-64 over the column buffers in order: a batch's identity for duplicate detection, and its integrity."""
    digest = xxhash.xxh3_64()
    for buf in buffers:
        digest.update(buf)
    return digest.intdigest()


def wire_array(name: str, array: np.ndarray) -> np.ndarray:
    """``array`` as it goes on the wire: little-endian, C-contiguous, at least 1-D (copies only if needed).

    Raises:
        ValueError: a scalar, or a dtype that is not in :data:`sparkbus.wire.protocol.WIRE_DTYPES`.
    """
    array = np.asarray(array)
    if array.ndim == 0:
        raise ValueError(f"column {name!r} is a scalar, not a column")
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in WIRE_DTYPES:
        raise ValueError(f"column {name!r} has dtype {array.dtype}, which sparkbus cannot send "
                         f"(numbers, booleans, datetime64 and timedelta64)")
    return np.ascontiguousarray(array, dtype=dtype)


def wire_column(name: str, column: Column) -> WireColumn:
    """Any form of a column as a :class:`~broker.ragged.WireColumn` (numpy arrays without a copy when contiguous)."""
    if isinstance(column, WireColumn):
        return column
    if isinstance(column, RaggedColumn):
        return column.wire()
    if isinstance(column, np.ma.MaskedArray):
        values = wire_array(name, np.ma.getdata(column))
        mask = np.ma.getmaskarray(column)
        if not mask.any():
            return WireColumn(values.dtype.str, list(values.shape), [], False, [_bytes_of(values)])
        return WireColumn(values.dtype.str, list(values.shape), [], True,
                          [pack_bits(~mask.reshape(-1)), _bytes_of(values)])
    values = wire_array(name, column)
    return WireColumn(values.dtype.str, list(values.shape), [], False, [_bytes_of(values)])


def _bytes_of(array: np.ndarray) -> Any:
    return array.reshape(-1).view(np.uint8) if array.size else b""


def encode_batch(stream: str, epoch: int, part: int, seq: int, columns: Mapping[str, Column], attempt: int = 0,
                 splits: list[int] | None = None, bucket: int | None = None) -> list[Any]:
    """Frames of one data batch: the header, then each column's buffers.

    Args:
        columns: equal-length columns: numpy arrays (dtypes of :data:`~broker.protocol.WIRE_DTYPES`, converted if
            not), numpy masked arrays, :class:`~broker.ragged.RaggedColumn`, or ready
            :class:`~broker.ragged.WireColumn` (what the feeder makes from Arrow buffers).
        attempt: the Spark task attempt that produced the batch (retries and speculative copies differ).
        splits: for a pack of small batches, the rows of each, in order (they add up to the columns' length).
        bucket: the length bucket of a coordinated feed's batch (``feed(bucket_bounds=)``); by default the
            ``bucket`` attribute of ``columns`` when it has one (:class:`BucketColumns`, what the feeder cuts).
    Returns:
        ``[header_bytes, buffer, ...]`` ready for ``send_multipart(..., copy=False)``.
    Raises:
        ValueError: a column of an unsupported dtype or of another length.
    """
    rows = None
    specs: list[list] = []
    buffers: list[Any] = []
    for name, column in columns.items():
        wire = wire_column(name, column)
        length = wire.rows
        if rows is None:
            rows = length
        elif length != rows:
            raise ValueError(f"column {name!r} has {length} rows, expected {rows}")
        specs.append(wire.spec(name))
        buffers.extend(b if _size(b) else b"" for b in wire.buffers)
    fields = dict(stream=stream, epoch=epoch, part=part, seq=seq, attempt=attempt, rows=rows or 0, cols=specs,
                  checksum=batch_checksum(buffers))
    if splits is not None:
        fields["splits"] = list(splits)
    if bucket is None:
        bucket = getattr(columns, "bucket", None)
    if bucket is not None:
        fields["bucket"] = bucket
    return [pack_header(Kind.BATCH, **fields), *buffers]


class BucketColumns(dict):
    """A batch's columns (name to column) and the length bucket its rows belong to (``feed(bucket_bounds=)``):
    what the feeder hands the task for a coordinated feed, so that :func:`encode_batch` puts ``bucket`` in the
    header while a message stays ``(columns, splits)``."""

    def __init__(self, columns: Mapping[str, Any], bucket: int):
        super().__init__(columns)
        self.bucket = bucket


def _size(buf: Any) -> int:
    return buf.nbytes if isinstance(buf, np.ndarray) else memoryview(buf).nbytes


def decode_batch(header: Mapping[str, Any], frames: Sequence[Any], verify: bool = True) -> dict[str, Column]:
    """The columns of a batch over its frames (no copy of any values buffer; everything is read-only).

    A dense column without nulls is a numpy array, as it was sent; with nulls, a numpy masked array; a
    variable-length column a :class:`~broker.ragged.RaggedColumn`.

    Args:
        header: a validated BATCH header.
        frames: the column frames (``zmq.Frame`` or buffers), in header order.
        verify: also check the XXH3-64 checksum against the header.
    Raises:
        ProtocolError: the frames do not match the header, the checksum differs, or offsets are out of order.
    """
    buffers = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    check_batch_frames(header, [memoryview(b).nbytes for b in buffers])
    if verify and batch_checksum(buffers) != header["checksum"]:
        raise ProtocolError(f"checksum mismatch in batch {batch_id(header)} of stream {header['stream']!r}")
    columns = {}
    at = 0
    for spec in header["cols"]:
        columns[spec[0]], at = _decode_column(spec, buffers, at)
    return columns


def _decode_column(spec: list, buffers: list[Any], at: int) -> tuple[Column, int]:
    name, dtype, shape = spec[:3]
    levels, leaf_nulls = (spec[3], spec[4]) if len(spec) == 5 else ([], False)
    nodes = []
    for i, (count, width, nulls) in enumerate(levels):
        valid = None
        if nulls:
            valid, at = np.frombuffer(buffers[at], dtype=np.uint8), at + 1
        offsets, at = np.frombuffer(buffers[at], dtype="<i4" if width == 4 else "<i8"), at + 1
        end = levels[i + 1][0] if i + 1 < len(levels) else shape[0]
        if count and (offsets[0] != 0 or offsets[-1] != end or (np.diff(offsets) < 0).any()):
            raise ProtocolError(f"column {name!r}: offsets of level {i} do not rise from 0 to {end}")
        nodes.append((offsets, valid))
    leaf_valid = None
    if leaf_nulls:
        leaf_valid, at = np.frombuffer(buffers[at], dtype=np.uint8), at + 1
    values = np.frombuffer(buffers[at], dtype=np.uint8 if dtype in BYTE_STRINGS else dtype).reshape(shape)
    at += 1
    if not nodes:
        if leaf_valid is None:
            return values, at
        mask = ~np.unpackbits(leaf_valid, count=values.size, bitorder="little").view(bool)
        return np.ma.MaskedArray(values, mask=mask.reshape(values.shape)), at
    column: RaggedColumn | np.ndarray = values
    for depth, (offsets, valid) in reversed(list(enumerate(nodes))):
        column = RaggedColumn(dtype, offsets, valid, column, leaf_valid if depth == len(nodes) - 1 else None)
    return column, at

