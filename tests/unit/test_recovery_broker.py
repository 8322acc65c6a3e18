"""The broker's side of recovery from lineage and exact resume (docs/design/RECOVERY.md, "The broker").

Most tests drive the ledger directly, as the daemon does (validated headers, the harness's ``Wire`` for the sends);
the last ones go through a broker thread for what only the daemon does (frames, versions, HELLO.incarnation,
EPOCH_QUERY's answer).
"""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from sparkbus.broker.events import BatchesAcked
from sparkbus.broker.ledger import Ledger, Rejected
from sparkbus.broker.partitions import MAX_PARTITIONS
from sparkbus.broker.recovery import MAX_RECLAIM_EPOCHS
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import ErrorCode, Kind

from harness import STREAM, Wire, batch_frames, end, hello, join, push, recv_header, send

pytestmark = pytest.mark.timeout(30)


def checksum(epoch, part, seq, **kw):
    return protocol.unpack_header(batch_frames(epoch, part, seq, **kw)[0])["checksum"]


def recover(ledger, epoch=0, partitions=2, carries=(0, 1), recovered=(1,), lost=("x",), reset=False,
            delivery="stream"):
    ledger.recover_epoch({"req": 1, "stream": STREAM, "epoch": epoch, "partitions": partitions,
                          "delivery": delivery, "carries": protocol.pack_ranges(carries),
                          "recovered": protocol.pack_ranges(recovered), "lost": list(lost), "reset": reset})


def reclaim(ledger, identity, epoch, lost, *entries):
    """The rank on ``identity`` says what it used: ``entries`` are ``(part, seq, first, stop, checksum)``."""
    ledger.reclaim(ledger.rank(identity), {"stream": STREAM, "epoch": epoch, "lost": lost, "entries": len(entries)},
                   list(entries))


def used(epoch, part, seq, first=0, stop=1, **kw):
    return (part, seq, first, stop, checksum(epoch, part, seq, **kw))


def lost_to(wire, identity):
    return [(h["epoch"], h["lost"]) for h in wire.of_kind(identity, Kind.LOST)]


def acked(ledger, identity, *ids):
    assert ledger.acknowledge(ledger.rank(identity), [n for i in ids for n in i]) == 0


def up_a_while(ledger):
    """A broker that has run for longer than its --rejoin-grace (a survivor): independent consumers are not held for
    the grace after its start (see test_a_broker_just_restarted_holds_independent_consumers_for_the_grace)."""
    ledger.started -= ledger.rejoin_grace + 1
    return ledger


def figures(ledger, epoch=0):
    stream = ledger.streams[STREAM]
    ep = stream.epochs.get(epoch)
    stats = ep.stats() if ep is not None else stream.finished.figures[epoch]
    return {k: stats[k] for k in ("batches_in", "batches_out", "acked", "adopted", "unassigned", "held", "queued")}


def two_ranks(ledger, window=8, **kw):
    for r, name in enumerate((b"a", b"b")):
        join(ledger, name, hello(r, 2, session=f"s{r}", **kw), prefetch=window)


# ---- hold, LOST, match ------------------------------------------------------------------------------------------


def test_batches_of_a_recovered_partition_are_held_until_every_rank_reclaimed_and_what_was_used_is_not_sent():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 2, session="s0"), prefetch=8)
    recover(ledger)
    ledger.send_lost(ledger.streams[STREAM], wire.transmit)
    assert lost_to(wire, b"a") == [(0, "x")]
    reclaim(ledger, b"a", 0, "x", used(0, 1, 0))
    for seq in range(3):
        push(ledger, 0, 1, seq)
    push(ledger, 0, 0, 0)                        # not recovered: queued as usual
    assert {k: figures(ledger)[k] for k in ("batches_in", "held", "queued")} == {"batches_in": 4, "held": 3,
                                                                                 "queued": 1}
    # the second rank of the group is not there yet: at least expected_ranks members must have reclaimed
    join(ledger, b"b", hello(1, 2, session="s1"), prefetch=8)
    ledger.send_lost(ledger.streams[STREAM], wire.transmit, only=b"b")
    ledger.send_lost(ledger.streams[STREAM], wire.transmit, only=b"a")     # a has reclaimed: nothing more
    assert lost_to(wire, b"b") == [(0, "x")] and lost_to(wire, b"a") == [(0, "x")]
    wire.dispatch()
    assert sorted(wire.to(b"a") + wire.to(b"b")) == [(0, 0, 0)] and figures(ledger)["held"] == 3
    reclaim(ledger, b"b", 0, "x", used(0, 1, 1))
    wire.dispatch()
    sent = wire.to(b"a") + wire.to(b"b")
    assert sorted(sent) == [(0, 0, 0), (0, 1, 2)]           # seqs 0 and 1 of partition 1 were used: never sent
    assert figures(ledger) == {"batches_in": 4, "batches_out": 4, "acked": 2, "adopted": 2, "unassigned": 0,
                               "held": 0, "queued": 0}
    a, b = ledger.rank(b"a"), ledger.rank(b"b")
    assert (a.adopted, b.adopted) == ({0: 1}, {0: 1})
    assert a.given[0] + b.given[0] == 4 and (a.acked, b.acked) == (1, 1)
    for name in (b"a", b"b"):
        acked(ledger, name, *wire.to(name))
    assert end(ledger, 0, 0, 0, 1)[0].kind == Kind.PARTITION_COMMITTED
    assert end(ledger, 0, 1, 0, 3)[0].kind == Kind.PARTITION_COMMITTED
    assert ledger.close_epoch(STREAM, 0, 2) == []
    wire.dispatch()
    assert wire.ended(b"a") == wire.ended(b"b") == [0]
    assert ledger.buffered == 0 and 0 in ledger.streams[STREAM].finished
    assert ledger.streams[STREAM].reclaims == {}                # forgotten with the epoch
    assert figures(ledger)["acked"] == 4 and figures(ledger)["adopted"] == 2


def two_ranks_recovering() -> tuple[Ledger, Wire, list]:
    """A ledger up a while with two ranks joined and its epoch recovering; its wire, and the events it emits."""
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    events: list = []
    ledger.observe(events.append)
    two_ranks(ledger)
    recover(ledger)
    return ledger, wire, events


def test_a_pack_used_in_part_by_two_ranks_is_cut_and_only_its_unused_tail_goes_out():
    ledger, wire, events = two_ranks_recovering()
    splits = [2, 2, 2, 2]
    reclaim(ledger, b"a", 0, "x", used(0, 1, 0, 0, 2, splits=splits))
    reclaim(ledger, b"b", 0, "x", used(0, 1, 0, 2, 3, splits=splits))
    push(ledger, 0, 1, 0, splits=splits)
    assert not [e for e in events if isinstance(e, BatchesAcked)]      # two pieces used, the pack not settled
    wire.dispatch()
    (who, header), = [(w, h) for w, h in wire.headers if h["kind"] == Kind.BATCH]
    assert header["take"] == [3, 4]
    assert figures(ledger) == {"batches_in": 4, "batches_out": 4, "acked": 3, "adopted": 3, "unassigned": 0,
                               "held": 0, "queued": 0}
    assert (ledger.rank(b"a").adopted, ledger.rank(b"b").adopted) == ({0: 2}, {0: 1})
    acked(ledger, who, (0, 1, 0))
    assert figures(ledger)["acked"] == 4 and ledger.buffered == 0
    assert [e.ids for e in events if isinstance(e, BatchesAcked)] == [[[0, 1, 0]]]     # once, with its last piece


def test_rows_a_rank_used_of_a_batch_are_adopted_and_only_the_rows_nobody_used_go_out():
    """A checkpoint taken in an epoch's last step (its remainder shared out by rows): each rank used rows of a
    batch (RECLAIM ``cuts``). Recomputed, the batch's used rows are adopted by their ranks, one piece a cut, and
    only the rows nobody used go out, as a row piece (``cut``)."""
    ledger, wire, events = two_ranks_recovering()
    c10, c11 = checksum(0, 1, 0, rows=10), checksum(0, 1, 1, rows=10)
    ledger.reclaim(ledger.rank(b"a"), {"stream": STREAM, "epoch": 0, "lost": "x", "entries": 1},
                   [(1, 1, 0, 1, c11)], [(1, 0, 0, 0, 4, c10)])                     # batch 1 whole, rows 0..3 of 0
    ledger.reclaim(ledger.rank(b"b"), {"stream": STREAM, "epoch": 0, "lost": "x", "entries": 0}, [],
                   [(1, 0, 0, 7, 10, c10)])                                          # rows 7..9 of batch 0
    pending = ledger.pending(ledger.streams[STREAM], ledger.streams[STREAM].epochs[0])
    assert [(rank.rank, n) for rank, n in pending] == [(0, 2), (1, 1)], "a cut counts one step of its rank's"
    push(ledger, 0, 1, 0, rows=10)
    push(ledger, 0, 1, 1, rows=10)
    wire.dispatch()
    [(who, header)] = [(w, h) for w, h in wire.headers if h["kind"] == Kind.BATCH]
    assert header["cut"] == [4, 7] and protocol.row_cut(header) == (4, 7) and header["seq"] == 0
    assert figures(ledger) == {"batches_in": 2, "batches_out": 4, "acked": 3, "adopted": 3, "unassigned": 0,
                               "held": 0, "queued": 0}                     # 3 pieces of batch 0, batch 1 whole
    assert (ledger.rank(b"a").adopted, ledger.rank(b"b").adopted) == ({0: 2}, {0: 1})
    settled = [e.ids for e in events if isinstance(e, BatchesAcked)]
    assert settled == [[[0, 1, 1]]], "batch 0 settles with its last piece only"
    acked(ledger, who, (0, 1, 0))
    assert [e.ids for e in events if isinstance(e, BatchesAcked)][-1] == [[0, 1, 0]] and ledger.buffered == 0
    frames = batch_frames(0, 1, 0, rows=10)
    assert codec.decode_batch(header, frames[1:])["x"].tolist()[4:7] == [1004, 1005, 1006]


def test_a_batch_recomputed_differently_marks_the_partition_diverged_and_the_ranks_copy_stands():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 1, session="s0"), prefetch=8)
    recover(ledger, partitions=1, carries=(0,), recovered=(0,))
    reclaim(ledger, b"a", 0, "x", used(0, 0, 0, salt=7))           # the rank's copy had other rows
    push(ledger, 0, 0, 0)
    push(ledger, 0, 0, 1)
    wire.dispatch()
    assert wire.to(b"a") == [(0, 0, 1)]
    assert figures(ledger)["adopted"] == 1 and figures(ledger)["batches_out"] == 2
    acked(ledger, b"a", (0, 0, 1))
    end(ledger, 0, 0, 0, 2)
    assert ledger.close_epoch(STREAM, 0, 1) == [0]
    wire.dispatch()
    assert wire.ended(b"a") == [0] and ledger.buffered == 0


def test_in_atomic_delivery_the_match_happens_at_the_commit():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 1, session="s0"), prefetch=8)
    recover(ledger, partitions=1, carries=(0,), recovered=(0,), delivery="atomic")
    reclaim(ledger, b"a", 0, "x", used(0, 0, 1))
    for seq in range(3):
        push(ledger, 0, 0, seq)
    assert ledger.held_bytes > 0 and figures(ledger)["batches_in"] == 0
    end(ledger, 0, 0, 0, 3)
    wire.dispatch()
    assert wire.to(b"a") == [(0, 0, 0), (0, 0, 2)] and ledger.held_bytes == 0
    assert figures(ledger) == {"batches_in": 3, "batches_out": 3, "acked": 1, "adopted": 1, "unassigned": 0,
                               "held": 0, "queued": 0}


# ---- carries, claims, several recoveries ----------------------------------------------------------------------


def test_batches_of_partitions_not_carried_are_dropped_and_claims_are_refused():
    ledger = up_a_while(Ledger())
    recover(ledger, carries=(0,), recovered=(0,))
    with pytest.raises(Rejected) as refused:
        push(ledger, 0, 1, 0)
    assert refused.value.reason == "unassigned"
    with pytest.raises(Rejected):
        push(ledger, 0, 1, 1, splits=[1, 1, 1])                   # a pack counts its batches
    assert figures(ledger)["unassigned"] == 4 and ledger.buffered == 0
    with pytest.raises(ProtocolError, match="not carried"):
        end(ledger, 0, 1, 0, 1)
    with pytest.raises(ProtocolError, match="claims are refused"):
        ledger.claim_partition({"req": 1, "stream": STREAM, "epoch": 0, "part": 0, "broker": 1})
    with pytest.raises(ProtocolError, match="among those it carries"):
        recover(ledger, carries=(0,), recovered=(1,))


def test_a_second_loss_during_a_recovery_adds_up_and_holds_the_newly_recovered_batches_until_reclaimed():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    two_ranks(ledger)
    recover(ledger, partitions=3, carries=(0, 1), recovered=(1,), lost=("x",))
    for name in (b"a", b"b"):
        reclaim(ledger, name, 0, "x")
    push(ledger, 0, 1, 0)
    assert figures(ledger)["held"] == 0 and figures(ledger)["queued"] == 1
    recover(ledger, partitions=3, carries=(2,), recovered=(2,), lost=("y",))
    rec = ledger.streams[STREAM].epochs[0].recovery
    assert (rec.carries, rec.recovered, rec.lost) == ({0, 1, 2}, {1, 2}, ["x", "y"])
    ledger.send_lost(ledger.streams[STREAM], wire.transmit)
    assert lost_to(wire, b"a") == lost_to(wire, b"b") == [(0, "y")]
    push(ledger, 0, 2, 0)
    push(ledger, 0, 2, 1)
    assert figures(ledger)["held"] == 2
    reclaim(ledger, b"a", 0, "y", used(0, 2, 0))
    ledger.rank_gone(b"b", "said goodbye", keep=False)          # a member that leaves is not waited for ...
    wire.dispatch()
    assert figures(ledger)["held"] == 2                          # ... but a group of two waits for two members
    join(ledger, b"c", hello(1, 2, session="new"), prefetch=8)   # a new process takes rank 1
    ledger.send_lost(ledger.streams[STREAM], wire.transmit, only=b"c")
    assert lost_to(wire, b"c") == [(0, "x"), (0, "y")]
    reclaim(ledger, b"c", 0, "y")
    wire.dispatch()
    assert figures(ledger)["held"] == 2                          # and for every loss
    reclaim(ledger, b"c", 0, "x")
    wire.dispatch()
    assert sorted(wire.to(b"a") + wire.to(b"c")) == [(0, 1, 0), (0, 2, 1)]
    assert figures(ledger)["adopted"] == 1 and figures(ledger)["held"] == 0
    assert ledger.rank(b"a").adopted == {0: 1}


def test_an_epoch_that_ended_here_takes_no_new_recovered_partitions_without_reset():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 1, session="s0"), prefetch=8)
    ledger.open_epoch(STREAM, 0, 2, "stream")
    push(ledger, 0, 0, 0)
    end(ledger, 0, 0, 0, 1)
    end(ledger, 0, 1, 0, 0)
    ledger.close_epoch(STREAM, 0, 2)
    wire.dispatch()
    acked(ledger, b"a", (0, 0, 0))
    wire.dispatch()
    assert 0 in ledger.streams[STREAM].finished
    recover(ledger, carries=(0, 1), recovered=())                # what it had: nothing to do
    with pytest.raises(ProtocolError, match="already delivered"):
        recover(ledger, carries=(0, 1), recovered=(1,))


# ---- reset (a resume from a checkpoint) ---------------------------------------------------------------------------


def test_a_reset_feeds_a_delivered_epoch_again_and_forgets_the_later_epochs_the_old_run_was_fed():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    join(ledger, b"old", hello(0, 1, session="old"), prefetch=8)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    for seq in range(3):
        push(ledger, 0, 0, seq)
    end(ledger, 0, 0, 0, 3)
    ledger.close_epoch(STREAM, 0, 1)
    wire.dispatch()
    acked(ledger, b"old", *wire.to(b"old"))
    wire.dispatch()
    ledger.open_epoch(STREAM, 1, 1, "stream")               # the old job fed ahead
    push(ledger, 1, 0, 0)
    ledger.rank_gone(b"old", "said goodbye", keep=False)
    assert 0 in ledger.streams[STREAM].finished
    with pytest.raises(ProtocolError, match="already delivered"):
        ledger.open_epoch(STREAM, 0, 1, "stream")
    # the resumed job: its rank used batch 0 of epoch 0 before the checkpoint
    join(ledger, b"new", hello(0, 1, session="new"), prefetch=8)
    reclaim(ledger, b"new", 0, "", used(0, 0, 0))
    wire.dispatch()
    assert wire.to(b"new") == [] and ledger.streams[STREAM].awaiting_reset == 0    # epoch 1 waits too
    recover(ledger, partitions=1, carries=(0,), recovered=(), lost=(), reset=True)
    rec = ledger.streams[STREAM].epochs[0].recovery
    assert (rec.recovered, rec.lost, rec.reset) == ({0}, [""], True)
    assert 0 not in ledger.streams[STREAM].finished and ledger.streams[STREAM].awaiting_reset is None
    assert 1 not in ledger.streams[STREAM].epochs          # the model has seen none of it: fed again, whole
    for seq in range(3):
        push(ledger, 0, 0, seq)
    end(ledger, 0, 0, 0, 3)
    ledger.close_epoch(STREAM, 0, 1)
    wire.dispatch()
    assert wire.to(b"new") == [(0, 0, 1), (0, 0, 2)]
    acked(ledger, b"new", (0, 0, 1), (0, 0, 2))
    wire.dispatch()
    assert wire.ended(b"new") == [0] and wire.to(b"new")[2:] == []
    ledger.open_epoch(STREAM, 1, 1, "stream")               # the resumed run feeds epoch 1 as usual
    push(ledger, 1, 0, 0)
    wire.dispatch()
    assert wire.to(b"new")[2:] == [(1, 0, 0)]
    assert figures(ledger) == {"batches_in": 3, "batches_out": 3, "acked": 3, "adopted": 1, "unassigned": 0,
                               "held": 0, "queued": 0}
    assert ledger.buffered == ledger.streams[STREAM].epochs[1].bytes_out     # the old epoch 1's copy is let go


def test_a_reset_drops_what_the_broker_had_of_the_epoch_queued_in_flight_and_held():
    ledger = up_a_while(Ledger(rejoin_grace=10.0))
    wire = Wire(ledger)
    two_ranks(ledger, window=1)
    ledger.open_epoch(STREAM, 0, 2, "stream")
    for seq in range(4):
        push(ledger, 0, 0, seq)
    wire.dispatch()
    ledger.rank_gone(b"b", "disconnected")                  # an orphan, holding its batch
    assert ledger.buffered > 0 and ledger.streams[STREAM].orphans
    reclaim(ledger, b"a", 0, "x")                           # a reclaim of another loss: the old job's, dropped
    recover(ledger, partitions=2, carries=(0, 1), recovered=(), lost=(), reset=True)
    assert ledger.buffered == 0 and ledger.rank(b"a").inflight == {} and ledger.rank(b"a").given == {}
    assert ledger.streams[STREAM].orphans == {}             # it held batches of this epoch only
    assert ledger.streams[STREAM].reclaims == {0: {}}
    ep = ledger.streams[STREAM].epochs[0]
    assert (ep.batches_in, len(ep.queue), ep.recovery.recovered, ep.recovery.lost) == (0, 0, {0, 1}, [""])


def test_a_rank_that_rejoins_keeps_what_it_adopted_in_its_count():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 1, session="s0"), prefetch=8)
    recover(ledger, partitions=1, carries=(0,), recovered=(0,))
    reclaim(ledger, b"a", 0, "x", used(0, 0, 0))
    push(ledger, 0, 0, 0)
    push(ledger, 0, 0, 1)
    wire.dispatch()
    assert wire.to(b"a") == [(0, 0, 1)] and ledger.rank(b"a").given == {0: 2}
    ledger.join_rank(b"a", hello(0, 1, session="s0"))            # the same HELLO again: nothing changes
    assert ledger.rank(b"a").given == {0: 2}
    ledger.join_rank(b"a2", hello(0, 1, session="s0", resume=True), held=[(0, 0, 1)])
    assert (ledger.rank(b"a2").adopted, ledger.rank(b"a2").given) == ({0: 1}, {0: 2})


# ---- reclaims are bounded; granted steps say what was adopted ----------------------------------------------------


def test_reclaims_for_epochs_not_recovering_are_kept_bounded_and_a_new_one_replaces_the_ranks_last():
    ledger = up_a_while(Ledger())
    join(ledger, b"a", hello(0, 1, session="s0"))
    reclaim(ledger, b"a", 0, "x", used(0, 0, 0))
    reclaim(ledger, b"a", 0, "x", used(0, 0, 0), used(0, 0, 1))
    assert [len(r.entries) for r in ledger.streams[STREAM].reclaims[0]["x"].values()] == [2]
    for epoch in range(1, MAX_RECLAIM_EPOCHS + 2):
        reclaim(ledger, b"a", epoch, "x")
    assert sorted(ledger.streams[STREAM].reclaims) == list(range(2, MAX_RECLAIM_EPOCHS + 2))


def test_a_granted_rank_is_told_how_many_batches_it_adopted_with_its_steps():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    two_ranks(ledger, window=1, even=True, grants=True)
    recover(ledger, partitions=1, carries=(0,), recovered=(0,))
    reclaim(ledger, b"a", 0, "x", used(0, 0, 0))
    reclaim(ledger, b"b", 0, "x")
    for seq in range(4):
        push(ledger, 0, 0, seq)
    wire.dispatch()
    assert len(wire.to(b"a")) == len(wire.to(b"b")) == 1
    (to_a,), (to_b,) = wire.of_kind(b"a", Kind.STEPS), wire.of_kind(b"b", Kind.STEPS)
    assert (to_a["steps"], to_a["adopted"]) == (1, 1)
    assert to_b["steps"] == 1 and "adopted" not in to_b
    wire.dispatch()
    assert len(wire.of_kind(b"a", Kind.STEPS)) == 1              # nothing grew: nothing more


def test_what_a_rank_used_counts_as_its_steps_from_its_reclaim_on_not_from_the_recomputation():
    """Rank a used 3 batches of partition 0 and 1 of partition 1, b 1 of partition 0. Partition 0 comes first: a's
    grant must already count the batch of partition 1 it used, else it takes one step too many and ends the epoch
    with more steps than b once partition 1 is recomputed (the hang the torch resume test met)."""
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    two_ranks(ledger, window=16, even=True, grants=True)
    recover(ledger, partitions=2, carries=(0, 1), recovered=(0, 1))
    reclaim(ledger, b"a", 0, "x", *(used(0, 0, seq) for seq in range(3)), used(0, 1, 0))
    reclaim(ledger, b"b", 0, "x", used(0, 0, 3))
    for seq in range(6):
        push(ledger, 0, 0, seq)
    wire.dispatch()
    steps = {r: wire.of_kind(r, Kind.STEPS)[-1] for r in (b"a", b"b")}
    assert steps[b"a"]["adopted"] == 4 and steps[b"b"]["adopted"] == 1      # a's batch of partition 1 included
    sent = {r: len(wire.of_kind(r, Kind.BATCH)) for r in (b"a", b"b")}
    assert sum(sent.values()) == 2                                           # seqs 4 and 5: nobody used them
    assert steps[b"a"]["steps"] == min(4 + sent[b"a"], 1 + sent[b"b"])
    for seq in range(4):
        push(ledger, 0, 1, seq)
    wire.dispatch()
    assert figures(ledger)["adopted"] == 5
    final = {r: wire.of_kind(r, Kind.STEPS)[-1] for r in (b"a", b"b")}
    assert final[b"a"]["adopted"] == 4 and final[b"b"]["adopted"] == 1     # matched now: the same count
    assert ledger.counts(ledger.streams[STREAM], ledger.streams[STREAM].epochs[0]) == [
        4 + len(wire.of_kind(b"a", Kind.BATCH)), 1 + len(wire.of_kind(b"b", Kind.BATCH))]


# ---- through a broker: frames, versions, HELLO.incarnation, EPOCH_QUERY ------------------------------------------


def _hello(sock, v=protocol.VERSION, **fields):
    sock.send(protocol.pack_header(Kind.HELLO, v=v, **hello(**fields)))
    welcome = recv_header(sock)[0]
    assert welcome["kind"] == Kind.WELCOME, welcome
    return welcome


def _request(control, kind, **fields):
    send(control, kind, **fields)
    return recv_header(control)[0]


def _recover_fields(**kw):
    fields = {"req": 5, "stream": STREAM, "epoch": 0, "partitions": 1, "delivery": "stream",
              "carries": [0, 1], "recovered": [0, 1], "lost": ["x"], "reset": False}
    fields.update(kw)
    return fields


def test_a_reclaim_whose_frame_is_not_its_entries_is_malformed_and_changes_nothing(start_broker_thread, sockets):
    broker = start_broker_thread()
    rank = sockets(zmq.DEALER, broker.config.ranks)
    _hello(rank, session="s0")
    header = protocol.pack_header(Kind.RECLAIM, stream=STREAM, epoch=0, lost="x", entries=2)
    rank.send_multipart([header, protocol.pack_used([(0, 0, 0, 1, 5)])])
    refused = recv_header(rank)[0]
    assert (refused["kind"], refused["code"]) == (Kind.ERROR, ErrorCode.MALFORMED)
    rank.send(header)                                                   # no frame at all
    assert recv_header(rank)[0]["code"] == ErrorCode.MALFORMED
    rank.send_multipart([protocol.pack_header(Kind.RECLAIM, stream=STREAM, epoch=0, lost="x", entries=1),
                         protocol.pack_used([(0, 0, 0, 1, 5)])])
    send(rank, Kind.STATS_REQUEST, req=9)                               # answered after the RECLAIM was handled
    assert recv_header(rank)[0]["kind"] == Kind.STATS_REPLY
    assert {loss: list(m) for loss, m in broker.ledger.streams[STREAM].reclaims[0].items()} == {"x": ["s0"]}


def test_recovery_over_the_wire_lost_to_the_ranks_and_the_answer_to_epoch_query(start_broker_thread, sockets):
    broker = start_broker_thread()
    control = sockets(zmq.DEALER, broker.config.control)
    rank = sockets(zmq.DEALER, broker.config.ranks)
    _hello(rank, session="s0")
    unknown = _request(control, Kind.EPOCH_QUERY, req=2, stream=STREAM, epoch=0)
    assert (unknown["known"], unknown["committed"], unknown["incarnation"], unknown["journal"]) == (
        False, [], broker.incarnation, False)
    assert _request(control, Kind.EPOCH_RECOVER, **_recover_fields(partitions=3, carries=[0, 3],
                                                                   recovered=[1, 2]))["kind"] == Kind.OK
    lost = recv_header(rank)[0]
    assert (lost["kind"], lost["epoch"], lost["lost"]) == (Kind.LOST, 0, "x")
    push = sockets(zmq.PUSH, broker.config.feed)
    push.send_multipart(codec.encode_batch(STREAM, 0, 0, 0, {"x": np.arange(3)}))
    send(rank, Kind.CREDIT, window=4, window_bytes=0)
    batch = recv_header(rank)[0]                                 # partition 0 is not recovered: it goes out
    assert (batch["kind"], protocol.batch_id(batch)) == (Kind.BATCH, (0, 0, 0))
    committed = _request(control, Kind.PARTITION_END, req=3, stream=STREAM, epoch=0, part=2, attempt=0, batches=0,
                         rows=0)
    assert committed["kind"] == Kind.PARTITION_COMMITTED
    claim = _request(control, Kind.PARTITION_CLAIM, req=4, stream=STREAM, epoch=0, part=1, broker=0)
    assert (claim["kind"], claim["code"]) == (Kind.ERROR, ErrorCode.REFUSED)
    answer = _request(control, Kind.EPOCH_QUERY, req=6, stream=STREAM, epoch=0)
    assert {k: answer[k] for k in ("kind", "req", "known", "closed", "ended", "delivered", "partitions",
                                   "committed", "seen", "incarnation", "journal")} == {
        "kind": Kind.OK, "req": 6, "known": True, "closed": False, "ended": False, "delivered": False,
        "partitions": 3, "committed": [2, 3], "seen": [0, 1, 2, 3], "incarnation": broker.incarnation,
        "journal": False}


def test_a_rank_naming_a_lost_incarnation_joins_as_new_and_its_ids_are_not_taken(start_broker_thread, sockets):
    broker = start_broker_thread()
    control = sockets(zmq.DEALER, broker.config.control)
    assert _request(control, Kind.EPOCH_OPEN, req=1, stream=STREAM, epoch=0, partitions=1,
                    delivery="stream")["kind"] == Kind.OK
    push = sockets(zmq.PUSH, broker.config.feed)
    push.send_multipart(codec.encode_batch(STREAM, 0, 0, 0, {"x": np.arange(3)}))
    rank = sockets(zmq.DEALER, broker.config.ranks)
    ids = protocol.pack_ids([(0, 0, 0)])
    rank.send_multipart([protocol.pack_header(Kind.HELLO, **hello(session="s0", resume=True), incarnation="gone"),
                         b"", ids])                   # "I consumed (0, 0, 0)": of a broker that is gone
    assert recv_header(rank)[0]["kind"] == Kind.WELCOME
    send(rank, Kind.CREDIT, window=4, window_bytes=0)
    batch = recv_header(rank)[0]
    assert (batch["kind"], protocol.batch_id(batch)) == (Kind.BATCH, (0, 0, 0))
    send(rank, Kind.STATS_REQUEST, req=9)
    stats = recv_header(rank)[0]["stats"]["streams"][STREAM]
    assert stats["epochs"]["0"]["given_twice"] == 0 and stats["epochs"]["0"]["acked"] == 0


def test_a_rank_of_a_version_before_recovery_is_refused_at_its_hello_saying_which_versions_met(start_broker_thread,
                                                                                           sockets):
    """Version 5 ranks could not say what they used; since version 7 a broker serves 6 and 7 only, so such a rank
    never joins a stream that may recover (it used to be turned away from recovering streams only)."""
    broker = start_broker_thread()
    old = sockets(zmq.DEALER, broker.config.ranks)
    old.send(protocol.pack_header(Kind.HELLO, v=5, **hello(session="old", stream="s5")))
    refused = recv_header(old)[0]
    assert (refused["kind"], refused["code"]) == (Kind.ERROR, ErrorCode.VERSION)
    assert "peer speaks 5" in refused["reason"] and "6 and 7" in refused["reason"]
    assert protocol.RECOVERY_VERSION == protocol.SUPPORTED[0]


def test_sparkbus_status_shows_an_epochs_recovery_figures_once_it_has_any():
    from sparkbus.broker.config import BrokerConfig
    from sparkbus.broker.daemon import Broker
    from sparkbus.broker.status import render_stats

    broker = Broker(BrokerConfig(feed="inproc://f", ranks="inproc://r", control="inproc://c"))
    ledger = broker.ledger
    ledger.open_epoch(STREAM, 1, 1, "stream")
    recover(ledger, epoch=0, partitions=2, carries=(0,), recovered=(0,))
    push(ledger, 0, 0, 0)                                  # held: no rank has said what it used
    with pytest.raises(Rejected):
        push(ledger, 0, 1, 0)
    lines = render_stats(broker.stats()).splitlines()
    (zero,) = [line for line in lines if line.startswith("  epoch 0 ")]
    (one,) = [line for line in lines if line.startswith("  epoch 1 ")]
    assert zero.endswith("; recovery: held 1, adopted 0, unassigned 1") and "recovery" not in one


def test_epoch_query_of_a_delivered_epoch_and_of_one_whose_figures_are_gone():
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    ledger.keep_epochs = 1
    join(ledger, b"a", hello(0, 1, session="s0"), prefetch=8)
    for epoch in (0, 1):
        ledger.open_epoch(STREAM, epoch, 2, "stream")
        push(ledger, epoch, 0, 0)
        end(ledger, epoch, 0, 0, 1)
        end(ledger, epoch, 1, 0, 0)
        ledger.close_epoch(STREAM, epoch, 2)
        wire.dispatch()
        acked(ledger, b"a", (epoch, 0, 0))
        wire.dispatch()
    assert list(ledger.streams[STREAM].finished.figures) == [1]                         # epoch 0: its number only
    assert ledger.query_epoch(STREAM, 1) == {"known": True, "closed": True, "ended": True, "delivered": True,
                                             "partitions": 2, "committed": [0, 2], "seen": [0, 2]}
    assert ledger.query_epoch(STREAM, 0) == {"known": True, "closed": True, "ended": True, "delivered": True,
                                             "partitions": 0, "committed": [], "seen": []}
    assert ledger.query_epoch("nobody", 0)["known"] is False


def test_kinds_and_fields_of_a_newer_version_are_never_sent_to_a_rank_of_the_version_before():
    from sparkbus.broker.books import Outcome
    from sparkbus.broker.config import BrokerConfig
    from sparkbus.broker.daemon import Broker

    class Ranks:                          # the ranks socket: what was sent on it
        def __init__(self):
            self.sent = []

        def send_multipart(self, frames, flags=0, copy=True):
            self.sent.append([bytes(f) for f in frames])

    broker = Broker(BrokerConfig(feed="inproc://f", ranks="inproc://r", control="inproc://c"))
    ranks = broker._ranks = Ranks()
    broker.peers.heard("ranks", b"old", 6, 0.0)
    newer = protocol.pack_header(Kind.PARTITION_RECEIVED, req=1, stream=STREAM, epoch=0, part=0, attempt=1)
    opened = protocol.pack_header(Kind.EPOCH_OPEN, req=1, stream=STREAM, epoch=0, partitions=3, delivery="stream",
                                  commit="driver")
    lost = protocol.pack_header(Kind.LOST, stream=STREAM, epoch=0, lost="x")
    assert broker._transmit(b"old", [newer]) is Outcome.SENT and ranks.sent == []      # dropped, not sent
    assert broker._transmit(b"old", [opened]) is Outcome.SENT
    assert broker._transmit(b"new", [newer]) is Outcome.SENT
    assert broker._transmit(b"old", [lost]) is Outcome.SENT
    (who, old_open), (other, new_kind), (_, old_lost) = ranks.sent
    header = protocol.unpack_header(old_open)
    assert (who, header["v"], header["partitions"], "commit" in header) == (b"old", 6, 3, False)
    assert (other, new_kind) == (b"new", newer)
    assert protocol.unpack_header(old_lost)["v"] == 6          # version 6 has LOST: re-encoded, not dropped


def test_a_broker_just_restarted_holds_independent_consumers_for_the_grace(monkeypatch):
    """Independent consumers cannot say how many they are: after a restart, the recomputed batches wait for
    --rejoin-grace, however many consumers have reclaimed, so that one still reconnecting is not passed over."""
    clock = [1000.0]
    monkeypatch.setattr("sparkbus.broker.matching.time.monotonic", lambda: clock[0])
    ledger = Ledger(rejoin_grace=10.0)
    ledger.started = 1000.0
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 1, session="s0"), prefetch=8)
    recover(ledger)
    reclaim(ledger, b"a", 0, "x", used(0, 1, 0))
    for seq in range(2):
        push(ledger, 0, 1, seq)
    wire.dispatch()
    assert wire.to(b"a") == [] and figures(ledger)["held"] == 2
    clock[0] = 1010.5                            # the grace is over: every consumer there has reclaimed
    wire.dispatch()
    assert wire.to(b"a") == [(0, 1, 1)] and figures(ledger)["adopted"] == 1


def test_a_spark_connect_bound_of_ten_million_partitions_is_one_range_not_ten_million_numbers():
    """A Connect driver that does not know the count yet recovers up to EPOCH_OPEN's bound: the broker keeps the
    ranges as they are (it took seconds, and hundreds of MB, when it made a set of them)."""
    ledger = up_a_while(Ledger())
    ledger.open_epoch(STREAM, 0, MAX_PARTITIONS, "stream")
    bound = [0, MAX_PARTITIONS]
    ledger.recover_epoch({"req": 1, "stream": STREAM, "epoch": 0, "partitions": MAX_PARTITIONS, "delivery": "stream",
                          "carries": bound, "recovered": [5, MAX_PARTITIONS], "lost": ["x"], "reset": False})
    rec = ledger.streams[STREAM].epochs[0].recovery
    assert rec.carries.pairs() == [(0, MAX_PARTITIONS)] and rec.recovered.pairs() == [(5, MAX_PARTITIONS)]
    assert 4 in rec.carries and 4 not in rec.recovered and MAX_PARTITIONS - 1 in rec.recovered
    assert MAX_PARTITIONS not in rec.carries and len(rec.recovered) == MAX_PARTITIONS - 5
    with pytest.raises(ProtocolError, match="among those it carries"):
        ledger.recover_epoch({"req": 2, "stream": STREAM, "epoch": 0, "partitions": MAX_PARTITIONS,
                              "delivery": "stream", "carries": [0, 3], "recovered": [2, 4], "lost": [],
                              "reset": False})


def test_a_checkpoint_of_two_ranks_resumes_on_three_with_equal_steps_and_counts_for_no_rank():
    """The old group of 2 took 2 steps each of a 10-batch epoch and died mid-epoch; a group of 3, each saying it
    resumes epoch 0 (``HELLO.resumes``) and naming all 4 used batches (every rank the same, ``resume=[...]``), takes
    the epoch over: the 4 are adopted by the checkpoint, counted for no rank, and the 6 left go 2, 2, 2."""
    ledger = up_a_while(Ledger())
    wire = Wire(ledger)
    granted = dict(even=True, grants=True)
    for r in range(2):
        join(ledger, f"old{r}".encode(), dict(hello(r, 2, session=f"old{r}", **granted), remainder="split"),
             prefetch=8)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    for seq in range(10):
        push(ledger, 0, 0, seq)
    wire.dispatch()
    acked(ledger, b"old0", *wire.to(b"old0")[:2])
    acked(ledger, b"old1", *wire.to(b"old1")[:2])
    used_before = sorted(wire.to(b"old0")[:2] + wire.to(b"old1")[:2])
    with pytest.raises(ProtocolError, match="only at an epoch boundary, or resuming it from a checkpoint"):
        ledger.join_rank(b"late", dict(hello(0, 3, session="late", **granted), remainder="split"))
    checkpoint = [used(0, 0, seq) for _, _, seq in used_before]
    for r in range(3):
        join(ledger, f"new{r}".encode(), dict(hello(r, 3, session=f"new{r}", **granted), remainder="split",
                                              resumes=0), prefetch=8)
        reclaim(ledger, f"new{r}".encode(), 0, "", *checkpoint)
    assert not any(r.identity.startswith(b"old") for r in ledger.streams[STREAM].ranks.values())
    recover(ledger, partitions=1, carries=(0,), recovered=(), lost=(), reset=True)
    for seq in range(10):
        push(ledger, 0, 0, seq)
    end(ledger, 0, 0, 0, 10)
    ledger.close_epoch(STREAM, 0, 1)
    for _ in range(5):
        wire.dispatch()
        for r in range(3):
            name = f"new{r}".encode()
            fresh = [i for i in wire.to(name) if i not in used_before]
            ledger.acknowledge(ledger.rank(name), [n for i in fresh for n in i])
    news = [[i for i in wire.to(f"new{r}".encode())] for r in range(3)]
    assert sorted(i for n in news for i in n) == sorted(set((0, 0, s) for s in range(10)) - set(used_before))
    assert [len(n) for n in news] == [2, 2, 2]
    assert [h["steps"] for who, h in wire.headers if h["kind"] == Kind.EPOCH_END and who.startswith(b"new")] == \
        [2, 2, 2]
    assert figures(ledger)["adopted"] == 4, "the checkpoint's batches: consumed, never sent"
