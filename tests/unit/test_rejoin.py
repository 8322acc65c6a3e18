"""Rejoining, without sockets: a rank that comes back keeps what it holds, and no batch goes to two live ranks.

Each test drives the ledger as the daemon does (HELLO dicts, dispatch through the harness's ``Wire``) and checks
where every batch id ends up.
"""

import numpy as np
import pytest

from sparkbus.broker.books import Outcome
from sparkbus.broker.journal import Journal
from sparkbus.broker.ledger import Ledger
from sparkbus.wire import codec
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind, unpack_header

from harness import Wire
from harness import hello as rank_hello


def hello(rank, size=2, session=None, resume=False, ended=-1, even=True, stream="s"):
    """The HELLO of rank ``rank`` of two even ranks, with a session (``session-RANK``) it can rejoin with."""
    return rank_hello(rank, size, even=even, stream=stream, resume=resume, ended=ended,
                      session=session if session is not None else f"session-{rank}")


def join_two(ledger, prefix, window, **fields):
    """Ranks 0 and 1 join on connections ``PREFIX0`` and ``PREFIX1`` (their :func:`hello` with ``fields``), and
    each states a window of ``window`` batches."""
    for r in (0, 1):
        identity = f"{prefix}{r}".encode()
        ledger.join_rank(identity, hello(r, **fields))
        ledger.set_window(ledger.rank(identity), window, 0)


def feed(ledger, batches, epoch=0, partitions=1, stream="s", close=True):
    ledger.open_epoch(stream, epoch, partitions, "stream")
    for seq in range(batches):
        frames = codec.encode_batch(stream, epoch, 0, seq, {"id": np.arange(4) + 4 * seq})
        ledger.accept_batch(unpack_header(frames[0]), frames, frames[0] if ledger.journal else None)
    ledger.end_partition(b"feeder", {"req": 1, "stream": stream, "epoch": epoch, "part": 0, "attempt": 0,
                                     "batches": batches, "rows": 4 * batches})
    if close:
        ledger.close_epoch(stream, epoch, partitions)


@pytest.fixture
def ledger():
    return Ledger(rejoin_grace=10.0)


def test_a_rank_whose_old_connection_lingers_takes_it_over_and_keeps_what_it_holds(ledger):
    feed(ledger, 20)
    wire = Wire(ledger)
    join_two(ledger, "old", 4)
    wire.dispatch()
    got0 = list(wire.to(b"old0"))
    assert len(got0) == 4
    # Rank 0 consumed two, holds two, and its link drops; the broker still holds the old connection (FIN lost).
    ledger.acknowledge(ledger.rank(b"old0"), list(got0[0]))        # this ack arrived
    wire.cut.add(b"old0")
    # rank 0's second ack was lost in the cut; it reconnects on a new connection and says who it is
    missed = ledger.join_rank(b"new0", hello(0, resume=True), held=got0[2:], consumed=got0[:2])
    assert missed == []
    assert b"old0" not in ledger.ranks and set(ledger.rank(b"new0").inflight) == set(got0[2:])
    stats = ledger.streams["s"].epochs[0]
    assert stats.acked == 2 and ledger.streams["s"].rejoins == 1
    # nothing of rank 0's goes to anyone else, and the rest of the epoch is shared out as usual
    ledger.set_window(ledger.rank(b"new0"), 4, 0)   # it holds two: room for two more
    wire.dispatch()
    assert not set(got0) & set(wire.to(b"old1")) and not set(got0) & set(wire.to(b"new0"))


def test_another_process_cannot_take_a_connected_rank_number(ledger):
    ledger.join_rank(b"a", hello(0, session="first"))
    with pytest.raises(ProtocolError, match="already connected"):
        ledger.join_rank(b"b", hello(0, session="second"))


def test_the_same_hello_twice_on_one_connection_changes_nothing(ledger):
    feed(ledger, 4)
    ledger.join_rank(b"a", hello(0, size=1))
    ledger.set_window(ledger.rank(b"a"), 2, 0)
    Wire(ledger).dispatch()
    inflight = dict(ledger.rank(b"a").inflight)
    assert ledger.join_rank(b"a", hello(0, size=1, resume=True)) == []
    assert ledger.rank(b"a").inflight == inflight and ledger.streams["s"].epochs[0].queue.__len__() == 2


def test_a_lost_rank_keeps_its_batches_for_the_grace_then_they_go_to_the_others(ledger):
    feed(ledger, 12)
    wire = Wire(ledger)
    join_two(ledger, "r", 3, even=False)
    wire.dispatch()
    lost = set(wire.to(b"r0"))
    ledger.rank_gone(b"r0", "disconnected")
    survivor = ledger.rank(b"r1")
    ledger.acknowledge(survivor, [x for i in wire.to(b"r1") for x in i])
    ledger.set_window(survivor, 3, 0)
    wire.dispatch()
    assert not lost & set(wire.to(b"r1")), "a lost rank's batches went to another rank within the grace"
    ledger.expire_orphans(now=float("inf"))
    ledger.acknowledge(survivor, [x for i in ledger.rank(b"r1").inflight for x in i])
    ledger.set_window(survivor, 12, 0)
    wire.dispatch()
    assert lost <= set(wire.to(b"r1"))
    assert ledger.streams["s"].epochs[0].redelivered == len(lost)


def test_a_rank_that_said_bye_gives_its_batches_back_at_once(ledger):
    feed(ledger, 6)
    wire = Wire(ledger)
    ledger.join_rank(b"a", hello(0, size=1, even=False))
    ledger.set_window(ledger.rank(b"a"), 2, 0)
    wire.dispatch()
    ledger.rank_gone(b"a", "said goodbye", keep=False)
    assert not ledger.streams["s"].orphans and len(ledger.streams["s"].epochs[0].queue) == 6


def test_a_new_job_on_the_same_rank_numbers_gets_the_dead_jobs_batches_at_once(ledger):
    feed(ledger, 10)
    wire = Wire(ledger)
    for r in (0, 1):
        ledger.join_rank(f"old{r}".encode(), hello(r, session=f"old{r}"))
        ledger.set_window(ledger.rank(f"old{r}".encode()), 2, 0)
    wire.dispatch()
    for r in (0, 1):
        ledger.rank_gone(f"old{r}".encode(), "disconnected")
    assert len(ledger.streams["s"].orphans) == 2
    for r in (0, 1):
        ledger.join_rank(f"new{r}".encode(), hello(r, session=f"new{r}"))
        ledger.set_window(ledger.rank(f"new{r}".encode()), 10, 0)
    assert not ledger.streams["s"].orphans
    wire.dispatch()
    delivered = sorted(wire.to(b"new0") + wire.to(b"new1"))
    assert delivered == [(0, 0, seq) for seq in range(10)]


def test_a_rank_back_after_the_epoch_ended_gets_its_lost_batches_then_the_end(ledger):
    feed(ledger, 4)
    wire = Wire(ledger)
    join_two(ledger, "r", 2)
    wire.cut.add(b"r0")                   # rank 0's link is down: its batches and the epoch's end never arrive
    wire.dispatch()
    stream = ledger.streams["s"]
    assert stream.epochs[0].end_sent and wire.ended(b"r1") == [0]
    in_flight_to_0 = sorted(ledger.rank(b"r0").inflight)
    missed = ledger.join_rank(b"r0-new", hello(0, resume=True), held=[], consumed=[])
    assert [(m.epoch, m.batches, [b.id for b in m.resend]) for m in missed] == [(0, 4, in_flight_to_0)]
    assert sorted(ledger.rank(b"r0-new").inflight) == in_flight_to_0
    assert stream.epochs[0].redelivered == 2 and not stream.epochs[0].queue

    ledger.send_missed(b"r0-new", missed, wire.transmit)     # after its WELCOME: the lost batches, then the end
    assert wire.to(b"r0-new") == in_flight_to_0 and wire.ended(b"r0-new") == [0]


def test_a_rank_gone_again_while_it_is_sent_what_it_missed_is_not_sent_the_rest(ledger):
    feed(ledger, 4)
    wire = Wire(ledger)
    join_two(ledger, "r", 2)
    wire.cut.add(b"r0")
    wire.dispatch()
    in_flight_to_0 = sorted(ledger.rank(b"r0").inflight)
    missed = ledger.join_rank(b"r0-new", hello(0, resume=True), held=[], consumed=[])
    sends = []

    def transmit(identity, frames):       # the first resend finds the new connection closed
        sends.append(unpack_header(frames[0])["kind"])
        return Outcome.GONE

    ledger.send_missed(b"r0-new", missed, transmit)
    assert sends == [Kind.BATCH]                              # neither the other batch nor the end
    orphan = ledger.streams["s"].orphans["session-0"]         # what it holds waits for it as before
    assert sorted(orphan.rank.inflight) == in_flight_to_0 and b"r0-new" not in ledger.ranks


def test_after_a_journalled_restart_a_rank_keeps_what_it_held_and_consumed(tmp_path):
    before = Ledger(Journal(tmp_path))
    feed(before, 8)
    wire = Wire(before)
    join_two(before, "r", 2)
    wire.dispatch()
    got = {r: list(wire.to(f"r{r}".encode())) for r in (0, 1)}
    before.acknowledge(before.rank(b"r0"), list(got[0][0]))
    before.journal.close()

    after = Ledger(Journal(tmp_path))
    after.replay()
    assert len(after.streams["s"].epochs[0].queue) == 7           # one was acknowledged before the restart
    # rank 0 consumed both of its batches (the second ack died with the broker); rank 1 holds its two
    after.join_rank(b"n0", hello(0, resume=True), held=[], consumed=got[0])
    after.join_rank(b"n1", hello(1, resume=True), held=got[1], consumed=[])
    wire = Wire(after)
    for r in (0, 1):
        after.set_window(after.rank(f"n{r}".encode()), 8, 0)
    wire.dispatch()
    sent_again = set(wire.to(b"n0")) | set(wire.to(b"n1"))
    assert not sent_again & (set(got[0]) | set(got[1])), "a batch a rank had was sent again"
    assert sent_again | set(got[0]) | set(got[1]) == {(0, 0, seq) for seq in range(8)}
    assert after.streams["s"].epochs[0].acked == 2
