"""Arrow and Python rows to wire-ready numpy batches."""

import numpy as np
import pyarrow as pa
import pytest

from feeder.columns import arrow_column, arrow_columns, chunk_rows, rebatch, rows_to_columns


def test_primitive_columns_are_zero_copy_views():
    arr = pa.array(np.arange(10, dtype=np.float32))
    out = arrow_column("x", arr)
    assert out.dtype == np.float32
    assert np.shares_memory(out, np.frombuffer(arr.buffers()[1], dtype=np.float32))


def test_sliced_list_arrays_respect_the_slice():
    arr = pa.array([[i, i + 0.5] for i in range(10)], type=pa.list_(pa.float32())).slice(3, 4)
    out = arrow_column("x", arr)
    assert out.shape == (4, 2) and out.dtype == np.float32
    np.testing.assert_array_equal(out[:, 0], [3, 4, 5, 6])


def test_nested_and_fixed_size_lists_become_multidimensional():
    nested = pa.array([[[1, 2], [3, 4], [5, 6]]] * 5, type=pa.list_(pa.list_(pa.int16())))
    assert arrow_column("n", nested).shape == (5, 3, 2)
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.int64)), 3)
    np.testing.assert_array_equal(arrow_column("f", fixed), np.arange(12).reshape(4, 3))


def test_booleans_and_integers_keep_their_dtypes():
    batch = pa.record_batch({"b": pa.array([True, False]), "i": pa.array([1, 2], pa.int8())})
    out = arrow_columns(batch)
    assert out["b"].dtype == np.bool_ and out["i"].dtype == np.int8
    np.testing.assert_array_equal(out["b"], [True, False])


@pytest.mark.parametrize("arr, error, message", [
    (pa.array([1.0, None]), ValueError, "column 'c' has 1 null"),
    (pa.array([[1, 2], [3]]), ValueError, "unequal lengths"),
    (pa.array(["a"]), TypeError, "column 'c' has type string"),
    (pa.array([{"a": 1}]), TypeError, "column 'c' has type struct"),
])
def test_unsupported_columns_are_named(arr, error, message):
    with pytest.raises(error, match=message):
        arrow_column("c", arr)


def chunks(*sizes):
    start = 0
    for n in sizes:
        yield {"id": np.arange(start, start + n), "x": np.ones((n, 4), np.float32)}
        start += n


def test_rebatch_cuts_exact_sizes_across_chunk_boundaries():
    out = list(rebatch(chunks(5, 0, 7, 3, 10), batch_size=4, max_bytes=1 << 20))
    assert [len(b["id"]) for b in out] == [4, 4, 4, 4, 4, 4, 1]
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in out]), np.arange(25))


def test_rebatch_caps_batches_in_bytes():
    # a row is 8 + 16 = 24 bytes; 100 bytes hold 4 rows
    out = list(rebatch(chunks(10), batch_size=1000, max_bytes=100))
    assert [len(b["id"]) for b in out] == [4, 4, 2]


def test_rows_to_columns_from_dicts_and_tuples():
    dicts = rows_to_columns([{"id": 1, "x": np.zeros(3, np.float32)}, {"id": 2, "x": np.ones(3, np.float32)}])
    assert dicts["id"].dtype == np.int64 and dicts["x"].shape == (2, 3) and dicts["x"].dtype == np.float32
    tuples = rows_to_columns([(1, 2.5), (3, 4.5)])
    assert list(tuples) == ["_1", "_2"]
    np.testing.assert_array_equal(tuples["_2"], [2.5, 4.5])
    with pytest.raises(TypeError, match="dicts or tuples"):
        rows_to_columns(["text"])
    with pytest.raises(TypeError, match="with the keys"):
        rows_to_columns([{"a": 1}, {"b": 2}])


def test_chunk_rows_groups_rows():
    out = list(chunk_rows(({"id": i} for i in range(7)), 3))
    assert [len(c["id"]) for c in out] == [3, 3, 1]
