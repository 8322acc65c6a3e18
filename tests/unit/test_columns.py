"""The feeder's path, Arrow record batches (and RDD rows) to wire messages, decoded as a rank decodes them.

Every value is compared exactly with what went in: through the cut into batches, the packs, the frames and the
decoder. The property test at the end does the same for random Arrow arrays of every supported type.
"""

import datetime as dt

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkbus.feeder.arrow import UnsupportedColumn, wire_column
from sparkbus.feeder.columns import (
    RecordBatchPlan,
    cut,
    flatten_record_batch,
    partition_messages,
    record_batches_from_rows,
)
from sparkbus.wire import codec, protocol
from sparkbus.wire.ragged import RaggedColumn


def wire(columns, splits=None):
    """Encode, check as the broker checks, decode as a rank decodes."""
    frames = codec.encode_batch("s", 0, 0, 0, columns, splits=splits)
    header = protocol.unpack_header(frames[0])
    protocol.check_batch_frames(header, [memoryview(f).nbytes for f in frames[1:]])
    return header, codec.decode_batch(header, [bytes(memoryview(f)) for f in frames[1:]])


def batches_of(record_batches, **options):
    """Every batch a rank would yield (packs split by rows, as BatchStream does), in order."""
    settings = dict(batch_size=4, max_bytes=1 << 20, pack_bytes=1 << 20)
    settings.update(options)
    out = []
    for columns, splits in partition_messages(record_batches, **settings):
        header, decoded = wire(columns, splits)
        start = 0
        for rows in splits or [header["rows"]]:
            out.append({k: v[start:start + rows] for k, v in decoded.items()})
            start += rows
    return out


def pylist(column):
    return column.to_pylist() if isinstance(column, RaggedColumn) else column.tolist()


def values(batches, name):
    return [v for b in batches for v in pylist(b[name])]


def flat_pylist(record_batch):
    return flatten_record_batch(record_batch).to_pydict()


TABLE = pa.record_batch({
    "id": pa.array(np.arange(10, dtype=np.int64)),
    "score": pa.array([0.5, None, 2.5, 3.5, None, 5.5, 6.5, 7.5, 8.5, None]),
    "image": pa.array([bytes([i]) * i for i in range(10)], pa.binary()),
    "label": pa.array(["zéro", None, "", "trois", "four", "5", "six", None, "huit", "nine"]),
    "tokens": pa.array([[1, 2], [3], None, [], [4, 5, 6], [7], [8, 9], [], None, [10]], pa.list_(pa.int32())),
    "features": pa.array([[float(i), float(-i)] for i in range(10)], pa.list_(pa.float32())),
    "nested": pa.array([[[1], [2, 3]], None, [[None]], [], [[4]], [None, [5]], [[6, 7]], [], [[8]], [[9]]],
                       pa.list_(pa.list_(pa.int64()))),
    "meta": pa.array([{"source": f"s{i}", "pos": {"x": i, "y": float(i) if i % 2 else None}} if i % 3 else None
                      for i in range(10)]),
    "day": pa.array([dt.date(2024, 2, 1 + i) for i in range(10)]),
    "at": pa.array([dt.datetime(2024, 2, 1, 12, 0, i) for i in range(10)], pa.timestamp("us", tz="Europe/Paris")),
    "flag": pa.array([True, False, None, True, True, False, True, None, False, True]),
})


@pytest.mark.parametrize("offset, length", [(0, 10), (3, 7), (1, 5)])
@pytest.mark.parametrize("pack_bytes", [0, 1 << 20])
def test_every_type_arrives_with_its_exact_values(offset, length, pack_bytes):
    source = TABLE.slice(offset, length)          # sliced inputs: offsets and bitmaps that do not start at 0
    expected = flat_pylist(source)
    out = batches_of([source], batch_size=3, pack_bytes=pack_bytes)
    assert [len(b["id"]) for b in out] == [3] * (length // 3) + ([length % 3] if length % 3 else [])
    assert set(out[0]) == set(expected) == {"id", "score", "image", "label", "tokens", "features", "nested",
                                            "meta.source", "meta.pos.x", "meta.pos.y", "day", "at", "flag"}
    for name, column in expected.items():
        got = values(out, name)
        if name == "at":        # Arrow gives aware datetimes; the rank's datetime64 are naive, in UTC
            column = [v.astimezone(dt.timezone.utc).replace(tzinfo=None) for v in column]
        assert got == column, name


def test_forms_on_the_rank():
    (batch,) = batches_of([TABLE], batch_size=10)
    assert type(batch["id"]) is np.ndarray and batch["id"].dtype == np.int64
    assert isinstance(batch["score"], np.ma.MaskedArray) and batch["score"].dtype == np.float64
    assert batch["score"].tolist()[:3] == [0.5, None, 2.5]
    assert type(batch["features"]) is np.ndarray and batch["features"].shape == (10, 2)
    assert batch["features"].dtype == np.float32
    assert batch["day"].dtype == np.dtype("datetime64[D]") and batch["at"].dtype == np.dtype("datetime64[us]")
    # Arrow holds UTC whatever the zone (pyarrow read these naive datetimes as UTC): so does the rank
    assert batch["at"][0] == np.datetime64("2024-02-01T12:00:00")
    assert isinstance(batch["flag"], np.ma.MaskedArray) and batch["flag"].dtype == np.bool_
    for name in ("image", "label", "tokens", "nested", "meta.source"):
        assert isinstance(batch[name], RaggedColumn), name
    assert isinstance(batch["meta.pos.x"], np.ma.MaskedArray)            # null where the struct is
    assert batch["meta.pos.x"].tolist() == [None, 1, 2, None, 4, 5, None, 7, 8, None]
    assert batch["meta.pos.y"].tolist() == [None, 1.0, None, None, None, 5.0, None, 7.0, None, None]


def test_a_batch_is_a_view_of_the_arrow_buffers():
    big = pa.array(np.arange(100_000, dtype=np.float32))
    strings = pa.array([f"row {i}" for i in range(1000)])
    column = wire_column("x", big.slice(8, 1000))
    assert np.shares_memory(np.frombuffer(column.buffers[0], np.float32), big.to_numpy())
    text = wire_column("s", strings.slice(16, 100))
    data = np.frombuffer(strings.buffers()[2], np.uint8)
    assert np.shares_memory(np.frombuffer(text.buffers[1], np.uint8), data)     # values: a slice, no copy
    assert text.buffers[0][0] == 0                                                # offsets rebased from 0


def test_declared_ragged_columns_keep_their_form_in_every_batch():
    uniform = pa.record_batch({"tokens": pa.array([[1, 2]] * 5, pa.list_(pa.int32())),
                               "img": pa.array([b"ab"] * 5, pa.binary())})
    undeclared = batches_of([uniform], batch_size=2)
    assert [type(b["tokens"]) for b in undeclared] == [np.ndarray] * 3
    declared = batches_of([uniform], batch_size=2, ragged=["tokens"])
    assert [type(b["tokens"]) for b in declared] == [RaggedColumn] * 3          # a 1-row batch too
    assert [len(b["tokens"]) for b in declared] == [2, 2, 1]
    assert values(declared, "tokens") == [[1, 2]] * 5
    fixed = pa.record_batch({"v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(6, dtype=np.int16)), 3)})
    (batch,) = batches_of([fixed], ragged=["v"])
    assert isinstance(batch["v"], RaggedColumn) and batch["v"].to_pylist() == [[0, 1, 2], [3, 4, 5]]


def test_uneven_arrays_are_ragged_and_even_ones_dense_within_one_partition():
    rb = pa.record_batch({"t": pa.array([[1, 2], [3, 4], [5], [6, 7]], pa.list_(pa.int64()))})
    out = batches_of([rb], batch_size=2)
    assert type(out[0]["t"]) is np.ndarray and out[0]["t"].tolist() == [[1, 2], [3, 4]]
    assert isinstance(out[1]["t"], RaggedColumn) and out[1]["t"].to_pylist() == [[5], [6, 7]]


def test_nulls_at_batch_boundaries_and_bitmaps_at_bit_offsets():
    score = pa.array([None if i % 5 in (0, 4) else float(i) for i in range(40)])
    rb = pa.record_batch({"score": score, "s": pa.array([None if i % 4 == 3 else str(i) for i in range(40)])})
    for offset in (0, 1, 3, 8, 13):
        source = rb.slice(offset)
        out = batches_of([source], batch_size=5, pack_bytes=0)
        assert values(out, "score") == source.column(0).to_pylist()
        assert values(out, "s") == source.column(1).to_pylist()
        assert [isinstance(b["score"], np.ma.MaskedArray) for b in out] == [
            b["score"].count() < len(b["score"]) if isinstance(b["score"], np.ma.MaskedArray) else False
            for b in out]


def test_a_batch_spanning_two_record_batches_is_joined_once():
    a, b = TABLE.slice(0, 5), TABLE.slice(5, 5)
    out = batches_of([a, b], batch_size=4, pack_bytes=0)
    assert [len(x["id"]) for x in out] == [4, 4, 2]
    assert values(out, "label") == TABLE.column(TABLE.schema.get_field_index("label")).to_pylist()
    assert values(out, "tokens") == TABLE.column(TABLE.schema.get_field_index("tokens")).to_pylist()


def test_batches_are_cut_by_bytes_for_variable_length_rows():
    sizes = [10, 10, 10, 50, 10, 200, 10]
    rb = pa.record_batch({"blob": pa.array([b"x" * n for n in sizes], pa.binary())})
    cuts = [b.rows for b in cut([RecordBatchPlan(rb)], batch_size=100, max_bytes=60)]
    assert cuts == [3, 2, 1, 1]          # 30 bytes, then 50 + 10, then 200 alone, then 10


def test_a_row_larger_than_the_cap_travels_alone():
    rb = pa.record_batch({"blob": pa.array([b"a" * 10, b"b" * 500, b"c" * 10], pa.binary())})
    assert [b.rows for b in cut([RecordBatchPlan(rb)], batch_size=100, max_bytes=100)] == [1, 1, 1]
    out = batches_of([rb], batch_size=100, max_bytes=100)
    assert values(out, "blob") == [b"a" * 10, b"b" * 500, b"c" * 10]


def test_small_variable_length_batches_travel_as_one_pack_without_a_copy():
    rb = pa.record_batch({"t": pa.array([[i] * (i % 3) for i in range(12)], pa.list_(pa.int32()))})
    packs = list(partition_messages([rb], batch_size=3, max_bytes=1 << 20, pack_bytes=1 << 20))
    assert [splits for _, splits in packs] == [[3, 3, 3, 3]]
    values_frame = packs[0][0]["t"].buffers[-1]
    assert np.shares_memory(np.frombuffer(values_frame, np.int32), rb.column(0).values.to_numpy())
    out = batches_of([rb], batch_size=3)
    assert [len(b["t"]) for b in out] == [3, 3, 3, 3]
    assert values(out, "t") == rb.column(0).to_pylist()


def test_batches_of_different_forms_are_not_packed_together():
    rb = pa.record_batch({"t": pa.array([[1, 2], [3, 4], [5], [6, 7, 8]], pa.list_(pa.int64()))})
    packs = list(partition_messages([rb], batch_size=2, max_bytes=1 << 20, pack_bytes=1 << 20))
    assert [splits for _, splits in packs] == [None, None]        # dense [2, 2], then ragged: two messages


def test_length_bucketing_is_deterministic_and_groups_similar_lengths():
    rng = np.random.default_rng(7)
    lengths = rng.lognormal(3, 0.8, 400).astype(int) + 1
    rb = pa.record_batch({"id": pa.array(np.arange(400)),
                          "tokens": pa.array([[1] * n for n in lengths], pa.list_(pa.int32()))})
    plain = batches_of([rb], batch_size=16)
    first = batches_of([rb.slice(0, 150), rb.slice(150)], batch_size=16, bucket_by="tokens", bucket_window=25,
                       seed=(3, 1))
    again = batches_of([rb], batch_size=16, bucket_by="tokens", bucket_window=25, seed=(3, 1))
    assert [b["id"].tolist() for b in first] == [b["id"].tolist() for b in again]     # a retry sends the same
    assert sorted(values(first, "id")) == list(range(400))

    def padding(batches):
        lens = [b["tokens"].lengths() if isinstance(b["tokens"], RaggedColumn) else
                np.full(len(b["tokens"]), b["tokens"].shape[1]) for b in batches]
        return 1 - sum(x.sum() for x in lens) / sum(len(x) * x.max() for x in lens)

    assert padding(first) < 0.3 * padding(plain)


def test_rdd_rows_of_every_kind():
    rows = [{"id": i, "img": bytes([i]) * i, "label": f"l{i}" if i % 3 else None,
             "tokens": list(range(i % 4)) if i != 5 else None, "pos": {"x": float(i), "tag": "t"} if i % 2 else None,
             "emb": np.full(3, i, np.float32)} for i in range(11)]
    out = batches_of(record_batches_from_rows(iter(rows), 4), batch_size=4)
    assert values(out, "id") == list(range(11))
    assert values(out, "img") == [bytes([i]) * i for i in range(11)]
    assert values(out, "label") == [r["label"] for r in rows]
    assert values(out, "tokens") == [r["tokens"] for r in rows]
    assert values(out, "pos.x") == [float(i) if i % 2 else None for i in range(11)]
    assert values(out, "pos.tag") == ["t" if i % 2 else None for i in range(11)]
    assert out[0]["emb"].dtype == np.float32 and out[0]["emb"].shape == (4, 3)
    tuples = batches_of(record_batches_from_rows(iter([(1, "a"), (2, None)]), 4))
    assert values(tuples, "_1") == [1, 2] and values(tuples, "_2") == ["a", None]
    grids = batches_of(record_batches_from_rows(iter([{"g": np.ones((2, 3)) * i} for i in range(3)]), 4))
    assert grids[0]["g"].shape == (3, 2, 3)


def test_rdd_columns_of_only_none_keep_the_type_they_had():
    rows = [{"x": 1.5}, {"x": 2.5}, {"x": None}, {"x": None}]
    out = batches_of(record_batches_from_rows(iter(rows), 2), batch_size=2)
    assert values(out, "x") == [1.5, 2.5, None, None]
    with pytest.raises(UnsupportedColumn, match="column 'x' holds only None"):
        list(record_batches_from_rows(iter([{"x": None}]), 2))


@pytest.mark.parametrize("rows, message", [
    (["text"], "dicts or tuples"),
    ([{"a": 1}, {"b": 2}], "with the keys"),
    ([(1, 2), (3,)], "tuples of 2 values"),
])
def test_bad_rdd_rows_are_named(rows, message):
    with pytest.raises(TypeError, match=message):
        list(record_batches_from_rows(iter(rows), 10))


@pytest.mark.parametrize("array, message", [
    (pa.array([1, 2], pa.decimal128(5, 1)), r"column 'c' is decimal128\(5, 1\).*cast\('double'\).*id \* 1.5"),
    (pa.array([[(1, 2)]], pa.map_(pa.int32(), pa.int32())), "a map .*map_keys"),
    (pa.array([[{"a": 1}]]), "arrays of structs"),
    (pa.array([None, None]), "has no type"),
    (pa.array([[1]], pa.list_(pa.decimal128(3, 0))), "an array of decimal128"),
])
def test_unsupported_columns_are_named_with_what_to_do(array, message):
    with pytest.raises(UnsupportedColumn, match=message):
        list(partition_messages([pa.record_batch({"c": array})], batch_size=2, max_bytes=100, pack_bytes=0))


# ---- random Arrow arrays through encode and decode ------------------------------------------------------------

LEAVES = [
    (pa.int8(), st.integers(-128, 127)),
    (pa.int32(), st.integers(-2**31, 2**31 - 1)),
    (pa.int64(), st.integers(-2**63, 2**63 - 1)),
    (pa.float32(), st.floats(width=32, allow_nan=False)),
    (pa.float64(), st.floats(allow_nan=False)),
    (pa.bool_(), st.booleans()),
    (pa.binary(), st.binary(max_size=12)),
    (pa.string(), st.text(max_size=8)),
    (pa.date32(), st.dates(dt.date(1970, 1, 1), dt.date(2200, 1, 1))),
    (pa.timestamp("us"), st.datetimes(dt.datetime(1970, 1, 1), dt.datetime(2200, 1, 1))),
]


@st.composite
def arrow_types(draw):
    kind, values = draw(st.sampled_from(LEAVES))
    for _ in range(draw(st.integers(0, 2))):
        width = draw(st.one_of(st.none(), st.integers(1, 3)))
        kind = pa.list_(kind, width) if width else pa.list_(kind)
        values = st.lists(st.one_of(st.none(), values), min_size=width or 0, max_size=width or 4)
    return kind, values


@st.composite
def arrow_columns(draw):
    kind, values = draw(arrow_types())
    rows = draw(st.lists(st.one_of(st.none(), values) if draw(st.booleans()) else values, min_size=1, max_size=30))
    array = pa.array(rows, type=kind)
    start = draw(st.integers(0, len(array) - 1))
    return array.slice(start, draw(st.integers(1, len(array) - start)))


def _dense(kind, column):
    return isinstance(column, np.ndarray) and kind not in (pa.binary(), pa.string())


@settings(max_examples=300, deadline=None)
@given(arrow_columns(), st.integers(1, 7), st.sampled_from([0, 64, 1 << 20]), st.booleans())
def test_random_arrow_arrays_survive_encode_and_decode(array, batch_size, pack_bytes, ragged):
    rb = pa.record_batch({"c": array, "id": pa.array(np.arange(len(array)))})
    out = batches_of([rb], batch_size=batch_size, pack_bytes=pack_bytes, ragged=["c"] if ragged else [])
    assert values(out, "id") == list(range(len(array)))
    assert values(out, "c") == array.to_pylist()
    variable = pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type) \
        or array.type in (pa.binary(), pa.string())
    for batch in out:
        column = batch["c"]
        assert isinstance(column, RaggedColumn) == (variable and (ragged or not _dense(array.type, column))), column
        if isinstance(column, RaggedColumn):
            assert column.to_arrow().to_pylist() == column.to_pylist()


def _tokens(batches):
    return [int(b["tokens"].lengths().sum()) if isinstance(b["tokens"], RaggedColumn) else
            b["tokens"].shape[0] * b["tokens"].shape[1] for b in batches]


def test_token_budget_batches_hold_the_budget_and_a_longer_row_travels_alone():
    lengths = [3, 4, 2, 9, 1, 1, 30, 5, 5, 5, 2]
    rb = pa.record_batch({"id": pa.array(np.arange(len(lengths))),
                          "tokens": pa.array([[i] * n for i, n in enumerate(lengths)], pa.list_(pa.int32()))})
    plans = [RecordBatchPlan(rb.slice(0, 5)), RecordBatchPlan(rb.slice(5))]      # a batch spans the two
    rows = [b.rows for b in cut(plans, batch_size=100, max_bytes=1 << 20, tokens_by="tokens", batch_tokens=10)]
    assert rows == [3, 2, 1, 1, 2, 2]      # 9 tokens, 10 (9 + 1, across the two), 1, 30 alone, 10, 7
    out = batches_of([rb], batch_size=100, tokens_by="tokens", batch_tokens=10)
    assert _tokens(out) == [9, 10, 1, 30, 10, 7]
    assert values(out, "id") == list(range(len(lengths)))
    assert all(t <= 10 or len(b["id"]) == 1 for t, b in zip(_tokens(out), out))
    capped = [b.rows for b in cut([RecordBatchPlan(rb)], batch_size=2, max_bytes=1 << 20, tokens_by="tokens",
                                  batch_tokens=1000)]
    assert capped == [2, 2, 2, 2, 2, 1], "batch_size still caps the rows"


def test_token_budgets_with_length_buckets_fill_each_budget_with_similar_lengths():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 64, 500)
    rb = pa.record_batch({"id": pa.array(np.arange(500)),
                          "tokens": pa.array([[1] * int(n) for n in lengths], pa.list_(pa.int32()))})
    out = batches_of([rb], batch_size=10_000, bucket_by="tokens", bucket_window=4, seed=(1,), batch_tokens=256,
                     tokens_by="tokens")
    assert sorted(values(out, "id")) == list(range(500))
    sums = _tokens(out)
    assert max(sums) <= 256 and sum(sums) == int(lengths.sum())
    assert np.median(sums) > 200, "budgets are filled"


def test_token_budget_options_are_checked_once():
    from sparkbus.feeder.options import FeedOptions

    assert FeedOptions("tcp://h:5555", batch_tokens=512, ragged=["ids"]).tokens_by == "ids"
    assert FeedOptions("tcp://h:5555", batch_tokens=512, bucket_by="t", ragged=["ids", "t"]).tokens_by == "t"
    assert FeedOptions("tcp://h:5555", batch_tokens=512, tokens_by="x").cutting()["batch_tokens"] == 512
    with pytest.raises(ValueError, match="name it with tokens_by="):
        FeedOptions("tcp://h:5555", batch_tokens=512, ragged=["a", "b"])
    with pytest.raises(ValueError, match="at least 1"):
        FeedOptions("tcp://h:5555", batch_tokens=0, tokens_by="x")
    with pytest.raises(ValueError, match="pass batch_tokens too"):
        FeedOptions("tcp://h:5555", tokens_by="x")
    with pytest.raises(KeyError, match="batch_tokens counts the lengths of 'nope'"):
        list(cut([RecordBatchPlan(pa.record_batch({"a": pa.array([1])}))], 10, 1 << 20, "nope", 5))
