"""An epoch opened with an upper bound on its partitions (a Spark Connect driver learns the count from its job's
results): EPOCH_CLOSE states the count, and the broker checks it against what arrived."""

from __future__ import annotations

import pytest

from sparkbus.broker.ledger import MAX_PARTITIONS, Ledger
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import STREAM, Wire, end, hello, push


def commit(ledger, epoch, part, batches):
    """Stream ``batches`` batches of ``part`` with attempt 0 and commit them."""
    for seq in range(batches):
        push(ledger, epoch, part, seq)
    assert [r.kind for r in end(ledger, epoch, part, 0, batches)] == [Kind.PARTITION_COMMITTED]


def test_the_close_states_the_count_of_an_epoch_opened_with_the_bound_and_the_ranks_get_every_batch():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.join_rank(b"r0", hello())
    ledger.set_window(ledger.rank(b"r0"), 8, 0)
    ledger.open_epoch(STREAM, 0, MAX_PARTITIONS, "stream")
    ledger.open_epoch(STREAM, 0, MAX_PARTITIONS, "stream")       # the same terms again: nothing changes
    commit(ledger, 0, 0, 2)
    commit(ledger, 0, 1, 0)                                      # an empty partition commits too
    commit(ledger, 0, 2, 1)
    assert ledger.streams[STREAM].epochs[0].stats()["partitions"] == MAX_PARTITIONS
    assert ledger.close_epoch(STREAM, 0, 3) == []
    assert ledger.streams[STREAM].epochs[0].stats()["partitions"] == 3
    wire.dispatch()
    assert sorted(wire.to(b"r0")) == [(0, 0, 0), (0, 0, 1), (0, 2, 0)]


def test_a_close_below_the_bound_is_refused_while_a_partition_past_the_count_sent_anything():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, MAX_PARTITIONS, "stream")
    commit(ledger, 0, 0, 1)
    commit(ledger, 0, 1, 1)
    push(ledger, 0, 5, 0)                                          # a batch of partition 5, never committed
    with pytest.raises(ProtocolError, match=r"2 of 10000000 partitions committed, and the driver closes it with "
                                            r"2: partitions \[5\] are past that"):
        ledger.close_epoch(STREAM, 0, 2)
    epoch = ledger.streams[STREAM].epochs[0]
    assert not epoch.closed and epoch.partitions == MAX_PARTITIONS
    with pytest.raises(ProtocolError, match=r"2 of 6 partitions committed \(missing \[2, 3, 4, 5\]\)"):
        ledger.close_epoch(STREAM, 0, 6)
    assert not epoch.closed


def test_a_close_above_the_opened_count_is_refused():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 2, "stream")
    commit(ledger, 0, 0, 1)
    commit(ledger, 0, 1, 1)
    with pytest.raises(ProtocolError, match="2 of 2 partitions committed, and the driver closes it with 3"):
        ledger.close_epoch(STREAM, 0, 3)
    assert ledger.close_epoch(STREAM, 0, 2) == []


def test_several_brokers_each_close_their_share_of_a_bounded_epoch():
    # partitions 0 and 2 streamed here, 1 through another broker; partition 1's claim is recorded here (its home)
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, MAX_PARTITIONS, "atomic")
    assert ledger.claim_partition({"stream": STREAM, "epoch": 0, "part": 1, "broker": 1}) == 1
    commit(ledger, 0, 0, 1)
    commit(ledger, 0, 2, 1)
    with pytest.raises(ProtocolError, match=r"partitions \[1, 2\] are past that"):
        ledger.close_epoch(STREAM, 0, 1, expected=1)
    assert ledger.close_epoch(STREAM, 0, 3, expected=2) == []
    assert ledger.streams[STREAM].epochs[0].partitions == 3


def test_an_empty_job_closes_a_bounded_epoch_with_no_partitions():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.join_rank(b"r0", hello())
    ledger.open_epoch(STREAM, 0, MAX_PARTITIONS, "stream")
    assert ledger.close_epoch(STREAM, 0, 0) == []
    wire.dispatch()
    assert wire.ends == [(b"r0", 0)]
