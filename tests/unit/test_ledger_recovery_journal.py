"""A broker restarted with its journal in the middle of a recovery: EPOCH_RECOVER and the ranks' RECLAIMs are
journalled and replayed through the same appliers, so the epoch's recovery state comes back as it was."""

from __future__ import annotations

import pytest

from sparkbus.broker.ledger import Ledger
from sparkbus.broker.matching import RESUME
from sparkbus.broker.recovery import MAX_RECLAIM_EPOCHS
from sparkbus.wire import protocol

from harness.ledger import STREAM, Wire, ack, batch_frames, feed, join, push, window
from harness.ranks import hello

pytestmark = pytest.mark.timeout(60)


def recovery_state(ledger: Ledger) -> dict:
    """The recovery state of every epoch and the reclaims each stream keeps, comparable across a restart."""
    state = {}
    for name, stream in ledger.streams.items():
        epochs = {}
        for number, ep in stream.epochs.items():
            rec = ep.recovery
            epochs[number] = None if rec is None else {
                "carries": rec.carries.pairs(), "recovered": rec.recovered.pairs(), "lost": rec.lost,
                "reset": rec.reset, "held": sorted(b.id for b in rec.held), "matched": rec.matched,
                "closed": ep.closed, "queued": sorted(b.id for b in ep.queue)}
        state[name] = {"epochs": epochs, "reclaims": stream.reclaims, "awaiting_reset": stream.awaiting_reset,
                       "finished": sorted(stream.finished.figures)}
    return state


def checksum(epoch, part, seq):
    return protocol.unpack_header(batch_frames(epoch, part, seq)[0])["checksum"]


def recover(ledger, epoch, carries, recovered, lost, reset=False, partitions=2):
    ledger.recover_epoch({"req": 1, "stream": STREAM, "epoch": epoch, "partitions": partitions,
                          "delivery": "stream", "carries": protocol.pack_ranges(carries),
                          "recovered": protocol.pack_ranges(recovered), "lost": list(lost), "reset": reset})


def reclaim(ledger, identity, epoch, lost, entries):
    ledger.reclaim(ledger.rank(identity), {"stream": STREAM, "epoch": epoch, "lost": lost,
                                           "entries": len(entries)}, entries)


def restarted(journals, directory) -> Ledger:
    ledger = Ledger(journals(directory))
    ledger.replay()
    return ledger


def test_a_restart_in_the_middle_of_a_recovery_restores_its_state(tmp_path, journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 3, "stream")
    push(live, 0, 0, 0, journalled=True)
    join(live, b"a", hello(0, 2, session="A"), prefetch=4)
    join(live, b"b", hello(1, 2, session="B"), prefetch=4)
    reclaim(live, b"a", 0, "lost-1", [(1, 0, 0, 1, checksum(0, 1, 0))])
    recover(live, 0, carries=(0, 1), recovered=(1,), lost=["lost-1"], partitions=3)
    push(live, 0, 1, 0, journalled=True)            # recovered: held until every rank reclaimed
    push(live, 0, 1, 1, journalled=True)
    with pytest.raises(Exception, match="not carried"):
        push(live, 0, 2, 0, journalled=True)        # not carried here: dropped
    ep = live.streams[STREAM].epochs[0]
    assert ep.recovery is not None and [b.id for b in ep.recovery.held] == [(0, 1, 0), (0, 1, 1)]

    again = restarted(journals, tmp_path)
    assert recovery_state(again) == recovery_state(live)
    assert again.buffered == live.buffered and not again.replay_refused

    # the restarted broker goes on: the other rank's reclaim releases the held batches, one matched to rank a
    join(again, b"a", hello(0, 2, session="A", resume=True), prefetch=4)
    join(again, b"b", hello(1, 2, session="B", resume=True), prefetch=4)
    reclaim(again, b"b", 0, "lost-1", [])
    Wire(again).dispatch()
    assert again.streams[STREAM].epochs[0].recovery.matched == {"A": 1}


def test_a_second_recover_and_a_replaced_reclaim_replay_as_they_were_applied(tmp_path, journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 2, "stream")
    join(live, b"a", hello(0, 1, session="A"))
    recover(live, 0, carries=(0,), recovered=(0,), lost=["x"])
    reclaim(live, b"a", 0, "x", [(0, 0, 0, 1, checksum(0, 0, 0))])
    reclaim(live, b"a", 0, "x", [(0, 0, 0, 1, checksum(0, 0, 0)), (0, 1, 0, 1, checksum(0, 0, 1))])
    recover(live, 0, carries=(1,), recovered=(1,), lost=["y"])     # a second loss: the union
    assert recovery_state(restarted(journals, tmp_path)) == recovery_state(live)


def test_a_resume_reset_replays_and_forgets_the_later_epochs(tmp_path, journals):
    live = Ledger(journals(tmp_path))
    feed(live, 0, 1, 2)
    wire = Wire(live)
    join(live, b"a", hello(0, 1, session="A"))
    window(live, b"a", 4)
    wire.dispatch()
    ack(live, b"a", wire.to(b"a"))
    wire.dispatch()                                  # epoch 0 delivered and retired
    feed(live, 1, 1, 1)
    reclaim(live, b"a", 0, RESUME, [(0, 0, 0, 1, checksum(0, 0, 0))])
    live.rank_gone(b"a", "finished", keep=False)
    recover(live, 0, carries=(0,), recovered=(0,), lost=[], reset=True, partitions=1)
    push(live, 0, 0, 0, journalled=True)
    assert list(live.streams[STREAM].epochs) == [0] and 0 not in live.streams[STREAM].finished

    again = restarted(journals, tmp_path)
    assert recovery_state(again) == recovery_state(live)
    assert again.buffered == live.buffered and not again.replay_refused
    assert not (tmp_path / STREAM.encode().hex() / "epoch-1.log").exists()


def test_a_refused_recover_record_is_counted_on_replay(tmp_path, journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 2, "stream")
    live.journal.record_recover(STREAM, 0, partitions=2, delivery="atomic", commit="end", carries=[0, 1],
                                recovered=[], lost=[], reset=False)    # another delivery: the rules refuse it
    again = restarted(journals, tmp_path)
    assert again.replay_refused == {"EpochRecovering": 1} and again.streams[STREAM].epochs[0].recovery is None


def test_reclaims_of_many_epochs_not_open_leave_the_files_of_only_the_epochs_kept(tmp_path, journals):
    """RECLAIMs may name epochs the broker has not opened (a resume, a loss before the feed's EPOCH_RECOVER). The
    broker keeps those of MAX_RECLAIM_EPOCHS epochs a stream; the journal files of an epoch whose reclaims it drops
    hold nothing else, and go with them, live and after a restart."""
    live = Ledger(journals(tmp_path))
    join(live, b"a", hello(0, 1, session="s0"), prefetch=8)
    live.open_epoch(STREAM, 0, 1, "stream")                  # open: its files stay whatever its reclaims do
    for epoch in range(40):
        reclaim(live, b"a", epoch, RESUME, [])
    kept = sorted(live.streams[STREAM].reclaims)
    assert len(kept) == MAX_RECLAIM_EPOCHS and kept[-1] == 39
    logs = sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("*/epoch-*.log"))
    assert logs == sorted({0, *kept})
    live.journal.close()
    again = restarted(journals, tmp_path)
    assert recovery_state(again)[STREAM]["reclaims"] == recovery_state(live)[STREAM]["reclaims"]
    assert sorted(int(p.stem.split("-")[1]) for p in tmp_path.glob("*/epoch-*.log")) == logs
