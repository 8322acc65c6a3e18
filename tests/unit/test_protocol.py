"""The wire contract: every supported dtype and shape survives a round trip; bad headers are refused."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkbus.wire import address, codec, protocol
from sparkbus.wire.errors import ProtocolError, VersionMismatch
from sparkbus.wire.protocol import Kind

DTYPES = sorted(protocol.WIRE_DTYPES - protocol.BYTE_STRINGS)     # the bytes of binary and strings: test_columns
SHAPES = [(0,), (7,), (7, 3), (7, 2, 3), (1, 1)]


def roundtrip(columns):
    frames = codec.encode_batch("train", 3, 5, 9, columns)
    header = protocol.unpack_header(frames[0])
    return header, codec.decode_batch(header, [memoryview(f) for f in frames[1:]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_roundtrip_every_dtype_and_shape(dtype, shape):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 100, size=shape) % (2 if dtype == "|b1" else 100)
    data = raw.astype(dtype) if dtype[1] not in "Mm" else raw.astype(np.int64).view(dtype)
    ids = np.arange(shape[0], dtype=np.int64)
    header, out = roundtrip({"x": data, "id": ids})
    assert header["kind"] == Kind.BATCH
    assert protocol.batch_id(header) == (3, 5, 9)
    assert header["rows"] == shape[0]
    assert list(out) == ["x", "id"]
    assert out["x"].dtype == np.dtype(dtype) and out["x"].shape == shape
    np.testing.assert_array_equal(out["x"], data)
    np.testing.assert_array_equal(out["id"], ids)


def test_big_endian_and_strided_inputs_are_made_wire_ready():
    big = np.arange(10, dtype=">f8")
    strided = np.arange(40, dtype=np.int32).reshape(10, 4)[:, ::2]
    _, out = roundtrip({"big": big, "strided": strided})
    assert out["big"].dtype == np.dtype("<f8")
    np.testing.assert_array_equal(out["big"], np.arange(10))
    np.testing.assert_array_equal(out["strided"], strided)


def test_decoded_arrays_share_the_received_buffer():
    frames = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(1000, dtype=np.float32)})
    payload = bytearray(bytes(frames[1]))
    header = protocol.unpack_header(frames[0])
    out = codec.decode_batch(header, [payload], verify=False)
    payload[0:4] = np.float32(42).tobytes()
    assert out["x"][0] == 42.0          # a view, not a copy


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([1 + 2j, 3j]), np.array([None, 1]),
                                 np.array(["2020-01-01T10"], dtype="datetime64[h]")])
def test_unsupported_dtypes_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="column 'odd'"):
        codec.encode_batch("s", 0, 0, 0, {"odd": bad})


def test_columns_of_unequal_length_are_refused():
    with pytest.raises(ValueError, match="column 'b' has 3 rows, expected 2"):
        codec.encode_batch("s", 0, 0, 0, {"a": np.zeros(2), "b": np.zeros(3)})


def header(**fields):
    base = {"v": protocol.VERSION, "kind": int(Kind.CREDIT), "window": 4, "window_bytes": 0}
    base.update(fields)
    return msgpack.packb(base)


@pytest.mark.parametrize("buf, message", [
    (b"\xc1garbage", "not valid msgpack"),
    (msgpack.packb([1, 2, 3]), "must be a msgpack map"),
    (header(kind=99), "unknown message kind 99"),
    (header(window="four"), "'window' must be int, got str"),
    (header(window=True), "'window' must be int, got bool"),
    (msgpack.packb({"v": protocol.VERSION, "kind": int(Kind.CREDIT)}), "'window' must be int, got NoneType"),
    (b"\x80" + b"x" * (protocol.MAX_HEADER_BYTES + 1), "exceeds the limit"),
    (msgpack.packb({1: 2}), "not valid msgpack"),       # non-string keys are refused by strict_map_key
])
def test_bad_headers_are_refused_with_a_reason(buf, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.unpack_header(buf)


def test_wrong_version_names_both_versions():
    with pytest.raises(VersionMismatch) as info:
        protocol.unpack_header(header(v=protocol.VERSION + 6))
    assert f"peer speaks {protocol.VERSION + 6}" in info.value.reason
    assert f"this side speaks {protocol.SUPPORTED[0]} and {protocol.VERSION}" in info.value.reason


def batch_header(**changes):
    h = protocol.unpack_header(codec.encode_batch("s", 0, 0, 0, {"x": np.zeros((4, 2), np.float32)})[0])
    h.update(changes)
    return h


@pytest.mark.parametrize("changes, sizes, message", [
    ({}, [32, 1], "describes 1 frames but 2 came"),
    ({}, [31], "frame 1: 31 bytes, the header says 32"),
    ({"cols": [["x", "|O", [4, 2]]]}, [32], "not allowed on the wire"),
    ({"cols": [["x", "<f4", [3, 2]]]}, [24], "3 entries, the batch has 4 rows"),
    ({"cols": [["x", "<f4"]]}, [32], "malformed column spec"),
    ({"cols": [["x", "<f4", [4, -2]]]}, [32], "malformed column spec"),
    ({"rows": -1, "cols": []}, [], "negative row count"),
])
def test_batch_frames_must_match_their_header(changes, sizes, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.check_batch_frames(batch_header(**changes), sizes)


def test_checksum_mismatch_is_detected():
    frames = codec.encode_batch("s", 0, 3, 5, {"x": np.arange(8, dtype=np.int64)})
    corrupted = bytearray(bytes(frames[1]))
    corrupted[3] ^= 0xFF
    with pytest.raises(ProtocolError, match=r"checksum mismatch in batch \(epoch 0, part 3, seq 5\) of stream 's'"):
        codec.decode_batch(protocol.unpack_header(frames[0]), [corrupted])


def test_control_address_is_derived_from_the_feed_address():
    assert address.control_address("tcp://10.0.0.5:5555") == "tcp://10.0.0.5:5557"
    assert address.control_address("ipc:///tmp/bus") == "ipc:///tmp/bus.control"
    with pytest.raises(ValueError, match="explicit numeric port"):
        address.control_address("tcp://host:*")


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_errors(data):
    try:
        protocol.unpack_header(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "kind", "stream", "epoch", "part", "seq", "rows", "cols", "checksum",
                                        "credit", "ids", "req", "reason"]),
                       st.one_of(st.integers(-2, 20), st.text(max_size=5), st.booleans(), st.none(),
                                 st.lists(st.integers(-2**63, 2**63 - 1), max_size=3))))
def test_random_maps_raise_only_protocol_errors(fields):
    try:
        h = protocol.unpack_header(msgpack.packb(fields))
    except ProtocolError:
        return
    for name, kind in protocol.SCHEMAS[h["kind"]].items():
        assert isinstance(h[name], kind)


@pytest.mark.parametrize("header, sizes, reason", [
    ({"rows": 4, "cols": [["x", "<i8", [4]]], "splits": ["2", "2"]}, [32], "splits must be"),
    ({"rows": 4, "cols": [["x", "<i8", [4]]], "splits": [2, None]}, [32], "splits must be"),
    ({"rows": 4, "cols": [["x", "<i8", [4, 10 ** 5000]]]}, [32], "more than"),
    ({"rows": 10 ** 5000, "cols": []}, [], "out of range"),
    ({"rows": -10 ** 5000, "cols": []}, [], "negative row count"),
])
def test_hostile_batch_headers_are_refused_as_malformed_not_as_internal_errors(header, sizes, reason):
    """Element types are checked before arithmetic, and sizes compared before a message prints them: a splits list
    of strings used to raise TypeError in sum(), a shape of thousands of digits a ValueError in the message."""
    with pytest.raises(ProtocolError, match=reason):
        protocol.check_batch_frames(header, sizes)
