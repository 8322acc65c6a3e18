"""RaggedColumn, the rank's form of binary, strings and arrays of varying length: its verbs and their types."""

import numpy as np
import pyarrow as pa
import pytest

from sparkbus.feeder.columns import wire_columns
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.ragged import RaggedColumn, pad
from sparkbus.worker import rebalance


def decoded(**arrays):
    frames = codec.encode_batch("s", 0, 0, 0, wire_columns(pa.record_batch(arrays)))
    header = protocol.unpack_header(frames[0])
    return codec.decode_batch(header, [bytes(memoryview(f)) for f in frames[1:]])


def test_rows_of_each_kind_and_their_python_types():
    out = decoded(img=pa.array([b"\x00\x01", None, b""], pa.binary()), text=pa.array(["ünï", None, ""]),
                  tokens=pa.array([[1, 2, 3], None, []], pa.list_(pa.int32())),
                  nested=pa.array([[[1], [2, None]], None, [[]]], pa.list_(pa.list_(pa.int64()))))
    img, text, tokens, nested = out["img"], out["text"], out["tokens"], out["nested"]
    assert len(img) == len(text) == len(tokens) == len(nested) == 3
    assert isinstance(img[0], memoryview) and img[0].readonly and bytes(img[0]) == b"\x00\x01"
    assert img[1] is None and bytes(img[2]) == b""
    assert text[0] == "ünï" and text[1] is None and text[2] == ""
    assert isinstance(tokens[0], np.ndarray) and tokens[0].dtype == np.int32 and tokens[0].tolist() == [1, 2, 3]
    assert not tokens[0].flags.writeable
    assert isinstance(nested[0], RaggedColumn) and nested[0].to_pylist() == [[1], [2, None]]
    assert isinstance(nested[0][1], np.ma.MaskedArray) and nested[0][1].tolist() == [2, None]
    assert img.to_pylist() == [b"\x00\x01", None, b""] and all(type(v) is bytes for v in img.to_pylist()[::2])
    assert text.to_pylist() == ["ünï", None, ""]
    assert tokens.to_pylist() == [[1, 2, 3], None, []]
    assert nested.to_pylist() == [[[1], [2, None]], None, [[]]]
    assert [img.kind, text.kind, tokens.kind, nested.kind] == ["binary", "string", "list", "list"]
    assert nested.depth == 2 and tokens.depth == 1
    assert tokens[-1].tolist() == [] and list(text) == ["ünï", None, ""]
    with pytest.raises(IndexError):
        tokens[3]


def test_offsets_values_and_valid_of_a_slice_start_at_its_first_row():
    out = decoded(tokens=pa.array([[1, 2], [3], None, [4, 5, 6], [7]], pa.list_(pa.int64())))
    part = out["tokens"][1:4]
    assert len(part) == 3 and part.to_pylist() == [[3], None, [4, 5, 6]]
    assert part.offsets.tolist() == [0, 1, 1, 4]
    assert part.values.tolist() == [3, 4, 5, 6]
    assert part.valid.tolist() == [True, False, True] and part.null_count == 1
    assert part.lengths().tolist() == [1, 0, 3]
    assert np.shares_memory(part.values, out["tokens"].values)


def test_to_arrow_shares_the_received_memory():
    tokens = decoded(t=pa.array([[1, 2], None, [3]], pa.list_(pa.int32())))["t"]
    arrow = tokens.to_arrow()
    assert arrow.type == pa.list_(pa.int32()) and arrow.to_pylist() == [[1, 2], None, [3]]
    assert arrow.values.buffers()[1].address == tokens.values.__array_interface__["data"][0]
    assert tokens[1:].to_arrow().to_pylist() == [None, [3]]
    text = decoded(s=pa.array(["a", None, "bc"]))["s"]
    assert text.to_arrow().type == pa.string() and text.to_arrow().to_pylist() == ["a", None, "bc"]


def test_pad_gives_a_rectangle_and_lengths_with_truncation():
    tokens = decoded(t=pa.array([[1, 2, 3], None, [], [4, None]], pa.list_(pa.int32())))["t"]
    padded, lengths = tokens.pad(-1)
    assert padded.dtype == np.int32 and padded.tolist() == [[1, 2, 3], [-1, -1, -1], [-1, -1, -1], [4, -1, -1]]
    assert lengths.tolist() == [3, 0, 0, 2]
    short, short_lengths = pad(tokens, 0, max_length=2)
    assert short.tolist() == [[1, 2], [0, 0], [0, 0], [4, 0]] and short_lengths.tolist() == [2, 0, 0, 2]
    dense, dense_lengths = pad(np.arange(6).reshape(2, 3), max_length=2)
    assert dense.tolist() == [[0, 1], [3, 4]] and dense_lengths.tolist() == [2, 2]
    raw, raw_lengths = decoded(b=pa.array([b"ab", b"c"], pa.binary()))["b"].pad()
    assert raw.dtype == np.uint8 and raw.tolist() == [[97, 98], [99, 0]] and raw_lengths.tolist() == [2, 1]
    with pytest.raises(TypeError, match="one level"):
        decoded(n=pa.array([[[1], [2, 3]], []], pa.list_(pa.list_(pa.int8()))))["n"].pad()


def test_a_ragged_batch_moves_between_ranks_in_wire_form():
    out = decoded(id=pa.array([0, 1, 2, 3]), s=pa.array(["a", None, "ccc", "dd"]),
                  t=pa.array([[1], [2, 3], None, []], pa.list_(pa.int16())), f=pa.array([1.0, None, 3.0, 4.0]))
    part = {k: v[1:3] for k, v in out.items()}
    header, back = rebalance.unpack_batch(rebalance.pack_batch(dict(stream="s", epoch=0, part=0, seq=1), part))
    assert back["id"].tolist() == [1, 2] and back["s"].to_pylist() == [None, "ccc"]
    assert back["t"].to_pylist() == [[2, 3], None] and back["f"].tolist() == [None, 3.0]


def test_offsets_that_do_not_rise_are_refused_on_the_rank():
    frames = codec.encode_batch("s", 0, 0, 0, wire_columns(pa.record_batch({"t": pa.array([[1], [2, 3]])})))
    header = protocol.unpack_header(frames[0])
    bad = np.array([0, 2, 1], dtype="<i4").tobytes()          # the right size and checksum-free: decreasing
    with pytest.raises(ProtocolError, match="offsets of level 0 do not rise from 0 to 3"):
        codec.decode_batch(header, [bad, bytes(memoryview(frames[2]))], verify=False)
    with pytest.raises(ProtocolError, match="frame 1: 8 bytes, the header says 12"):
        codec.decode_batch(header, [bad[:8], bytes(memoryview(frames[2]))], verify=False)


def test_take_and_concat_keep_every_value_nested_and_null():
    from sparkbus.wire.ragged import concat_ragged

    source = [[[1], [2, None]], None, [[]], [[3, 4, 5]], []]
    nested = decoded(n=pa.array(source, pa.list_(pa.list_(pa.int64()))))["n"]
    assert nested.take([3, 0, 1]).to_pylist() == [source[3], source[0], None]
    assert nested[1:4].take([2, 0]).to_pylist() == [source[3], None]
    joined = concat_ragged([nested[3:], nested[:2]])
    assert joined.to_pylist() == source[3:] + source[:2] and joined.to_arrow().to_pylist() == joined.to_pylist()
    text = decoded(s=pa.array(["a", None, "ccc"]))["s"]
    assert concat_ragged([text, text[2:]]).take([3, 1, 0]).to_pylist() == ["ccc", None, "a"]
    with pytest.raises(ValueError, match="cannot join"):
        concat_ragged([text, nested])
