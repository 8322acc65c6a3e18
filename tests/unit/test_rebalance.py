"""Rebalancing plans for equal step counts, and the MPI transfer format (no pickle)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.worker.rebalance import pack_batch, plan_transfers, unpack_batch


@given(st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_plan_evens_counts_and_drops_fewer_than_size(counts):
    transfers, target = plan_transfers(counts)
    held = list(counts)
    for src, dst, n in transfers:
        assert n > 0 and src != dst
        held[src] -= n
        held[dst] += n
    assert all(h >= target for h in held)
    assert target == sum(counts) // len(counts)
    assert sum(h - target for h in held) == sum(counts) % len(counts) < len(counts)


def test_plan_example():
    assert plan_transfers([5, 1]) == ([(0, 1, 2)], 3)
    assert plan_transfers([3, 3]) == ([], 3)


def test_batches_cross_ranks_in_wire_form():
    header = protocol.unpack_header(codec.encode_batch("s", 1, 2, 3, {"a": np.zeros(1)})[0])
    columns = {"id": np.arange(5), "x": np.arange(10, dtype=np.float32).reshape(5, 2)}
    buf = pack_batch(header, columns)
    assert b"\x80\x04" not in buf[:2]          # not a pickle stream
    h, out = unpack_batch(buf)
    assert protocol.batch_id(h) == (1, 2, 3)
    np.testing.assert_array_equal(out["x"], columns["x"])
    with pytest.raises(ProtocolError):
        unpack_batch(buf[:-1])
