"""The broker's rules, in process: credits, commits, epoch ends, refusals. Real sockets over inproc://."""

import numpy as np
import pytest
import zmq

from broker import protocol
from broker.protocol import Kind
from conftest import recv_header, send
from helpers import wait_for


@pytest.fixture
def bus(start_broker, sockets):
    """A broker with a feeder (PUSH + control DEALER) connected; ranks are added per test."""
    broker = start_broker(max_buffer=1 << 20)

    class Bus:
        pass

    bus = Bus()
    bus.broker = broker
    bus.push = sockets(zmq.PUSH, broker.config.feed)
    bus.control = sockets(zmq.DEALER, broker.config.control)
    bus.sockets = sockets

    def request(kind, **fields):
        send(bus.control, kind, req=7, **fields)
        return recv_header(bus.control)[0]

    def push(epoch, part, seq, rows=4, stream="s"):
        bus.push.send_multipart(protocol.encode_batch(stream, epoch, part, seq, {
            "id": np.arange(rows) + 1000 * part + 100 * seq}))

    def rank(rank=0, size=1, credit=0, stream="s"):
        sock = sockets(zmq.DEALER, broker.config.ranks)
        send(sock, Kind.HELLO, req=1, role="rank", stream=stream, rank=rank, size=size)
        assert recv_header(sock)[0]["kind"] == Kind.WELCOME
        if credit:
            send(sock, Kind.CREDIT, credit=credit)
        return sock

    bus.request, bus.push_batch, bus.rank = request, push, rank
    return bus


def test_batches_go_only_against_credit(bus):
    assert bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)["kind"] == Kind.OK
    r = bus.rank(credit=2)
    for seq in range(5):
        bus.push_batch(0, 0, seq)
    first = [recv_header(r)[0] for _ in range(2)]
    assert [h["seq"] for h in first] == [0, 1]
    assert not r.poll(200), "a batch came without credit"
    send(r, Kind.ACK, ids=[[0, 0, 0]], credit=1)
    assert recv_header(r)[0]["seq"] == 2


def test_payload_frames_arrive_unchanged(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r = bus.rank(credit=1)
    sent = protocol.encode_batch("s", 0, 0, 0, {"x": np.arange(12, dtype=np.float32).reshape(6, 2)})
    bus.push.send_multipart(sent)
    header, frames = recv_header(r)
    assert [bytes(f) for f in frames] == [bytes(f) for f in sent[1:]]
    np.testing.assert_array_equal(protocol.decode_batch(header, frames)["x"][:, 1], [1, 3, 5, 7, 9, 11])


def test_partition_commit_waits_for_its_batches(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    send(bus.control, Kind.PARTITION_END, req=8, stream="s", epoch=0, part=0, attempt=0, batches=2, rows=8)
    assert not bus.control.poll(200), "committed before the batches arrived"
    bus.push_batch(0, 0, 0)
    bus.push_batch(0, 0, 1)
    reply = recv_header(bus.control)[0]
    assert reply["kind"] == Kind.PARTITION_COMMITTED and reply["req"] == 8


def test_epoch_ends_after_close_and_drain_with_counts(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=2)
    r0, r1 = bus.rank(0, 2, credit=10), bus.rank(1, 2, credit=10)
    for part in range(2):
        for seq in range(3):
            bus.push_batch(0, part, seq)
        assert bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=part, attempt=0, batches=3,
                           rows=12)["kind"] == Kind.PARTITION_COMMITTED
    assert bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=2)["kind"] == Kind.OK
    ids = []
    for r in (r0, r1):
        while True:
            h, _ = recv_header(r)
            if h["kind"] == Kind.EPOCH_END:
                assert h["epoch"] == 0 and h["batches"] == 6
                break
            ids.append(protocol.batch_id(h))
    assert sorted(ids) == [(0, p, s) for p in range(2) for s in range(3)]


def test_duplicates_from_a_retried_attempt_are_dropped_and_counted(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r = bus.rank(credit=10)
    for seq in (0, 1, 0, 1):
        bus.push_batch(0, 0, seq)
    assert [recv_header(r)[0]["seq"] for _ in range(2)] == [0, 1]
    assert not r.poll(200)
    stats = wait_for(lambda: bus.request(Kind.STATS_REQUEST)["stats"]["streams"]["s"]["epochs"]["0"], 2,
                     "stats")
    assert stats["duplicates"] == 2 and stats["batches_in"] == 2


def test_close_with_missing_partitions_is_refused(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=3)
    reply = bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=3)
    assert reply["kind"] == Kind.ERROR and "0 of 3 partitions committed" in reply["reason"]


def test_commit_with_the_wrong_count_is_refused(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    bus.push_batch(0, 0, 0)
    bus.push_batch(0, 0, 1)
    wait_for(lambda: bus.broker.stats()["streams"]["s"]["epochs"]["0"]["batches_in"] == 2, 2, "two batches in")
    reply = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=0, batches=1, rows=4)
    assert reply["kind"] == Kind.ERROR and "holds 2 batches" in reply["reason"]


def test_a_delivered_epoch_cannot_be_reopened(bus):
    bus.rank(credit=1)
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=0)
    bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=0)
    wait_for(lambda: "0" in bus.broker.stats()["streams"]["s"]["epochs"], 2, "epoch 0 recorded")
    wait_for(lambda: bus.broker.stats()["streams"]["s"]["epochs"]["0"]["ended"], 2, "epoch 0 ended")
    reply = bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=0)
    assert reply["kind"] == Kind.ERROR and "already delivered epoch 0" in reply["reason"]


def test_ranks_of_another_communicator_size_are_refused(bus):
    bus.rank(0, 2)
    other = bus.sockets(zmq.DEALER, bus.broker.config.ranks)
    send(other, Kind.HELLO, req=1, role="rank", stream="s", rank=0, size=3)
    reply = recv_header(other)[0]
    assert reply["kind"] == Kind.ERROR and "consumed by 2 ranks" in reply["reason"]


def test_nothing_is_sent_until_every_rank_has_joined(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r0 = bus.rank(0, 2, credit=4)
    bus.push_batch(0, 0, 0)
    assert not r0.poll(200), "a batch went out before rank 1 joined"
    r1 = bus.rank(1, 2, credit=4)
    poller = zmq.Poller()
    for r in (r0, r1):
        poller.register(r, zmq.POLLIN)
    ready = dict(poller.poll(2000))
    assert len(ready) == 1, "the batch should reach exactly one rank once both joined"
    assert protocol.batch_id(recv_header(next(iter(ready)))[0]) == (0, 0, 0)


def test_feed_stops_being_read_at_the_buffer_bound(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    for seq in range(8):     # 8 x 512 KiB against a 1 MiB bound
        bus.push.send_multipart(protocol.encode_batch("s", 0, 0, seq, {"x": np.zeros(1 << 16)}))
    stats = wait_for(lambda: (s := bus.broker.stats())["broker"]["feed_paused"] and s, 2, "the feed to pause")
    assert (1 << 20) <= stats["broker"]["buffered_bytes"] < (1 << 20) + (1 << 19) + 1024
    r = bus.rank(credit=100)
    for seq in range(8):
        header, _ = recv_header(r)
        assert header["seq"] == seq
        send(r, Kind.ACK, ids=[[0, 0, seq]], credit=1)
