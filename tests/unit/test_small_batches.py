"""Small batches at the speed of the wire: packs, byte windows and coalesced acknowledgements, in process."""

import threading

import numpy as np
import pytest
import zmq

from sparkbus.broker.state import MAX_WINDOW, RankState
from sparkbus.feeder.columns import pack_small
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import FakeBroker, Wire, feed, hello, joined, recv_header, send, send_hello


def batch(first, rows, width=4):
    return {"id": np.arange(first, first + rows), "x": np.zeros((rows, width), np.float32)}


# ---- packing on the feeder ----------------------------------------------------------------------------------

def test_small_batches_are_packed_up_to_the_pack_size_and_large_ones_go_alone():
    small = [batch(10 * i, 10) for i in range(7)]                   # 10 rows x 24 bytes = 240 bytes each
    out = list(pack_small(small + [batch(1000, 100)] + small[:2], pack_bytes=1000))
    # 240 < 1000 / 4: packed while the pack stays within 1,000 bytes (4 x 240), then the 2,400-byte batch alone
    assert [s for _, s in out] == [[10] * 4, [10] * 3, None, [10] * 2]
    np.testing.assert_array_equal(out[0][0]["id"], np.arange(40))
    assert out[0][0]["x"].shape == (40, 4)
    assert out[2][0]["id"][0] == 1000
    np.testing.assert_array_equal(np.concatenate([c["id"] for c, _ in out]),
                                  np.concatenate([b["id"] for b in small + [batch(1000, 100)] + small[:2]]))


def test_batches_under_half_the_pack_size_are_packed():
    # 12 rows x 24 bytes = 288 bytes: under half of 1,000 (packed, three to a pack), though over a quarter
    out = list(pack_small([batch(12 * i, 12) for i in range(3)], pack_bytes=1000))
    assert [s for _, s in out] == [[12, 12, 12]]
    assert [s for _, s in pack_small([batch(0, 21)] * 2, pack_bytes=1000)] == [None, None], "504 bytes: alone"


def test_packing_keeps_batches_of_another_kind_apart_and_can_be_off():
    mixed = [batch(0, 5), {"id": np.arange(5, 10)}, batch(10, 5)]
    assert [s for _, s in pack_small(mixed, pack_bytes=1 << 20)] == [None, None, None]
    assert [s for _, s in pack_small([batch(0, 5)] * 3, pack_bytes=0)] == [None, None, None]


def test_a_pack_header_must_split_its_rows_exactly():
    frames = codec.encode_batch("s", 0, 0, 0, batch(0, 10), splits=[4, 6])
    header = protocol.unpack_header(frames[0])
    assert header["splits"] == [4, 6]
    protocol.check_batch_frames(header, [len(f) for f in frames[1:]])
    for bad in ([4, 5], [], [11, -1], [4.0, 6]):
        with pytest.raises(ProtocolError, match="splits"):
            protocol.check_batch_frames(dict(header, splits=bad), [len(f) for f in frames[1:]])


# ---- the window ---------------------------------------------------------------------------------------------

def test_the_window_admits_by_batches_or_by_bytes_whichever_admits_more():
    rank = RankState(b"r", "s", 0, 1, window=2, window_bytes=1000)
    assert rank.has_room(5000)                       # fewer than 2 in flight: any size
    rank.inflight = {(0, 0, i): None for i in range(2)}
    rank.inflight_bytes = 600
    assert not rank.has_room(500) and rank.has_room(400)           # beyond 2: only what fits in the bytes
    rank.inflight = {(0, 0, i): None for i in range(MAX_WINDOW)}
    rank.inflight_bytes = 0
    assert not rank.has_room(1), "the byte budget admits at most MAX_WINDOW batches"


# ---- a rank against a broker it talks to over inproc --------------------------------------------------------

def consume(stream, out):
    out.extend(stream.epoch())


def test_a_rank_yields_a_packs_batches_one_by_one_and_acknowledges_the_pack_once(context):
    broker = FakeBroker(context, "inproc://pack-broker")
    with joined(broker, "inproc://pack-broker", context) as stream:
        assert (broker.window["window"], broker.window["window_bytes"]) == (4, 8 << 20)
        broker.send(codec.encode_batch("s", 0, 0, 0, batch(0, 10), splits=[3, 3, 4]))
        broker.send(codec.encode_batch("s", 0, 0, 1, batch(10, 5)))
        broker.end(0, 2)
        got = []
        for b in stream.epoch():
            got.append(b)
            if len(got) < 4:
                assert not broker.sock.poll(50), "an ACK before the pack's last batch was done with"
        assert [len(b["id"]) for b in got] == [3, 3, 4, 5]
        np.testing.assert_array_equal(np.concatenate([b["id"] for b in got]), np.arange(15))
        assert not got[0]["id"].flags.owndata, "a pack's batches are views of the received frame"
        first, second = broker.next(Kind.ACK), broker.next(Kind.ACK)
        assert (first["ids"], second["ids"]) == ([0, 0, 0], [0, 0, 1]), "the pack once, when its last batch was done"
        assert (first["consumed"], second["consumed"]) == (3, 4) and isinstance(second["wait_s"], float)
        epoch = stream.stats.epochs[-1]
        assert (epoch.batches, epoch.rows) == (4, 15)
        assert epoch.bytes == 15 * (8 + 16)


def test_an_ack_leaves_when_the_loop_asks_for_the_next_batch_and_a_skipped_rest_shares_one(context):
    broker = FakeBroker(context, "inproc://ack-broker")
    with joined(broker, "inproc://ack-broker", context) as stream:
        broker.send_epoch(0, [batch(seq, 1) for seq in range(300)])
        for n, _ in enumerate(stream.epoch()):
            if n == 1:              # the loop came back for batch 1: batch 0 is acknowledged, alone
                assert broker.next(Kind.ACK)["ids"] == [0, 0, 0]
            if n == 2:
                break
        assert broker.next(Kind.ACK)["ids"] == [0, 0, 1]
        # leaving the epoch acknowledges the batch in hand; the next epoch() skips the other 297 in two ACKs
        assert broker.next(Kind.ACK)["ids"] == [0, 0, 2]
        broker.send_epoch(1, [batch(0, 1)])
        assert len(list(stream.epoch())) == 1
        skipped = broker.next(Kind.ACK)["ids"]
        assert skipped[2::3] == list(range(3, 256 + 3)), "the skipped batches, in ACKs of at most 256 ids"
        assert broker.next(Kind.ACK)["ids"][2::3] == list(range(259, 300))
        assert stream.stats.skipped_batches == 297


def test_an_ack_with_ids_that_are_not_triples_is_refused(start_broker_thread, sockets):
    broker = start_broker_thread()
    rank = sockets(zmq.DEALER, broker.config.ranks)
    send_hello(rank, 0, 1, session="a")
    assert recv_header(rank)[0]["kind"] == Kind.WELCOME
    send(rank, Kind.ACK, ids=[0, 0])
    reply = recv_header(rank)[0]
    assert reply["kind"] == Kind.ERROR and "triples" in reply["reason"]


def test_a_rank_waiting_for_its_peers_keeps_what_the_broker_sends_for_later(context):
    broker = FakeBroker(context, "inproc://service-broker")
    with joined(broker, "inproc://service-broker", context) as stream:
        broker.send_epoch(0, [batch(seq, 1) for seq in range(3)])
        servicing = threading.Thread(target=stream._service)      # what a wait in an MPI collective calls
        servicing.start()
        servicing.join(5)
        assert not servicing.is_alive(), "servicing the connection did not return"
        assert [int(b["id"][0]) for b in stream.epoch()] == [0, 1, 2]


def test_until_every_rank_has_stated_its_window_ranks_get_batches_by_their_batch_window_only():
    from sparkbus.broker.ledger import Ledger

    ledger = Ledger()
    feed(ledger, 0, 1, 10)
    for r in (0, 1):
        ledger.join_rank(f"r{r}".encode(), hello(r, 2, even=True, session=f"session-{r}"))
    ledger.set_window(ledger.rank(b"r0"), 4, 1 << 20)          # room for all ten by bytes
    wire = Wire(ledger)
    wire.dispatch()
    assert len(wire.to(b"r0")) == 4 and not wire.to(b"r1"), "rank 0 took more than its batch window alone"
    ledger.set_window(ledger.rank(b"r1"), 4, 1 << 20)
    wire.dispatch()
    assert len(wire.to(b"r0")) + len(wire.to(b"r1")) == 10 and len(wire.to(b"r1")) >= 3
