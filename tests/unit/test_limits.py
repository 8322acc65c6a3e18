"""Every piece of per-stream state a peer's requests make is bounded, and a request past a bound is refused with a
reason that names the limit (docs/PROTOCOL.md, "Limits and refusals"): open epochs, losses and their names, a
recovery's ranges, a rank's session, a partition's attempts, the RECLAIMs kept. A refused request changes nothing.
"""

from __future__ import annotations

import pytest
import zmq

from sparkbus.broker import partitions, recovery
from sparkbus.broker.ledger import Ledger, Rejected
from sparkbus.broker.partitions import MAX_OPEN_EPOCHS
from sparkbus.broker.recovery import MAX_INCARNATION, MAX_LOSSES
from sparkbus.broker.rejoin import MAX_SESSION
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import ErrorCode, Kind

from harness import STREAM, Wire, end, hello, join, push, recv_header, send


def recover_header(epoch=0, partitions=2, carries=(0, 2), recovered=(1, 2), lost=("x",), reset=False):
    return {"req": 1, "stream": STREAM, "epoch": epoch, "partitions": partitions, "delivery": "stream",
            "carries": list(carries), "recovered": list(recovered), "lost": list(lost), "reset": reset}


def reclaim(ledger, identity, epoch, lost):
    ledger.reclaim(ledger.rank(identity), {"stream": STREAM, "epoch": epoch, "lost": lost, "entries": 0}, [])


# ---- open epochs ------------------------------------------------------------------------------------------------


def test_a_stream_opens_at_most_max_open_epochs_and_another_once_one_is_retired():
    ledger = Ledger()
    for number in range(MAX_OPEN_EPOCHS):
        ledger.open_epoch(STREAM, number, 0, "stream")
    ledger.open_epoch(STREAM, 0, 0, "stream")            # an open one again, same terms: no new state
    with pytest.raises(ProtocolError, match=f"{MAX_OPEN_EPOCHS} epochs open.*the most a stream may have"):
        ledger.open_epoch(STREAM, MAX_OPEN_EPOCHS, 0, "stream")
    assert len(ledger.streams[STREAM].epochs) == MAX_OPEN_EPOCHS
    ledger.open_epoch("other", 0, 0, "stream")           # the limit is the stream's
    # epoch 0 delivered and retired: room for one more
    ledger.close_epoch(STREAM, 0, 0)
    join(ledger, b"a", hello(), prefetch=1)
    Wire(ledger).dispatch()
    assert 0 not in ledger.streams[STREAM].epochs and 0 in ledger.streams[STREAM].finished
    ledger.open_epoch(STREAM, MAX_OPEN_EPOCHS, 0, "stream")


def test_the_broker_opens_at_most_max_broker_epochs_over_its_streams(monkeypatch):
    monkeypatch.setattr(partitions, "MAX_BROKER_EPOCHS", 4)
    ledger = Ledger()
    for number in range(4):
        ledger.open_epoch(f"s{number % 2}", number, 1, "stream")
    with pytest.raises(ProtocolError, match="the broker has 4 epochs open over its streams"):
        ledger.open_epoch("s9", 0, 1, "stream")
    assert "s9" not in ledger.streams or not ledger.streams["s9"].epochs


def test_an_epoch_recover_that_would_open_an_epoch_past_the_limit_is_refused_and_changes_nothing():
    ledger = Ledger()
    for number in range(MAX_OPEN_EPOCHS):
        ledger.open_epoch(STREAM, number, 2, "stream")
    with pytest.raises(ProtocolError, match="epochs open"):
        ledger.recover_epoch(recover_header(epoch=MAX_OPEN_EPOCHS))
    assert MAX_OPEN_EPOCHS not in ledger.streams[STREAM].epochs
    ledger.recover_epoch(recover_header(epoch=3))          # an open epoch recovers as before
    assert ledger.streams[STREAM].epochs[3].recovery is not None
    # a resume at an open epoch forgets it and the later ones first: room enough
    ledger.recover_epoch(recover_header(epoch=MAX_OPEN_EPOCHS - 1, reset=True))


def test_a_stream_whose_delivered_epochs_make_max_delivered_runs_runs_opens_no_epoch_that_starts_another(
        monkeypatch):
    monkeypatch.setattr(partitions, "MAX_DELIVERED_RUNS", 3)
    ledger = Ledger()
    join(ledger, b"a", hello(), prefetch=1)
    for number in (0, 2, 4):                             # three runs: [0], [2], [4]
        ledger.open_epoch(STREAM, number, 0, "stream")
        ledger.close_epoch(STREAM, number, 0)
        Wire(ledger).dispatch()
    assert ledger.streams[STREAM].finished.delivered == 3
    with pytest.raises(ProtocolError, match="3 runs of consecutive numbers"):
        ledger.open_epoch(STREAM, 10, 0, "stream")
    for number in (1, 5, 6):                             # joins two runs, extends one, extends an open one
        ledger.open_epoch(STREAM, number, 0, "stream")


def test_consecutive_delivered_epochs_make_one_run_whether_or_not_they_keep_their_figures(monkeypatch):
    monkeypatch.setattr(partitions, "MAX_DELIVERED_RUNS", 2)
    ledger = Ledger()
    ledger.keep_epochs = 3
    join(ledger, b"a", hello(), prefetch=1)
    for number in range(8):                              # 0..4 folded into a range, 5..7 with their figures
        ledger.open_epoch(STREAM, number, 0, "stream")
        ledger.close_epoch(STREAM, number, 0)
        Wire(ledger).dispatch()
    ledger.open_epoch(STREAM, 20, 0, "stream")           # a second run


# ---- losses ---------------------------------------------------------------------------------------------------


def test_a_reclaim_naming_a_loss_longer_than_an_incarnation_is_refused_and_nothing_is_kept():
    ledger = Ledger()
    join(ledger, b"a", hello(session="a"))
    reclaim(ledger, b"a", 0, "f" * MAX_INCARNATION)
    with pytest.raises(ProtocolError, match=f"at most {MAX_INCARNATION} characters, got 30000"):
        reclaim(ledger, b"a", 0, "f" * 30000)
    assert list(ledger.streams[STREAM].reclaims[0]) == ["f" * MAX_INCARNATION]


def test_an_epoch_keeps_the_reclaims_of_at_most_max_losses_losses():
    ledger = Ledger()
    join(ledger, b"a", hello(session="a"))
    for loss in range(MAX_LOSSES):
        reclaim(ledger, b"a", 0, f"{loss:016x}")
    reclaim(ledger, b"a", 0, f"{0:016x}")                 # a loss it has: replaced, as before
    with pytest.raises(ProtocolError, match=f"RECLAIMs of {MAX_LOSSES} losses already"):
        reclaim(ledger, b"a", 0, "another")
    assert len(ledger.streams[STREAM].reclaims[0]) == MAX_LOSSES
    reclaim(ledger, b"a", 1, "another")                   # the limit is the epoch's


@pytest.mark.parametrize("lost, message", [
    (["x" * (MAX_INCARNATION + 1)], "strings of at most"),
    ([f"{n:x}" for n in range(MAX_LOSSES + 1)], f"at most {MAX_LOSSES} incarnations"),
    ([1], "strings of at most"),
])
def test_epoch_recover_refuses_long_or_too_many_or_mistyped_losses(lost, message):
    ledger = Ledger()
    with pytest.raises(ProtocolError, match=message):
        ledger.recover_epoch(recover_header(lost=lost))
    assert STREAM not in ledger.streams or not ledger.streams[STREAM].epochs


def test_losses_that_add_up_past_max_losses_are_refused_and_the_recovery_is_unchanged():
    ledger = Ledger()
    ledger.recover_epoch(recover_header(lost=[f"a{n}" for n in range(MAX_LOSSES - 1)]))
    ledger.recover_epoch(recover_header(lost=["a0", "b"]))          # one new: MAX_LOSSES
    with pytest.raises(ProtocolError, match=f"would wait for {MAX_LOSSES + 1} losses"):
        ledger.recover_epoch(recover_header(lost=["c"]))
    assert len(ledger.streams[STREAM].epochs[0].recovery.lost) == MAX_LOSSES
    with pytest.raises(ProtocolError, match="would wait for"):       # a resume waits for "" besides
        ledger.recover_epoch(recover_header(lost=[f"r{n}" for n in range(MAX_LOSSES)], reset=True))
    assert len(ledger.streams[STREAM].epochs[0].recovery.lost) == MAX_LOSSES


def test_a_recovery_carries_at_most_max_recovery_ranges_ranges(monkeypatch):
    monkeypatch.setattr(recovery, "MAX_RECOVERY_RANGES", 3)
    ledger = Ledger()
    ledger.recover_epoch(recover_header(partitions=100, carries=(0, 1, 2, 3, 4, 5), recovered=(0, 1)))
    with pytest.raises(ProtocolError, match="4 ranges of partitions, more than 3"):
        ledger.recover_epoch(recover_header(partitions=100, carries=(6, 7), recovered=()))
    assert ledger.streams[STREAM].epochs[0].recovery.carries.pairs() == [(0, 1), (2, 3), (4, 5)]
    ledger.recover_epoch(recover_header(partitions=100, carries=(1, 2), recovered=()))    # joins two: 2 ranges


def test_reclaims_past_max_reclaim_records_drop_the_oldest_epoch_not_recovering(monkeypatch, caplog):
    monkeypatch.setattr(recovery, "MAX_RECLAIM_RECORDS", 4)
    ledger = Ledger()
    join(ledger, b"a", hello(session="a"))
    reclaim(ledger, b"a", 0, "x")
    for n in range(4):
        ledger.join_rank(b"a", hello(session=f"s{n}"))      # the same connection, another session each time
        reclaim(ledger, b"a", 1, "x")
    assert sorted(ledger.streams[STREAM].reclaims) == [1]
    assert "reclaims of epoch 0 are dropped" in caplog.text


# ---- sessions and attempts ------------------------------------------------------------------------------------


def test_a_rank_whose_session_is_longer_than_max_session_is_refused_before_anything_changes():
    ledger = Ledger()
    join(ledger, b"a", hello(session="s" * MAX_SESSION))
    for grants in (None, True):
        with pytest.raises(ProtocolError, match=f"at most {MAX_SESSION} characters"):
            ledger.join_rank(b"b", hello(session="s" * 30000, grants=grants))
    assert list(ledger.ranks) == [b"a"]


def test_a_partition_keeps_at_most_max_attempts_attempts(monkeypatch):
    monkeypatch.setattr(partitions, "MAX_ATTEMPTS", 3)
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "stream")
    for attempt in range(3):
        push(ledger, 0, 0, 0, attempt=attempt)
    with pytest.raises(Rejected) as refused:
        push(ledger, 0, 0, 0, attempt=3)
    assert refused.value.reason == "refused" and "3 attempts" in str(refused.value)
    assert len(ledger.streams[STREAM].epochs[0].parts[0].attempts) == 3
    # PARTITION_ENDs waiting for their batches: at most as many attempts
    ledger.open_epoch(STREAM, 1, 1, "stream", commit="driver")
    for attempt in range(3):
        assert end(ledger, 1, 0, attempt, 5) == []
    with pytest.raises(ProtocolError, match="3 attempts waiting"):
        end(ledger, 1, 0, 3, 5)
    assert end(ledger, 1, 0, 0, 5) == []                  # an attempt already waiting may say it again


# ---- through the daemon: refused with REFUSED and counted ---------------------------------------------------


def test_the_daemon_answers_a_refusal_past_a_limit_with_its_reason_and_counts_it(start_broker_thread, sockets):
    broker = start_broker_thread()
    control = sockets(zmq.DEALER, broker.config.control)
    for number in range(MAX_OPEN_EPOCHS + 1):
        send(control, Kind.EPOCH_OPEN, req=number, stream=STREAM, epoch=number, partitions=0, delivery="stream")
        reply, _ = recv_header(control)
    assert reply["kind"] == Kind.ERROR and reply["code"] == ErrorCode.REFUSED and reply["req"] == MAX_OPEN_EPOCHS
    assert f"the most a stream may have ({MAX_OPEN_EPOCHS})" in reply["reason"]
    ranks = sockets(zmq.DEALER, broker.config.ranks)
    send(ranks, Kind.HELLO, **hello(session="s" * 1000))
    reply, _ = recv_header(ranks)
    assert reply["kind"] == Kind.ERROR and reply["code"] == ErrorCode.REFUSED
    ranks.send_multipart([protocol.pack_header(Kind.HELLO, **hello(session="ok", resume=True)), b"\0" * 23, b""])
    reply, _ = recv_header(ranks)            # id frames that are not whole ids: unreadable, as a RECLAIM's
    assert reply["kind"] == Kind.ERROR and reply["code"] == ErrorCode.MALFORMED
    send(ranks, Kind.HELLO, **hello(session="ok"))
    assert recv_header(ranks)[0]["kind"] == Kind.WELCOME
    ranks.send_multipart([protocol.pack_header(Kind.RECLAIM, stream=STREAM, epoch=0, lost="f" * 30000,
                                               entries=0), b""])
    reply, _ = recv_header(ranks)
    assert reply["kind"] == Kind.ERROR and reply["code"] == ErrorCode.REFUSED
    send(control, Kind.STATS_REQUEST, req=99)
    stats = recv_header(control)[0]["stats"]
    assert stats["broker"]["rejected"]["control"] == {"refused": 1}
    assert stats["broker"]["rejected"]["ranks"] == {"refused": 2, "malformed": 1}
    assert len(broker.streams[STREAM].epochs) == MAX_OPEN_EPOCHS
