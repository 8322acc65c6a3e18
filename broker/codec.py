"""Batches as frames: numpy columns to the wire and back, with the XXH3-64 checksum that travels with them.

Feeders encode, ranks decode; the broker never calls this module (it forwards the frames as they came).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from .errors import ProtocolError
from .protocol import WIRE_DTYPES, Kind, batch_id, check_batch_frames, pack_header


def column_spec(name: str, array: np.ndarray) -> list:
    """The header entry ``[name, dtype, shape]`` for one column (shape includes the row dimension)."""
    return [name, array.dtype.str, list(array.shape)]


def batch_checksum(buffers: Iterable[Any]) -> int:
    """XXH3-64 over the column buffers in order: a batch's identity for duplicate detection, and its integrity."""
    digest = xxhash.xxh3_64()
    for buf in buffers:
        digest.update(buf)
    return digest.intdigest()


def wire_array(name: str, array: np.ndarray) -> np.ndarray:
    """``array`` as it goes on the wire: little-endian, C-contiguous, at least 1-D (copies only if needed).

    Raises:
        ValueError: a scalar, or a dtype that is not in :data:`broker.protocol.WIRE_DTYPES`.
    """
    array = np.asarray(array)
    if array.ndim == 0:
        raise ValueError(f"column {name!r} is a scalar, not a column")
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype.str not in WIRE_DTYPES:
        raise ValueError(f"column {name!r} has dtype {array.dtype}, which sparkbus cannot send "
                         f"(numbers and booleans only)")
    return np.ascontiguousarray(array, dtype=dtype)


def encode_batch(stream: str, epoch: int, part: int, seq: int,
                 columns: Mapping[str, np.ndarray], attempt: int = 0, splits: list[int] | None = None) -> list[Any]:
    """Frames of one data batch: the header, then one C-contiguous buffer per column.

    Args:
        columns: equal-length numpy arrays with dtypes in :data:`~broker.protocol.WIRE_DTYPES` (converted if not).
        attempt: the Spark task attempt that produced the batch (retries and speculative copies differ).
        splits: for a pack of small batches, the rows of each, in order (they add up to the columns' length).
    Returns:
        ``[header_bytes, buffer, ...]`` ready for ``send_multipart(..., copy=False)``.
    Raises:
        ValueError: a column of an unsupported dtype or of another length.
    """
    rows = None
    specs, buffers = [], []
    for name, array in columns.items():
        array = wire_array(name, array)
        if rows is None:
            rows = len(array)
        elif len(array) != rows:
            raise ValueError(f"column {name!r} has {len(array)} rows, expected {rows}")
        specs.append(column_spec(name, array))
        buffers.append(array.reshape(-1).view(np.uint8) if array.size else b"")
    fields = dict(stream=stream, epoch=epoch, part=part, seq=seq, attempt=attempt, rows=rows or 0, cols=specs,
                  checksum=batch_checksum(buffers))
    if splits is not None:
        fields["splits"] = list(splits)
    return [pack_header(Kind.BATCH, **fields), *buffers]


def decode_batch(header: Mapping[str, Any], frames: Sequence[Any], verify: bool = True) -> dict[str, np.ndarray]:
    """Numpy views of a batch's column frames (no copy; the arrays are read-only).

    Args:
        header: a validated BATCH header.
        frames: the column frames (``zmq.Frame`` or buffers), in header order.
        verify: also check the XXH3-64 checksum against the header.
    Raises:
        ProtocolError: the frames do not match the header, or the checksum differs.
    """
    buffers = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    check_batch_frames(header, [memoryview(b).nbytes for b in buffers])
    if verify and batch_checksum(buffers) != header["checksum"]:
        raise ProtocolError(f"checksum mismatch in batch {batch_id(header)} of stream {header['stream']!r}")
    return {name: np.frombuffer(buf, dtype=dtype).reshape(shape)
            for (name, dtype, shape), buf in zip(header["cols"], buffers)}
