"""Equal steps granted by the broker (``broker.grants``): STEPS as batches go out, RELEASE/RETURN at the epoch's end,
a pack's tail cut into pieces, and groups that change. The ledger is driven directly, as in test_ledger.py; the
last test drives a real rank (``worker.grants``) against a stand-in broker.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkbus.broker.events import BatchesAcked
from sparkbus.broker.ledger import Ledger
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import STREAM, FakeBroker, Wire, end, feed, hello, join, joined, push

pytestmark = pytest.mark.timeout(30)


def granted(rank, size, **kw):
    return hello(rank, size, even=True, grants=True, **kw)


def acked(ledger, identity, *ids):
    assert ledger.acknowledge(ledger.rank(identity), [n for i in ids for n in i]) == 0


def steps(wire, identity):
    return [h["steps"] for h in wire.of_kind(identity, Kind.STEPS)]


def returned(ledger, identity, epoch, *pieces, kept=0):
    """The rank on ``identity`` answers RELEASE: ``pieces`` are ``(id, first)``."""
    ids = [n for batch_id, first in pieces for n in (*batch_id, first)]
    return ledger.give_back(ledger.rank(identity), {"stream": STREAM, "epoch": epoch, "ids": ids, "kept": kept})


def test_the_grant_is_the_smallest_count_and_goes_out_when_it_grows():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 6, close=False)
    join(ledger, b"a", granted(0, 2), prefetch=2)
    join(ledger, b"b", granted(1, 2), prefetch=2)
    wire.dispatch()
    assert len(wire.to(b"a")) == len(wire.to(b"b")) == 2
    assert steps(wire, b"a") == steps(wire, b"b") == [2]
    acked(ledger, b"a", wire.to(b"a")[0])
    wire.dispatch()
    assert len(wire.to(b"a")) == 3 and steps(wire, b"a") == [2]       # b still has 2: nothing more to grant
    acked(ledger, b"b", wire.to(b"b")[0])
    wire.dispatch()
    assert steps(wire, b"a") == steps(wire, b"b") == [2, 3]


def test_a_rank_number_nobody_holds_counts_zero():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 4, close=False)
    join(ledger, b"a", granted(0, 2), prefetch=2)
    wire.dispatch()
    assert wire.to(b"a") == [] and steps(wire, b"a") == []         # the group is not complete: nothing goes out


def test_the_left_over_is_dropped_by_a_rank_with_more_and_the_end_says_the_share():
    ledger = Ledger()
    wire = Wire(ledger)
    join(ledger, b"a", granted(0, 2), prefetch=3)
    join(ledger, b"b", granted(1, 2), prefetch=2)
    feed(ledger, 0, 1, 5)
    wire.dispatch()
    holder = b"a" if len(wire.to(b"a")) == 3 else b"b"
    assert sorted([len(wire.to(b"a")), len(wire.to(b"b"))]) == [2, 3]
    [release] = wire.of_kind(holder, Kind.RELEASE)
    assert (release["keep"], release["drop"]) == (2, 1)
    ends = [h for _, h in wire.headers if h["kind"] == Kind.EPOCH_END]
    assert [h["steps"] for h in ends] == [2, 2]              # nothing to return: the epoch ends at once
    assert ledger.streams[STREAM].epochs[0].stats()["dropped"] == 1


def test_batches_a_rank_returns_go_to_the_rank_short_of_the_share():
    ledger = Ledger()
    wire = Wire(ledger)
    join(ledger, b"a", granted(0, 2), prefetch=6)
    feed(ledger, 0, 1, 7)
    join(ledger, b"b", granted(1, 2), prefetch=1)
    wire.dispatch()
    a, b = wire.to(b"a"), wire.to(b"b")
    assert len(a) + len(b) == 7 and len(b) == 1
    [release] = wire.of_kind(b"a", Kind.RELEASE)
    assert (release["keep"], release["drop"]) == (3, 1)
    assert wire.ends == []
    returned(ledger, b"a", 0, (a[-1], 0), (a[-2], 0), kept=3)
    acked(ledger, b"b", b[0])                                 # b used its batch: room for one more
    wire.dispatch()
    acked(ledger, b"b", wire.to(b"b")[1])
    wire.dispatch()
    assert wire.to(b"b")[1:] == [a[-2], a[-1]]                # what a gave back, in order
    assert [h["steps"] for _, h in wire.headers if h["kind"] == Kind.EPOCH_END] == [3, 3]
    assert ledger.streams[STREAM].epochs[0].stats()["moved"] == 2


def pack(ledger, epoch, part, seq, splits):
    return push(ledger, epoch, part, seq, splits=splits)


def test_a_packs_unused_tail_is_cut_into_pieces_for_the_ranks_short_of_the_share():
    ledger = Ledger()
    wire = Wire(ledger)
    events = []
    ledger.observe(events.append)
    join(ledger, b"a", granted(0, 3), prefetch=4)
    join(ledger, b"b", granted(1, 3), prefetch=4)
    join(ledger, b"c", granted(2, 3), prefetch=4)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    pack(ledger, 0, 0, 0, [1] * 9)                            # one message of 9 batches, one row each
    end(ledger, 0, 0, 0, 1)
    ledger.close_epoch(STREAM, 0, 1)
    wire.dispatch()
    [(holder, _)] = [(who, i) for who, i in wire.sent]
    [release] = wire.of_kind(holder, Kind.RELEASE)
    assert (release["keep"], release["drop"]) == (3, 0)
    returned(ledger, holder, 0, ((0, 0, 0), 3), kept=3)
    wire.dispatch()
    pieces = {who: h["take"] for who, h in wire.headers if h["kind"] == Kind.BATCH and "take" in h}
    assert sorted(pieces.values()) == [[3, 6], [6, 9]] and holder not in pieces
    assert [h["steps"] for _, h in wire.headers if h["kind"] == Kind.EPOCH_END] == [3, 3, 3]
    for who in (b"a", b"b", b"c"):
        acked(ledger, who, (0, 0, 0))
        assert [e for e in events if isinstance(e, BatchesAcked)] == ([] if who != b"c" else
                                                                      [BatchesAcked(STREAM, 0, [[0, 0, 0]])])
    assert 0 not in ledger.streams[STREAM].epochs                # every piece consumed: the epoch retired
    assert ledger.streams[STREAM].finished.figures[0]["acked"] == 9


def test_a_group_of_another_size_replaces_the_old_at_an_epoch_boundary_and_is_refused_mid_epoch():
    ledger = Ledger()
    wire = Wire(ledger)
    join(ledger, b"a", granted(0, 2), prefetch=2)
    join(ledger, b"b", granted(1, 2), prefetch=2)
    feed(ledger, 0, 1, 4, close=False)
    wire.dispatch()
    join(ledger, b"c", granted(0, 1, session="new"), prefetch=2)     # nothing consumed yet: a boundary
    assert set(ledger.streams[STREAM].ranks) == {b"c"}
    assert ledger.streams[STREAM].epochs[0].queue                    # the old group's batches went back
    wire.dispatch()
    acked(ledger, b"c", wire.to(b"c")[0])
    with pytest.raises(ProtocolError, match="only at an epoch boundary"):
        ledger.join_rank(b"d", granted(0, 3, session="third"))


def test_a_group_cannot_mix_granted_and_agreed_steps():
    ledger = Ledger()
    join(ledger, b"a", granted(0, 2))
    with pytest.raises(ProtocolError, match="granted"):
        ledger.join_rank(b"b", hello(1, 2, even=True))


def test_a_rank_that_comes_back_after_a_restart_counts_what_it_consumed_before():
    """After a journalled broker's restart the consumed batches are gone from its queue; a rank that names them as
    consumed still has them in its count, so the share and the grants are what they were."""
    ledger = Ledger()
    feed(ledger, 0, 1, 4)
    ep = ledger.streams[STREAM].epochs[0]
    ep.acked_before[(0, 0, 1)] = 1                      # as replay leaves a batch acknowledged before the restart
    ep.queue = type(ep.queue)(b for b in ep.queue if b.id != (0, 0, 1))
    ledger.join_rank(b"a", granted(0, 2, session="s0", resume=True), held=[(0, 0, 0)], consumed=[(0, 0, 1)])
    assert ledger.rank(b"a").given[0] == 2
    assert ep.given_twice == 0


def test_a_rank_uses_batches_within_its_grant_and_gives_back_a_packs_tail(context):
    """The rank's side: a pack of 4 arrives, the grant is 1; RELEASE(keep=1, drop=1) makes it drop the pack's
    second batch and return the rest as (id, 2), before acknowledging the pack; it takes exactly 1 step."""
    broker = FakeBroker(context, "inproc://granted")
    dropped = []
    stream = joined(broker, "inproc://granted", context, rank=0, size=2, on_drop=lambda b: dropped.append(b))
    columns = {"id": np.arange(4, dtype=np.int64)}
    broker.send(codec.encode_batch("s", 0, 0, 0, columns, splits=[1, 1, 1, 1]))
    broker.send([protocol.pack_header(Kind.STEPS, stream="s", epoch=0, steps=1)])
    broker.send([protocol.pack_header(Kind.RELEASE, stream="s", epoch=0, keep=1, drop=1)])
    broker.send([protocol.pack_header(Kind.EPOCH_END, stream="s", epoch=0, batches=1, steps=1)])
    seen = [batch["id"].tolist() for batch in stream.epoch()]
    assert seen == [[0]]
    assert [b["id"].tolist() for b in dropped] == [[1]]
    back = broker.next(Kind.RETURN)
    assert (back["ids"], back["kept"]) == ([0, 0, 0, 2], 1)
    assert broker.next(Kind.ACK)["ids"] == [0, 0, 0]
    assert (stream.stats.batches, stream.stats.dropped_batches) == (1, 1)
    stream.close()


def test_a_rank_that_rejoins_counts_what_it_says_it_had_and_its_acknowledged_batches_are_not_given_twice():
    """A cut link: the old connection is still known, the rank comes back on a new one naming what it consumed
    (acknowledged before the cut) and what it holds; its count is its own (``got``), nothing counts as given twice,
    and the grants go on from there (no rank waits for a count the broker lost)."""
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 10, close=False)
    join(ledger, b"a", granted(0, 2, session="sa"), prefetch=2)
    join(ledger, b"b", granted(1, 2, session="sb"), prefetch=2)
    wire.dispatch()
    first = wire.to(b"b")
    acked(ledger, b"b", first[0])
    wire.dispatch()
    had = wire.to(b"b")                               # three batches: one consumed, two held
    assert len(had) == 3
    ledger.join_rank(b"b2", granted(1, 2, session="sb", resume=True, got=3), held=had[1:], consumed=had[:1])
    ep = ledger.streams[STREAM].epochs[0]
    assert ep.given_twice == 0
    assert ledger.rank(b"b2").given[0] == 3 and sorted(ledger.rank(b"b2").inflight) == sorted(had[1:])


def test_a_release_that_cannot_go_out_now_goes_on_a_later_pass_and_the_others_are_not_told_twice():
    ledger = Ledger()
    wire = Wire(ledger)
    join(ledger, b"a", granted(0, 3), prefetch=4)
    join(ledger, b"b", granted(1, 3), prefetch=4)
    join(ledger, b"c", granted(2, 3), prefetch=1)
    feed(ledger, 0, 1, 9, close=False)
    wire.dispatch()
    assert [len(wire.to(r)) for r in (b"a", b"b", b"c")] == [4, 4, 1]
    wire.refuse.add(b"b")                              # b's queue is full when the epoch is evened out
    ledger.close_epoch(STREAM, 0, 1)
    wire.dispatch()
    assert len(wire.of_kind(b"a", Kind.RELEASE)) == 1 and not wire.of_kind(b"b", Kind.RELEASE)
    wire.refuse.clear()
    wire.dispatch()
    assert [(h["keep"], h["drop"]) for r in (b"a", b"b") for h in wire.of_kind(r, Kind.RELEASE)] == [(3, 0), (3, 0)]
    returned(ledger, b"a", 0, (wire.to(b"a")[-1], 0), kept=3)
    returned(ledger, b"b", 0, (wire.to(b"b")[-1], 0), kept=3)
    for _ in range(2):
        acked(ledger, b"c", wire.to(b"c")[-1])         # c uses what it has: room for the next
        wire.dispatch()
    assert [h["steps"] for _, h in wire.headers if h["kind"] == Kind.EPOCH_END] == [3, 3, 3]
    assert len(wire.of_kind(b"a", Kind.RELEASE)) == 1
