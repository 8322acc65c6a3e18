"""Even ranks agree in rounds, and start the next round's agreement before the last step of a round.

One real rank (a BatchStream against a stand-in broker over inproc) and a scripted peer: a communicator whose
``Iallreduce(MIN)`` takes the smaller of this rank's value and the peer's next one, and records what was
posted and how many batches the loop had been given by then.
"""

import threading
import time

import numpy as np
import pytest

from sparkbus.wire import codec
from sparkbus.wire.protocol import Kind
from sparkbus.worker.steps import ROUND_BATCHES

from harness import FakeBroker, joined


class Request:
    """Completes on its second ``Test``, so that every wait really waits."""

    def __init__(self):
        self.tests = 0

    def Test(self):
        self.tests += 1
        return self.tests >= 2


class ScriptedPeer:
    """A 2-rank communicator seen from rank 0; the peer's counts come from ``mins`` and ``gathers``."""

    rank = 0

    def __init__(self, mins, gathers):
        self.mins, self.gathers = list(mins), list(gathers)
        self.posted: list[tuple[int, int]] = []       # (value, batches the loop had been given)
        self.requests: list[Request] = []
        self.given = 0

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def _request(self):
        self.requests.append(Request())
        return self.requests[-1]

    def Iallreduce(self, send, recv, op=None):
        self.posted.append((int(send[0]), self.given))
        recv[0] = min(int(send[0]), self.mins.pop(0))
        return self._request()

    def Iallgather(self, send, recv):
        if recv.ndim == 2:        # the remainder's rows (worker.rebalance.share_remainder): the peer holds none
            recv[0] = send
            recv[1] = [send[0]] + [-1] * (len(send) - 1)
        else:
            recv[:] = [int(send[0]), self.gathers.pop(0)]
        return self._request()


def batch(seq):
    return {"id": np.array([seq]), "x": np.full((1, 2), seq, np.float32)}


def acknowledged(broker, count):
    """The ids of the rank's next ACKs, until ``count`` different ones have come."""
    acked = set()
    while len(acked) < count:
        ids = broker.next(Kind.ACK)["ids"]
        acked |= {tuple(ids[i:i + 3]) for i in range(0, len(ids), 3)}
    return acked


@pytest.fixture
def twenty_batches(context):
    broker = FakeBroker(context, "inproc://even-broker")

    def start(peer, **options):
        stream = joined(broker, "inproc://even-broker", context, comm=peer, even=True, steps="mpi",
                        abort_on_error=False, **options)
        for seq in range(20):
            broker.send(codec.encode_batch("s", 0, 0, seq, batch(seq)))
        broker.end(0, 20)
        return stream, broker

    return start


def test_the_next_rounds_agreement_is_posted_before_the_last_step_of_a_long_round(twenty_batches):
    # the peer holds 12, then 8 beyond that, then nothing more; at the end it holds nothing either
    peer = ScriptedPeer(mins=[12, 8, 0], gathers=[0])
    stream, _ = twenty_batches(peer)
    with stream:
        got = []
        for b in stream.epoch():
            got.append(int(b["id"][0]))
            peer.given += 1
    assert got == list(range(20))
    # (20 held, before any step): 12 steps, a long round: before its 12th step, 8 held beyond it: 8 steps, a
    # round of ROUND_BATCHES, which agrees at its end: 0 (the epoch ended) ends the rounds
    assert ROUND_BATCHES == 8
    assert peer.posted == [(20, 0), (8, 11), (0, 20)]
    assert all(r.tests >= 2 for r in peer.requests), "every agreement was completed"
    ep = stream.stats.epochs[-1]
    assert (ep.batches, ep.dropped_batches) == (20, 0)


def test_a_loop_that_leaves_while_an_agreement_is_posted_completes_it_and_skips_what_it_held(twenty_batches):
    peer = ScriptedPeer(mins=[12, 8, 2, 0], gathers=[0])
    stream, broker = twenty_batches(peer)
    with stream:
        for n, _ in enumerate(stream.epoch()):
            peer.given += 1
            if n == 11:                 # the round's last step: the next agreement is already posted
                assert len(peer.posted) == 2 and peer.requests[-1].tests == 0
                break
        assert peer.posted == [(20, 0), (8, 11)]
        assert peer.requests[-1].tests >= 2, "the posted agreement was completed when the loop left"
        assert stream.stats.epochs[-1].batches == 12
        # the 8 batches the round had taken in are skipped and acknowledged by the next epoch, not lost
        broker.send(codec.encode_batch("s", 1, 0, 0, batch(100)))
        broker.send(codec.encode_batch("s", 1, 0, 1, batch(101)))
        broker.end(1, 2)
        assert [int(b["id"][0]) for b in stream.epoch()] == [100, 101]
        assert stream.stats.skipped_batches == 8
        assert acknowledged(broker, 22) == {(0, 0, seq) for seq in range(20)} | {(1, 0, 0), (1, 0, 1)}


@pytest.mark.timeout(10)     # the linger is 30 s here: the epoch's end must cut it short
def test_a_rank_short_of_data_holds_on_for_a_round_or_the_epochs_end_before_it_agrees(context, monkeypatch):
    from sparkbus.worker import steps

    monkeypatch.setattr(steps, "ROUND_LINGER", 30.0)      # only a round's worth or the end frees it
    broker = FakeBroker(context, "inproc://even-short")
    peer = ScriptedPeer(mins=[4, 0], gathers=[0])
    stream = joined(broker, "inproc://even-short", context, comm=peer, even=True, steps="mpi", abort_on_error=False)
    with stream:
        broker.send(codec.encode_batch("s", 0, 0, 0, batch(0)))

        def trickle():
            for seq in (1, 2, 3):
                broker.send(codec.encode_batch("s", 0, 0, seq, batch(seq)))
            broker.end(0, 4)

        late = threading.Timer(0.2, trickle)
        late.start()
        got = [int(b["id"][0]) for b in stream.epoch()]
        late.join()
    assert got == [0, 1, 2, 3]
    assert peer.posted[0] == (4, 0), "the first agreement waited for the epoch's end, not agreeing on 1"


def test_a_batch_left_over_at_the_epochs_end_is_dropped_counted_and_acknowledged(twenty_batches):
    # 12 steps, then 7 (the peer holds one fewer than this rank), then the peer has nothing: one batch is left here,
    # and none on the peer, so the share-out keeps 0 each and drops it
    dropped = []
    peer = ScriptedPeer(mins=[12, 7, 0], gathers=[0])
    stream, broker = twenty_batches(peer, on_drop=dropped.append, remainder="drop")
    with stream:
        got = []
        for b in stream.epoch():
            got.append(int(b["id"][0]))
            peer.given += 1
        assert got == list(range(19)) and [int(b["id"][0]) for b in dropped] == [19]
        assert peer.posted == [(20, 0), (8, 11), (1, 19)]
        ep = stream.stats.epochs[-1]
        assert (ep.batches, ep.rows, ep.dropped_batches, ep.dropped_rows) == (19, 19, 1, 1)
        assert acknowledged(broker, 20) == {(0, 0, seq) for seq in range(20)}, "the dropped batch is acknowledged too"


def test_a_wait_during_the_share_out_is_counted_once(context, monkeypatch):
    """The share-out at the epoch's end reads the rest of the epoch before the ranks exchange what they hold: the
    wait for it is data-wait, counted once (it was counted again in the share-out's own span)."""
    from sparkbus.worker import steps

    monkeypatch.setattr(steps, "ROUND_LINGER", 0.0)
    broker = FakeBroker(context, "inproc://even-share-out")
    peer = ScriptedPeer(mins=[0], gathers=[0])          # the peer has nothing: the share-out comes at once
    dropped = []
    stream = joined(broker, "inproc://even-share-out", context, comm=peer, even=True, steps="mpi",
                    abort_on_error=False, remainder="drop", on_drop=dropped.append)
    with stream:
        first = threading.Timer(0.3, lambda: broker.send(codec.encode_batch("s", 0, 0, 0, batch(0))))
        end = threading.Timer(0.8, lambda: broker.end(0, 1))
        first.start()
        end.start()
        got = list(stream.epoch())
        first.join()
        end.join()
        ep = stream.stats.epochs[-1]
    assert got == [] and [int(b["id"][0]) for b in dropped] == [0]
    assert 0.6 <= ep.wait_seconds <= ep.seconds, (ep.wait_seconds, ep.seconds)


class SlowFirstAgreement(ScriptedPeer):
    """Its first ``Iallreduce`` completes only ``slow`` seconds after it was posted: a peer still at its step."""

    def __init__(self, mins, gathers, slow):
        super().__init__(mins, gathers)
        self.slow = slow

    def Iallreduce(self, send, recv, op=None):
        request = super().Iallreduce(send, recv, op)
        if len(self.posted) == 1:
            until = time.monotonic() + self.slow
            request.Test = lambda: time.monotonic() >= until
        return request


def test_a_rank_waiting_for_its_peers_in_an_agreement_tells_the_wait_at_each_heartbeat(context, monkeypatch):
    """With steps agreed over MPI too, the brokers hear of a long wait while it lasts, as a wait for peers."""
    from sparkbus.worker import steps

    monkeypatch.setattr(steps, "ROUND_LINGER", 0.0)
    broker = FakeBroker(context, "inproc://even-heartbeat")
    peer = SlowFirstAgreement(mins=[0], gathers=[2], slow=1.5)
    stream = joined(broker, "inproc://even-heartbeat", context, comm=peer, even=True, steps="mpi",
                    abort_on_error=False, heartbeat=0.2)
    for seq in range(2):
        broker.send(codec.encode_batch("s", 0, 0, seq, batch(seq)))
    broker.end(0, 2)
    told: list[tuple[float, float]] = []

    def listen():                    # the broker's socket is this thread's from here on
        deadline = time.monotonic() + 10
        while len(told) < 3 and time.monotonic() < deadline:
            heartbeat = broker.next(Kind.HEARTBEAT)
            if heartbeat.get("peer_wait_s", 0) > 0:
                told.append((heartbeat["wait_s"], heartbeat["peer_wait_s"]))

    listener = threading.Thread(target=listen)
    listener.start()
    with stream:
        got = [int(b["id"][0]) for b in stream.epoch()]
        listener.join(15)
        ep = stream.stats.epochs[-1]
    assert got == [0, 1]
    assert len(told) == 3 and told == sorted(told), told             # told three times, growing, while it lasted
    assert all(peers <= wait for wait, peers in told), told
    assert ep.peer_wait_seconds >= 1.4 and ep.wait_seconds >= ep.peer_wait_seconds
