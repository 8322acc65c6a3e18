"""``RaggedColumn``: a rank's read-only, zero-copy view of a variable-length column (binary, string, arrays).

A ragged column is what Arrow calls a list, binary or string array, over the frames of a received batch: one
level of offsets (and an optional validity bitmap) per level of nesting, then the leaf values. Its verbs mean
what pyarrow's do (``to_pylist``, ``to_arrow``, ``offsets``, ``values``), with one difference that spares its
users a known pitfall: ``offsets`` always start at 0 and ``values`` hold only this column's (or this slice's)
values, so ``values[offsets[i]:offsets[i + 1]]`` is row ``i``, also for a slice.

Nothing here copies a values buffer except :meth:`RaggedColumn.pad`, which makes the padded array, and
:meth:`RaggedColumn.to_pylist`, which makes Python objects.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import numpy as np

BYTE_STRINGS = ("bin", "str")


class WireColumn(NamedTuple):
    """A column as it goes on the wire: its spec beyond the name, and its buffers in frame order.

    ``levels`` is a list of ``[count, offset_width, has_validity]`` (outermost first), ``nulls`` says whether the
    leaf has a validity bitmap; see :func:`sparkbus.wire.protocol.column_frame_sizes`.
    """

    dtype: str
    shape: list[int]
    levels: list[list]
    nulls: bool
    buffers: list[Any]

    @property
    def rows(self) -> int:
        return self.levels[0][0] if self.levels else self.shape[0]

    def spec(self, name: str) -> list:
        """The header entry of this column."""
        if not self.levels and not self.nulls:
            return [name, self.dtype, self.shape]
        return [name, self.dtype, self.shape, self.levels, self.nulls]


def unpack_bits(bitmap: np.ndarray, start: int, count: int) -> np.ndarray:
    """Bits ``start .. start + count`` of an Arrow validity bitmap (LSB first) as a numpy bool array (a copy)."""
    if count == 0:
        return np.zeros(0, dtype=bool)
    first, last = start // 8, (start + count + 7) // 8
    bits = np.unpackbits(bitmap[first:last], bitorder="little")
    return bits[start % 8:start % 8 + count].view(bool)


def pack_bits(valid: np.ndarray) -> np.ndarray:
    """A numpy bool array as an Arrow validity bitmap (LSB first)."""
    return np.packbits(np.asarray(valid, dtype=bool), bitorder="little")


def bitmap_slice(bitmap: np.ndarray, start: int, count: int) -> np.ndarray:
    """Bits ``start .. start + count`` of a bitmap as a bitmap that starts at bit 0 (a view when byte-aligned)."""
    if start % 8 == 0:
        return bitmap[start // 8:start // 8 + (count + 7) // 8]
    return pack_bits(unpack_bits(bitmap, start, count))


class RaggedColumn:
    """Rows of variable length: binary or string values, or arrays (nested to any depth), with nulls.

    Made by the decoder from a batch's frames (:func:`sparkbus.wire.codec.decode_batch`); read-only and zero-copy.

    * ``len(col)``; ``col[i]``: row ``i``, or None for a null row. A row is a ``memoryview`` of its bytes for a
      binary column, a ``str`` for a string column, a read-only numpy view for an array of numbers (a masked
      array where the array holds nulls), and a :class:`RaggedColumn` for an array of arrays or of strings.
      ``col[a:b]`` is a slice, without a copy.
    * ``offsets`` (numpy, from 0), ``values`` (the next level: numpy, or a RaggedColumn for nested arrays),
      ``valid`` (numpy bool, False at null rows), ``lengths()``, ``null_count``.
    * ``to_pylist()``, ``to_arrow()`` (a ``pyarrow.Array`` over the same memory), ``pad(...)``.
    """

    __slots__ = ("_dtype", "_offsets", "_valid", "_start", "_len", "_child", "_leaf_valid")

    def __init__(self, dtype: str, offsets: np.ndarray, valid: np.ndarray | None, child: RaggedColumn | np.ndarray,
                 leaf_valid: np.ndarray | None = None, start: int = 0, length: int | None = None):
        self._dtype = dtype                  # the leaf's dtype string on the wire ("bin", "str", "<i4", ...)
        self._offsets = offsets              # the whole level's offsets (count + 1)
        self._valid = valid                  # the whole level's validity bitmap, or None
        self._child = child                  # the whole next level, or the leaf values
        self._leaf_valid = leaf_valid        # the leaf's bitmap (when the child is the leaf), or None
        self._start = start
        self._len = len(offsets) - 1 - start if length is None else length

    # ---- shape ------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    @property
    def kind(self) -> str:
        """``"binary"``, ``"string"`` or ``"list"``."""
        if isinstance(self._child, np.ndarray) and self._dtype in BYTE_STRINGS:
            return "binary" if self._dtype == "bin" else "string"
        return "list"

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype of the leaf values (``uint8`` for the bytes of binary and string values)."""
        return np.dtype(np.uint8) if self._dtype in BYTE_STRINGS else np.dtype(self._dtype)

    @property
    def depth(self) -> int:
        """Levels of offsets: 1 for binary, strings and arrays of numbers, 2 for arrays of those, and so on."""
        return 1 + (self._child.depth if isinstance(self._child, RaggedColumn) else 0)

    @property
    def null_count(self) -> int:
        return 0 if self._valid is None else int(self._len - np.count_nonzero(self.valid))

    @property
    def nbytes(self) -> int:
        """Bytes of this column's offsets, bitmaps and values (of this slice)."""
        bounds = self._bounds()
        inner = self._level(int(bounds[0]), int(bounds[-1]))
        bitmap = 0 if self._valid is None else (self._len + 7) // 8
        return bounds.nbytes + bitmap + int(inner.nbytes)

    @property
    def valid(self) -> np.ndarray:
        """A bool per row, False where the row is null."""
        if self._valid is None:
            return np.ones(self._len, dtype=bool)
        return unpack_bits(self._valid, self._start, self._len)

    def _bounds(self) -> np.ndarray:
        return self._offsets[self._start:self._start + self._len + 1]

    @property
    def offsets(self) -> np.ndarray:
        """``len(col) + 1`` offsets into :attr:`values`, starting at 0."""
        bounds = self._bounds()
        return bounds if bounds[0] == 0 else bounds - bounds[0]

    def lengths(self) -> np.ndarray:
        """The length of each row (values, bytes, or inner arrays); 0 for a null row as Arrow writes them."""
        return np.diff(self._bounds()).astype(np.int64, copy=False)

    @property
    def values(self) -> np.ndarray | RaggedColumn:
        """The next level of this column's rows, back to back: numpy, or a RaggedColumn for nested arrays."""
        bounds = self._bounds()
        return self._level(int(bounds[0]), int(bounds[-1]))

    def _level(self, lo: int, hi: int) -> np.ndarray | RaggedColumn:
        if isinstance(self._child, RaggedColumn):
            return self._child._slice(lo, hi - lo)
        if self._leaf_valid is not None:
            mask = ~unpack_bits(self._leaf_valid, lo * _inner(self._child), (hi - lo) * _inner(self._child))
            return np.ma.MaskedArray(self._child[lo:hi], mask=mask.reshape(self._child[lo:hi].shape))
        return self._child[lo:hi]

    @property
    def _leaf(self) -> np.ndarray:
        """The leaf values (of a column whose next level is the leaf)."""
        return cast(np.ndarray, self._child)

    def _slice(self, start: int, length: int) -> RaggedColumn:
        return RaggedColumn(self._dtype, self._offsets, self._valid, self._child, self._leaf_valid,
                            self._start + start, length)

    # ---- rows -------------------------------------------------------------------------------------------

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                raise IndexError("a RaggedColumn slice takes a step of 1")
            return self._slice(start, max(0, stop - start))
        i = int(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"row {index} of a column of {self._len}")
        at = self._start + i
        if self._valid is not None and not (self._valid[at >> 3] >> (at & 7)) & 1:
            return None
        lo, hi = int(self._offsets[at]), int(self._offsets[at + 1])
        if self.kind == "binary":
            return self._leaf[lo:hi].data          # a read-only memoryview
        if self.kind == "string":
            return self._leaf[lo:hi].tobytes().decode("utf-8")
        return self._level(lo, hi)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(self._len))

    def __repr__(self) -> str:
        return f"RaggedColumn({self._type_name()}, {self._len} rows, {self.null_count} null)"

    def _type_name(self) -> str:
        if self.kind in ("binary", "string"):
            return self.kind
        if isinstance(self._child, RaggedColumn):
            return f"list<{self._child._type_name()}>"
        return f"list<{np.dtype(self._dtype).name}{list(self._child.shape[1:]) or ''}>"

    def to_pylist(self) -> list[Any]:
        """The rows as Python objects: ``bytes``, ``str``, lists (nested, with None for nulls inside), None for a
        null row, Python numbers; dates and timestamps as ``datetime`` (naive, in UTC)."""
        bounds = self._bounds()
        lo = int(bounds[0])
        if self.kind == "binary" or self.kind == "string":
            data = self._child[lo:int(bounds[-1])].tobytes()
            rows: list[Any] = [data[a - lo:b - lo] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
            if self.kind == "string":
                rows = [r.decode("utf-8") for r in rows]
        else:
            inner = self._level(lo, int(bounds[-1]))
            flat = inner.to_pylist() if isinstance(inner, RaggedColumn) else inner.tolist()
            rows = [flat[a - lo:b - lo] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        if self._valid is not None:
            rows = [r if ok else None for r, ok in zip(rows, self.valid.tolist())]
        return rows

    def to_arrow(self) -> Any:
        """This column as a ``pyarrow.Array`` over the same memory (no copy)."""
        return self._arrow_level().slice(self._start, self._len)

    def _arrow_level(self) -> Any:
        import pyarrow as pa

        large = self._offsets.dtype.itemsize == 8
        count = len(self._offsets) - 1
        validity = None if self._valid is None else pa.py_buffer(self._valid)
        offsets = pa.py_buffer(self._offsets)
        if self.kind in ("binary", "string"):
            kind = {("binary", False): pa.binary(), ("binary", True): pa.large_binary(),
                    ("string", False): pa.string(), ("string", True): pa.large_string()}[self.kind, large]
            return pa.Array.from_buffers(kind, count, [validity, offsets, pa.py_buffer(self._child)])
        child = self._child._arrow_level() if isinstance(self._child, RaggedColumn) \
            else _arrow_leaf(self._child, self._leaf_valid)
        kind = pa.large_list(child.type) if large else pa.list_(child.type)
        return pa.Array.from_buffers(kind, count, [validity, offsets], children=[child])

    # ---- padding ----------------------------------------------------------------------------------------

    def pad(self, value: Any = 0, max_length: int | None = None,
            dtype: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows as one ``[n, L, ...]`` array, ``L`` the longest row (at most ``max_length``), filled with ``value``.

        Null rows, and nulls inside arrays, are filled with ``value`` too. Binary and string rows pad their bytes
        (``uint8``).

        Returns:
            ``(padded, lengths)``: the array (a new one) and each row's length after truncation (int64).
        Raises:
            TypeError: a nested column (arrays of arrays or of strings); pad its ``values`` level instead.
        """
        if isinstance(self._child, RaggedColumn):
            raise TypeError(f"pad() takes one level of offsets; this column is {self._type_name()}")
        bounds = self._bounds()
        lengths = np.diff(bounds).astype(np.int64)
        if self._valid is not None:
            lengths[~self.valid] = 0
        if max_length is not None:
            np.minimum(lengths, max_length, out=lengths)
        longest = int(lengths.max()) if self._len else 0
        leaf = self._leaf
        if self._leaf_valid is not None:
            leaf = cast(np.ma.MaskedArray, self._level(0, len(leaf))).filled(value)
        out = np.full((self._len, longest, *leaf.shape[1:]), value, dtype=dtype or self.dtype)
        if longest:
            real = np.arange(longest) < lengths[:, None]
            out[real] = leaf[(bounds[:-1, None] + np.arange(longest))[real]]
        return out, lengths

    # ---- rows in another order (shuffle buffers) --------------------------------------------------------------

    def take(self, indices: Any) -> RaggedColumn:
        """The rows at ``indices``, in that order, as a new column (its buffers are new, vectorised copies)."""
        idx = np.asarray(indices, dtype=np.int64)
        bounds = self._bounds()
        starts, lengths = bounds[:-1][idx], np.diff(bounds)[idx]
        offsets = np.zeros(len(idx) + 1, dtype=self._offsets.dtype)
        np.cumsum(lengths, out=offsets[1:])
        # positions in the next level: each row's range, back to back
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
        valid = None if self._valid is None else pack_bits(self.valid[idx])
        if isinstance(self._child, RaggedColumn):
            return RaggedColumn(self._dtype, offsets, valid, self._child.take(positions))
        leaf_valid = None
        if self._leaf_valid is not None:
            inner = _inner(self._child)
            scalars = (positions[:, None] * inner + np.arange(inner)).reshape(-1)
            leaf_valid = pack_bits(unpack_bits(self._leaf_valid, 0, len(self._child) * inner)[scalars])
        return RaggedColumn(self._dtype, offsets, valid, self._child[positions], leaf_valid)

    # ---- back to the wire ---------------------------------------------------------------------------------

    def wire(self) -> WireColumn:
        """This column (or slice) in wire form, offsets from 0: what a rank sends another rank at an epoch's end."""
        levels: list[list] = []
        buffers: list[Any] = []
        node: RaggedColumn | np.ndarray = self
        start, count = self._start, self._len
        while isinstance(node, RaggedColumn):
            bounds = node._offsets[start:start + count + 1]
            if node._valid is not None:
                buffers.append(bitmap_slice(node._valid, start, count))
            buffers.append(bounds - bounds[0] if bounds[0] else bounds)
            levels.append([count, node._offsets.dtype.itemsize, node._valid is not None])
            start, count = int(bounds[0]), int(bounds[-1] - bounds[0])
            leaf_valid, node = node._leaf_valid, node._child
        values = node[start:start + count]
        if leaf_valid is not None:
            inner = _inner(node)
            buffers.append(bitmap_slice(leaf_valid, start * inner, count * inner))
        buffers.append(np.ascontiguousarray(values).reshape(-1).view(np.uint8))
        return WireColumn(self._dtype, list(values.shape), levels, leaf_valid is not None, buffers)


def _inner(leaf: np.ndarray) -> int:
    """Values per leaf item (the product of its fixed inner dimensions)."""
    return int(np.prod(leaf.shape[1:], dtype=np.int64))


def _arrow_leaf(values: np.ndarray, bitmap: np.ndarray | None) -> Any:
    import pyarrow as pa

    flat = values.reshape(-1)
    if flat.dtype == np.dtype("<M8[D]"):      # Arrow's date32 has 4 bytes: a copy, as for booleans
        mask = None if bitmap is None else ~unpack_bits(bitmap, 0, len(flat))
        array = pa.array(flat, mask=mask)
    else:
        data = pa.py_buffer(pack_bits(flat) if flat.dtype == np.bool_ else flat)    # Arrow's booleans are bits
        array = pa.Array.from_buffers(pa.from_numpy_dtype(flat.dtype), len(flat),
                                      [None if bitmap is None else pa.py_buffer(bitmap), data])
    for width in reversed(values.shape[1:]):
        array = pa.FixedSizeListArray.from_arrays(array, width)
    return array


def concat_ragged(columns: list[RaggedColumn]) -> RaggedColumn:
    """Columns of one type (kind, dtype, depth) as one, rows back to back (new buffers)."""
    first = columns[0]
    if any(c._dtype != first._dtype or c.depth != first.depth for c in columns):
        raise ValueError(f"cannot join columns of types {sorted({c._type_name() for c in columns})}")
    width = max(c._offsets.dtype.itemsize for c in columns)
    pieces, shift = [np.zeros(1, dtype=f"<i{width}")], 0
    for column in columns:
        bounds = column.offsets
        pieces.append(bounds[1:] + shift)
        shift += int(bounds[-1])
    offsets = np.concatenate(pieces).astype(f"<i{width}", copy=False)
    valid = None
    if any(c._valid is not None for c in columns):
        valid = pack_bits(np.concatenate([c.valid for c in columns]))
    inner: list[Any] = [c.values for c in columns]
    if isinstance(first._child, RaggedColumn):
        return RaggedColumn(first._dtype, offsets, valid, concat_ragged(inner))
    leaf_valid = None
    if any(isinstance(v, np.ma.MaskedArray) for v in inner):
        joined = np.ma.concatenate(inner)
        leaf_valid = pack_bits(~np.ma.getmaskarray(joined).reshape(-1))
        leaf = np.ma.getdata(joined)
    else:
        leaf = np.concatenate(inner)
    return RaggedColumn(first._dtype, offsets, valid, leaf, leaf_valid)


def pad(column: Any, value: Any = 0, max_length: int | None = None,
        dtype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """``(padded, lengths)`` for a column in either form: a :class:`RaggedColumn` (see :meth:`RaggedColumn.pad`)
    or a numpy ``[n, k, ...]`` array, whose rows all have length ``k`` (truncated to ``max_length``; masked
    values filled with ``value``)."""
    if isinstance(column, RaggedColumn):
        return column.pad(value, max_length, dtype)
    array = np.asarray(column.filled(value) if isinstance(column, np.ma.MaskedArray) else column)
    if array.ndim < 2:
        raise TypeError(f"pad() needs rows of values: an array of shape {array.shape} has scalar rows")
    if max_length is not None:
        array = array[:, :max_length]
    if dtype is not None:
        array = array.astype(dtype, copy=False)
    return array, np.full(len(array), array.shape[1], dtype=np.int64)



# ---- packing sequences into rows of one length (language-model pre-training) ----------------------------------

class Carry(NamedTuple):
    """Tokens after the last whole row of a :func:`pack`: pass it as ``carry=`` to the next call."""

    tokens: np.ndarray        # the tokens, in order
    starts: np.ndarray        # indices into ``tokens`` where a document begins


class Packed(NamedTuple):
    """Sequences packed into rows of ``length`` tokens (:func:`pack`)."""

    tokens: np.ndarray        # [rows, length]: a read-only view of the batch's frame when no carry came in
    segments: np.ndarray      # [rows, length] int32: 1, 2, ... the document within its row; 0 for padding
    positions: np.ndarray     # [rows, length] int32: the position in its document, from 0 at each document and row
    rest: Carry               # what did not fill a whole row

    @property
    def attention_mask(self) -> np.ndarray:
        """[rows, length, length] bool: a token attends to the tokens before it in its own document (causal,
        block-diagonal by ``segments``). A new array; for long rows prefer ``segments`` with an attention kernel
        that takes them."""
        same = self.segments[:, :, None] == self.segments[:, None, :]
        causal = np.tri(self.tokens.shape[1], dtype=bool)
        return same & causal & (self.segments[:, :, None] > 0)


def pack(column: Any, length: int, carry: Carry | None = None, pad_last: bool = False,
         value: Any = 0) -> Packed:
    """Pack variable-length sequences (token ids: a :class:`RaggedColumn` of arrays of numbers, or a numpy
    ``[n, k]`` array) into rows of exactly ``length`` tokens, documents back to back, each row cut where it is
    full (a document may go on in the next row), with the boundaries kept: ``segments`` numbers the documents of a
    row, ``positions`` restarts at each document and row.

    Zero-copy: a batch's tokens lie back to back in its frame (Arrow's layout), so without ``carry`` the rows are a
    reshaped view of it; ``segments`` and ``positions`` are new (int32). With ``carry`` (the ``rest`` of the call
    before, to pack across batches without dropping a token) the tokens are joined once (a copy). Every token goes
    out once: in a row or in ``rest``; ``pad_last`` pads the last partial row with ``value`` (segment 0) instead.
    A null row and an empty row add nothing.

    Raises:
        ValueError: ``length`` below 1.
        TypeError: a column that is not one level of arrays of numbers (strings, binary, arrays of arrays), or
            arrays holding nulls.
    """
    if length < 1:
        raise ValueError(f"pack() needs a row length of at least 1, not {length}")
    if isinstance(column, RaggedColumn):
        if column.kind != "list" or column.depth != 1:
            raise TypeError(f"pack() takes sequences of numbers (token ids); this column is {column._type_name()}")
        flat = column.values
        if isinstance(flat, np.ma.MaskedArray):
            raise TypeError("pack() takes token ids without nulls inside the arrays")
        offsets = column.offsets.astype(np.int64, copy=False)
    else:
        array = np.asarray(column)
        if array.ndim != 2:
            raise TypeError(f"pack() needs rows of token ids: an array of shape {array.shape} is not [n, k]")
        flat = array.reshape(-1)
        offsets = np.arange(0, array.size + 1, max(array.shape[1], 1), dtype=np.int64)[:len(array) + 1]
    flat = cast(np.ndarray, flat)
    starts = offsets[:-1][np.diff(offsets) > 0]
    if carry is not None and len(carry.tokens):
        starts = np.concatenate([carry.starts.astype(np.int64, copy=False), starts + len(carry.tokens)])
        flat = np.concatenate([carry.tokens, flat])
    total = len(flat)
    rows, used = divmod(total, length)[0], total // length * length
    if pad_last and used < total:
        flat = np.concatenate([flat, np.full(used + length - total, value, dtype=flat.dtype)])
        rows, used = rows + 1, used + length
    tokens = flat[:used].reshape(rows, length)
    boundary = np.zeros(used, dtype=bool)
    boundary[starts[starts < used]] = True
    boundary[::length] = True                       # every row starts a segment (a document going on, or a new one)
    index = np.arange(used, dtype=np.int64)
    positions = (index - np.maximum.accumulate(np.where(boundary, index, 0))).astype(np.int32)
    segments = np.cumsum(boundary.reshape(rows, length), axis=1, dtype=np.int32)
    if used > total:                                # the padding of the last row: no document
        segments.reshape(-1)[total:] = 0
        positions[total:] = 0
    rest = Carry(flat[used:] if used <= total else flat[:0], starts[starts >= used] - used)
    return Packed(tokens, segments, positions.reshape(rows, length), rest)
