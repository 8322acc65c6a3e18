"""The training side of a stream: the shuffle buffer (numpy), zero-copy tensors and the DataLoader (torch)."""

import sys

import numpy as np
import pytest

from sparkbus.broker.client import ControlClient
from sparkbus.feeder.task import stream_partition
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind
from sparkbus.worker import BatchStream
from sparkbus.worker.shuffle import ShuffleBuffer, shuffled
from sparkbus.worker.torch_data import to_tensors

from harness import run_child

pytestmark = pytest.mark.timeout(60)

COLUMNS = {"id": "<i8", "x": "<f4", "y": "<i4", "flag": "|b1", "h": "<f2", "u": "<u2"}


def received(first_id: int, rows: int) -> dict[str, np.ndarray]:
    """A batch as a rank gets it: encoded to frames, then read-only numpy views over the received bytes."""
    ids = np.arange(first_id, first_id + rows, dtype=np.int64)
    columns = {"id": ids, "x": (ids[:, None] * 10 + np.arange(3)).astype(np.float32), "y": (ids % 7).astype(np.int32),
               "flag": ids % 2 == 0, "h": (ids % 5).astype(np.float16), "u": (ids % 9).astype(np.uint16)}
    frames = codec.encode_batch("s", 0, 0, first_id, columns)
    header = protocol.unpack_header(frames[0])
    return codec.decode_batch(header, [bytes(f) for f in frames[1:]])


def sizes(batches):
    return [len(b["id"]) for b in batches]


def check_rows(batch):
    """Rows stay whole: every column of a row still derives from its id."""
    ids = batch["id"]
    np.testing.assert_array_equal(batch["x"], (ids[:, None] * 10 + np.arange(3)).astype(np.float32))
    np.testing.assert_array_equal(batch["y"], ids % 7)
    np.testing.assert_array_equal(batch["flag"], ids % 2 == 0)


# ---- the shuffle buffer (numpy only) -----------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 7, 20])
def test_shuffle_keeps_every_row_the_batch_count_and_the_sizes(k):
    inputs, first = [], 0
    for rows in [50, 50, 50, 13, 50, 7, 50, 50, 1, 22]:      # uneven sizes, as the last batch of a partition
        inputs.append(received(first, rows))
        first += rows
    out = list(shuffled(iter(inputs), k, seed=5))
    assert sizes(out) == sizes(inputs)
    np.testing.assert_array_equal(np.sort(np.concatenate([b["id"] for b in out])), np.arange(first))
    for batch in out:
        check_rows(batch)
        assert {name: a.dtype.str for name, a in batch.items()} == COLUMNS
        assert all(a.flags.writeable and a.flags.c_contiguous for a in batch.values())


def test_shuffle_mixes_rows_across_batches_but_not_beyond_the_window():
    inputs = [received(100 * i, 100) for i in range(6)]
    out = list(shuffled(inputs, 3, seed=1))
    # the first batch out draws from the first three in: rows of all three, and none from later batches
    sources = set((out[0]["id"] // 100).tolist())
    assert sources == {0, 1, 2}
    assert not np.array_equal(out[0]["id"], np.sort(out[0]["id"]))


def test_shuffle_is_reproducible_with_a_seed_and_differs_between_seeds():
    def run(seed):
        return np.concatenate([b["id"] for b in shuffled([received(40 * i, 40) for i in range(8)], 4, seed)])

    np.testing.assert_array_equal(run((7, 0, 1)), run((7, 0, 1)))
    assert not np.array_equal(run((7, 0, 1)), run((7, 1, 1)))


def test_shuffle_buffer_answers_once_it_holds_k_batches_and_flushes_the_rest():
    buffer = ShuffleBuffer(3, seed=0)
    assert buffer.push(received(0, 4)) is None and buffer.push(received(4, 5)) is None
    first = buffer.push(received(9, 6))
    assert len(first["id"]) == 4 and len(buffer) == 2
    rest = list(buffer.flush())
    assert sizes(rest) == [5, 6] and len(buffer) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([first["id"], *[b["id"] for b in rest]])),
                                  np.arange(15))


def test_shuffle_refuses_batches_of_another_layout():
    buffer = ShuffleBuffer(2)
    buffer.push({"a": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="does not match"):
        buffer.push({"a": np.zeros(3, np.float64)})
    with pytest.raises(ValueError, match="does not match"):
        buffer.push({"b": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="different lengths"):
        buffer.push({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="at least 1"):
        ShuffleBuffer(0)


def test_importing_worker_and_the_adapter_does_not_import_torch():
    code = ("import sys, worker, worker.torch_data; from worker.shuffle import shuffled, ShuffleBuffer; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    run_child([sys.executable, "-c", code], timeout=60, check=True)


# ---- torch -----------------------------------------------------------------------------------------------

def test_tensors_share_memory_with_the_received_frames():
    torch = pytest.importorskip("torch")
    batch = received(0, 16)
    assert not batch["x"].flags.writeable
    tensors = to_tensors(batch)
    expected = {"id": torch.int64, "x": torch.float32, "y": torch.int32, "flag": torch.bool,
                "h": torch.float16, "u": torch.uint16}
    assert {name: t.dtype for name, t in tensors.items()} == expected
    assert tensors["x"].shape == (16, 3) and tensors["id"].shape == (16,)
    for name, tensor in tensors.items():
        assert tensor.data_ptr() == batch[name].ctypes.data, f"{name} was copied"
    assert torch.equal(tensors["y"], torch.arange(16, dtype=torch.int32) % 7)


def test_writable_tensors_are_copies():
    pytest.importorskip("torch")
    batch = received(0, 8)
    tensors = to_tensors(batch, writable=True)
    assert all(t.data_ptr() != batch[name].ctypes.data for name, t in tensors.items())
    tensors["x"].add_(1)                      # allowed, and the received frame is untouched
    np.testing.assert_array_equal(batch["x"][:, 0], np.arange(8) * 10)
    mixed = next(shuffled([received(0, 8)], 1, seed=0))
    assert to_tensors(mixed, writable=True)["x"].data_ptr() == mixed["x"].ctypes.data   # already writable


def test_no_read_only_warning_escapes(recwarn):
    pytest.importorskip("torch")
    to_tensors(received(0, 4))
    assert not [w for w in recwarn if "not writable" in str(w.message)]


class FakeStream:
    """Stands in for a BatchStream: ``epoch()`` yields received-like batches of the next epoch."""

    rank = 0

    def __init__(self, epochs):
        self.epochs = list(epochs)
        self.started = 0

    def epoch(self):
        self.started += 1
        yield from self.epochs.pop(0)

    def track_buffer(self, buffer):
        """A shuffle buffer fed from this stream (BatchStream.state_dict refuses while it holds rows)."""


def test_each_iteration_of_the_dataset_is_one_epoch():
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from sparkbus.worker.torch_data import StreamDataset

    stream = FakeStream([[received(0, 10), received(10, 10)], [received(20, 5)]])
    seen = []
    loader = DataLoader(StreamDataset(stream, transform=lambda b: b["id"]), batch_size=None, num_workers=0)
    for _ in range(2):
        seen.append([t.tolist() for t in loader])
    assert seen == [[list(range(10)), list(range(10, 20))], [list(range(20, 25))]]
    assert stream.started == 2


def test_dataset_shuffle_is_seeded_per_epoch_and_keeps_counts():
    pytest.importorskip("torch")
    from sparkbus.worker.torch_data import StreamDataset

    def epoch_ids(epoch_number):
        stream = FakeStream([[received(20 * i, 20) for i in range(5)]])
        ds = StreamDataset(stream, shuffle_buffer=3, shuffle_seed=11, epoch=epoch_number)
        return [b["id"].tolist() for b in ds]

    first = epoch_ids(4)
    assert [len(b) for b in first] == [20] * 5
    assert sorted(sum(first, [])) == list(range(100))
    assert epoch_ids(4) == first and epoch_ids(5) != first


def test_dataset_refuses_to_run_in_a_loader_worker(monkeypatch):
    torch = pytest.importorskip("torch")
    from sparkbus.worker.torch_data import StreamDataset

    # What a DataLoader worker process sees (a real one would fork this process, MPI and all).
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(StreamDataset(FakeStream([[received(0, 4)]]))))


def test_a_real_stream_through_a_dataloader_stays_zero_copy(start_broker_thread):
    """A broker on loopback, one partition pushed by the feeder's task code, one rank reading through torch."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from sparkbus.worker.torch_data import StreamDataset

    config = start_broker_thread(tcp=True).config
    feed, ranks, control = config.feed, config.ranks, config.control
    with ControlClient(control, timeout=10) as client:
        client.request(Kind.EPOCH_OPEN, stream="t", epoch=0, partitions=1, delivery="stream")
        ids = np.arange(30, dtype=np.int64)
        batches = [{"id": ids[i:i + 8], "x": np.repeat(ids[i:i + 8, None], 4, 1).astype(np.float32)}
                   for i in range(0, 30, 8)]
        stream_partition(batches, feed, control, "t", 0, partition=0, attempt=0, timeout=10)
        client.request(Kind.EPOCH_CLOSE, stream="t", epoch=0, partitions=1)
    with BatchStream(ranks, stream="t", timeout=10) as stream:
        got = []
        for batch in DataLoader(StreamDataset(stream), batch_size=None, num_workers=0):
            assert batch["x"].dtype == torch.float32 and batch["x"].shape[1] == 4
            assert not batch["x"].numpy().flags.owndata     # a view of the received frame
            got.append(batch["id"].clone())
        assert stream.stats.epochs[-1].batches == 4
    assert torch.cat(got).tolist() == list(range(30))


# ---- variable-length columns: shuffled, passed through, padded ------------------------------------------------

def received_text(first_id: int, rows: int) -> dict:
    """A batch of text as a rank gets it: token arrays of varying length (a null among them), strings, a
    nullable score; each value derives from the id."""
    import pyarrow as pa

    from sparkbus.feeder.columns import wire_columns

    ids = list(range(first_id, first_id + rows))
    batch = pa.record_batch({
        "id": pa.array(ids, pa.int64()),
        "tokens": pa.array([None if i % 11 == 3 else [i] * (i % 4 + 1) for i in ids], pa.list_(pa.int32())),
        "text": pa.array([f"t{i}" for i in ids]),
        "score": pa.array([None if i % 5 == 0 else i / 2 for i in ids])})
    frames = codec.encode_batch("s", 0, 0, first_id, wire_columns(batch))
    return codec.decode_batch(protocol.unpack_header(frames[0]), [bytes(memoryview(f)) for f in frames[1:]])


def test_shuffle_mixes_ragged_and_masked_columns_keeping_rows_whole():
    from sparkbus.worker import RaggedColumn

    inputs = [received_text(20 * i, 20) for i in range(5)]
    out = list(shuffled(inputs, 3, seed=2))
    assert sizes(out) == [20] * 5
    ids = np.concatenate([b["id"] for b in out])
    np.testing.assert_array_equal(np.sort(ids), np.arange(100))
    assert not np.array_equal(ids, np.arange(100))
    for batch in out:
        assert isinstance(batch["tokens"], RaggedColumn) and isinstance(batch["score"], np.ma.MaskedArray)
        for i, tokens, text, score in zip(batch["id"].tolist(), batch["tokens"].to_pylist(),
                                          batch["text"].to_pylist(), batch["score"].tolist()):
            assert tokens == (None if i % 11 == 3 else [i] * (i % 4 + 1))
            assert text == f"t{i}" and score == (None if i % 5 == 0 else i / 2)


def test_shuffle_says_to_declare_a_column_that_changes_form():
    buffer = ShuffleBuffer(2)
    buffer.push(received_text(0, 4))
    dense = dict(received_text(4, 4), tokens=np.zeros((4, 2), np.int32))
    with pytest.raises(ValueError, match="declare it feed"):
        buffer.push(dense)


def test_ragged_columns_pass_through_to_tensors_and_pad_collate_pads_them():
    torch = pytest.importorskip("torch")
    from sparkbus.worker import RaggedColumn
    from sparkbus.worker.torch_data import pad_collate

    batch = received_text(0, 6)
    tensors = to_tensors(batch)
    assert isinstance(tensors["tokens"], RaggedColumn) and isinstance(tensors["score"], np.ma.MaskedArray)
    assert tensors["id"].dtype == torch.int64
    padded = pad_collate({"tokens": -1}, max_length=3)(tensors)
    assert padded["tokens"].tolist() == [[0, -1, -1], [1, 1, -1], [2, 2, 2], [-1, -1, -1], [4, -1, -1],
                                         [5, 5, -1]]
    assert padded["tokens_lengths"].tolist() == [1, 2, 3, 0, 1, 2]
    assert padded["tokens_mask"].tolist()[1] == [True, True, False] and padded["tokens_mask"].dtype == torch.bool
    dense = pad_collate({"x": 0})(to_tensors(received(0, 4)))          # the other form: numpy [n, k]
    assert dense["x"].shape == (4, 3) and dense["x_lengths"].tolist() == [3, 3, 3, 3]
