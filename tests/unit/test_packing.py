"""``pack``: variable-length token sequences into rows of one length, with document boundaries, zero-copy where
the frame's layout allows (wire/ragged.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkbus import Carry, pack
from sparkbus.feeder.columns import partition_messages
from sparkbus.wire import codec, protocol


def received(docs):
    """The column a rank gets for these documents (a RaggedColumn over the batch's frames)."""
    rb = pa.record_batch({"t": pa.array(docs, pa.list_(pa.int32()))})
    (columns, _), = list(partition_messages([rb], batch_size=len(docs), max_bytes=1 << 30, pack_bytes=0,
                                            ragged=["t"]))
    frames = codec.encode_batch("s", 0, 0, 0, columns)
    return codec.decode_batch(protocol.unpack_header(frames[0]), frames[1:])["t"]


def test_rows_of_exactly_the_length_with_documents_numbered_and_positions_restarting():
    column = received([[1, 2, 3], [4, 5], [], [6, 7, 8, 9, 10], [11]])
    packed = pack(column, 4)
    assert packed.tokens.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert packed.segments.tolist() == [[1, 1, 1, 2], [1, 2, 2, 2]]      # 5 goes on from the row before
    assert packed.positions.tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert packed.rest.tokens.tolist() == [9, 10, 11] and packed.rest.starts.tolist() == [2]
    assert np.shares_memory(packed.tokens, column.values), "the rows are a view of the frame"
    assert packed.segments.dtype == packed.positions.dtype == np.int32
    again = pack(column, 4, carry=packed.rest, pad_last=True)
    assert again.tokens.tolist() == [[9, 10, 11, 1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 0, 0]]
    assert again.segments.tolist() == [[1, 1, 2, 3], [1, 1, 2, 2], [1, 1, 1, 1], [1, 2, 0, 0]]
    assert again.positions.tolist()[0] == [0, 1, 0, 0] and again.positions.tolist()[3] == [0, 0, 0, 0]
    assert len(again.rest.tokens) == 0


def test_the_attention_mask_is_causal_within_each_document():
    packed = pack(received([[1, 2], [3, 4, 5], [6]]), 3, pad_last=True)
    mask = packed.attention_mask
    assert mask.shape == (2, 3, 3)
    assert mask[0].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    assert mask[1].tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def test_a_dense_batch_and_bad_input():
    packed = pack(np.arange(12, dtype=np.int64).reshape(3, 4), 6)
    assert packed.tokens.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert packed.segments.tolist() == [[1, 1, 1, 1, 2, 2], [1, 1, 2, 2, 2, 2]]
    with pytest.raises(ValueError, match="at least 1"):
        pack(np.zeros((2, 2)), 0)
    with pytest.raises(TypeError, match="sequences of numbers"):
        pack(codec.decode_batch(*_header_frames({"b": pa.array([b"ab", b"c"], pa.binary())}))["b"], 2)
    with pytest.raises(TypeError, match="is not \\[n, k\\]"):
        pack(np.arange(5), 2)


def _header_frames(arrays):
    rb = pa.record_batch(arrays)
    (columns, _), = list(partition_messages([rb], batch_size=10, max_bytes=1 << 30, pack_bytes=0))
    frames = codec.encode_batch("s", 0, 0, 0, columns)
    return protocol.unpack_header(frames[0]), frames[1:]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), max_size=9), min_size=1, max_size=12), st.integers(1, 7),
       st.integers(1, 4))
def test_every_token_once_in_order_across_batches_with_every_document_start_kept(docs, length, batches):
    chunks = [docs[i::batches] for i in range(batches)]
    carry: Carry | None = None
    rows, expected = [], []
    for chunk in chunks:
        if not chunk:
            continue
        expected.extend(chunk)
        packed = pack(received(chunk), length, carry=carry)
        carry = packed.rest
        for tokens, segments, positions in zip(packed.tokens, packed.segments, packed.positions):
            rows.append((tokens.tolist(), segments.tolist(), positions.tolist()))
    flat = [t for tokens, _, _ in rows for t in tokens] + (carry.tokens.tolist() if carry is not None else [])
    assert flat == [t for doc in expected for t in doc], "every token once, in order"
    assert all(len(tokens) == length for tokens, _, _ in rows)
    # a new document begins where positions restart inside a row (or a row begins)
    starts, at = set(), 0
    for doc in expected:
        if doc:
            starts.add(at)
        at += len(doc)
    for r, (_, segments, positions) in enumerate(rows):
        for i in range(length):
            index = r * length + i
            assert (positions[i] == 0) == (i == 0 or index in starts)
            assert segments[i] == 1 + sum(1 for j in range(1, i + 1) if r * length + j in starts)
