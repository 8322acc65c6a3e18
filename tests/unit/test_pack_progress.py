"""Progress in packs (issue 18, the regression first): a rank says how far it got in a pack every batch window
(``ACK`` ``upto``), the broker notes it, and a rank that dies has only the rest of the pack redelivered."""

from __future__ import annotations

import numpy as np
import pytest

from sparkbus.broker.events import BatchesAcked
from sparkbus.broker.ledger import Ledger
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind

from harness import STREAM, FakeBroker, Wire, end, hello, join, joined, push

pytestmark = pytest.mark.timeout(30)


def one_pack(ledger, batches=8):
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, splits=[1] * batches)
    end(ledger, 0, 0, 0, 1)
    ledger.close_epoch(STREAM, 0, 1)


def test_progress_cuts_the_used_batches_off_and_a_lost_rank_leaves_only_the_rest():
    ledger = Ledger()
    wire = Wire(ledger)
    events = []
    ledger.observe(events.append)
    join(ledger, b"a", hello(0, 1), prefetch=2)
    one_pack(ledger)
    wire.dispatch()
    assert ledger.acknowledge(ledger.rank(b"a"), [], upto=[0, 0, 0, 3]) == 0
    ep = ledger.streams[STREAM].epochs[0]
    assert ledger.rank(b"a").inflight[(0, 0, 0)].used == 3     # noted only: cut if the pack goes elsewhere
    ledger.rank_gone(b"a", "disconnected", keep=False)
    assert ep.acked == 3 and ep.queue[0].first == 3
    assert not [e for e in events if isinstance(e, BatchesAcked)]      # the pack is not consumed yet
    join(ledger, b"b", hello(0, 1), prefetch=2)
    wire.dispatch()
    [header] = [h for who, h in wire.headers if who == b"b" and h["kind"] == Kind.BATCH]
    assert header["take"] == [3, 8] and header["splits"] == [1] * 8
    assert ledger.acknowledge(ledger.rank(b"b"), [0, 0, 0]) == 0
    assert [e for e in events if isinstance(e, BatchesAcked)] == [BatchesAcked(STREAM, 0, [[0, 0, 0]])]
    wire.dispatch()
    assert ledger.streams[STREAM].stats()["epochs"]["0"]["acked"] == 8


def test_progress_to_the_packs_end_consumes_it_and_stale_progress_changes_nothing():
    ledger = Ledger()
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 1), prefetch=2)
    one_pack(ledger, 4)
    wire.dispatch()
    rank = ledger.rank(b"a")
    assert ledger.acknowledge(rank, [], upto=[0, 0, 0, 2]) == 0
    assert ledger.acknowledge(rank, [], upto=[0, 0, 0, 1]) == 0        # behind the cut: ignored
    assert ledger.acknowledge(rank, [], upto=[0, 0, 0, 4]) == 0
    wire.dispatch()
    assert not rank.inflight and ledger.streams[STREAM].stats()["epochs"]["0"]["acked"] == 4
    assert ledger.acknowledge(rank, [], upto=[0, 0, 9, 1]) == 1         # not in flight: counted unknown


def test_a_rank_tells_its_progress_every_batch_window(context):
    broker = FakeBroker(context, "inproc://progress")
    stream = joined(broker, "inproc://progress", context, prefetch=3)
    broker.send(codec.encode_batch("s", 0, 0, 0, {"id": np.arange(8, dtype=np.int64)}, splits=[1] * 8))
    broker.send([protocol.pack_header(Kind.EPOCH_END, stream="s", epoch=0, batches=1)])
    seen = [batch["id"][0] for batch in stream.epoch()]
    assert seen == list(range(8))
    acks = [broker.next(Kind.ACK) for _ in range(3)]
    assert [(a["ids"], a.get("upto")) for a in acks] == [([], [0, 0, 0, 3]), ([], [0, 0, 0, 6]), ([0, 0, 0], None)]
    stream.close()
