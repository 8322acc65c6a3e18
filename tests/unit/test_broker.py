"""The broker's rules, in process: credits, commits, epoch ends, refusals. Real sockets over inproc://."""

import msgpack
import numpy as np
import pytest
import zmq

from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind

from harness import recv_header, send, send_hello, wait_for


@pytest.fixture
def bus(start_broker_thread, sockets, context):
    """A broker with a feeder (PUSH + control DEALER) connected; ranks are added per test."""
    broker = start_broker_thread(max_buffer=1 << 20)

    class Bus:
        pass

    bus = Bus()
    bus.broker = broker
    bus.context = context
    bus.push = sockets(zmq.PUSH, broker.config.feed)
    bus.control = sockets(zmq.DEALER, broker.config.control)
    bus.sockets = sockets

    def request(kind, **fields):
        if kind == Kind.EPOCH_OPEN:
            fields.setdefault("delivery", "stream")
        send(bus.control, kind, req=7, **fields)
        return recv_header(bus.control)[0]

    def push(epoch, part, seq, rows=4, stream="s", attempt=0, first_id=None):
        first = 1000 * part + 100 * seq if first_id is None else first_id
        bus.push.send_multipart(codec.encode_batch(stream, epoch, part, seq, {
            "id": np.arange(rows) + first}, attempt=attempt))

    def rank(rank=0, size=1, credit=0, stream="s", even=False):
        sock = sockets(zmq.DEALER, broker.config.ranks)
        send_hello(sock, rank, size, stream=stream, even=even, session=f"s{rank}-{id(sock)}")
        assert recv_header(sock)[0]["kind"] == Kind.WELCOME
        if credit:
            send(sock, Kind.CREDIT, window=credit, window_bytes=0)
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
    send(r, Kind.ACK, ids=[0, 0, 0])
    assert recv_header(r)[0]["seq"] == 2


def test_payload_frames_arrive_unchanged(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r = bus.rank(credit=1)
    sent = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(12, dtype=np.float32).reshape(6, 2)})
    bus.push.send_multipart(sent)
    header, frames = recv_header(r)
    assert [bytes(f) for f in frames] == [bytes(f) for f in sent[1:]]
    np.testing.assert_array_equal(codec.decode_batch(header, frames)["x"][:, 1], [1, 3, 5, 7, 9, 11])


def test_partition_commit_waits_for_its_batches(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    send(bus.control, Kind.PARTITION_END, req=8, stream="s", epoch=0, part=0, attempt=0, batches=2, rows=8)
    assert not bus.control.poll(200), "committed before the batches arrived"
    bus.push_batch(0, 0, 0)
    bus.push_batch(0, 0, 1)
    reply = recv_header(bus.control)[0]
    assert reply["kind"] == Kind.PARTITION_COMMITTED and reply["req"] == 8


def test_even_ranks_hear_the_epoch_end_once_all_is_sent(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=2)
    r0, r1 = bus.rank(0, 2, credit=10, even=True), bus.rank(1, 2, credit=10, even=True)
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


def test_independent_ranks_hear_the_epoch_end_once_all_is_acknowledged(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r = bus.rank(credit=10)
    bus.push_batch(0, 0, 0)
    bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=0, batches=1, rows=4)
    bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=1)
    assert recv_header(r)[0]["kind"] == Kind.BATCH
    assert not r.poll(300), "the epoch ended while a batch was unacknowledged"
    send(r, Kind.ACK, ids=[0, 0, 0])
    end = recv_header(r)[0]
    assert end["kind"] == Kind.EPOCH_END and end["batches"] == 1


def epoch_stats(bus, epoch="0"):
    return bus.request(Kind.STATS_REQUEST)["stats"]["streams"]["s"]["epochs"][epoch]


def test_duplicates_from_a_retried_attempt_are_dropped_and_counted(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r = bus.rank(credit=10)
    for seq, attempt in ((0, 0), (1, 0), (0, 1), (1, 1), (2, 1)):
        bus.push_batch(0, 0, seq, attempt=attempt)
    assert [recv_header(r)[0]["seq"] for _ in range(3)] == [0, 1, 2]
    assert not r.poll(200)
    reply = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=1, batches=3, rows=12)
    assert reply["kind"] == Kind.PARTITION_COMMITTED
    stats = epoch_stats(bus)
    assert stats["duplicates"] == 2 and stats["batches_in"] == 3 and stats["diverged"] == []


def test_the_same_attempt_sending_a_seq_twice_is_rejected(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    bus.push_batch(0, 0, 0)
    bus.push_batch(0, 0, 0)
    wait_for(lambda: bus.broker.stats()["broker"]["rejected"].get("feed", {}).get("replayed") == 1, 2,
             "the replayed batch to be rejected")
    assert bus.broker.stats()["streams"]["s"]["epochs"]["0"]["batches_in"] == 1


def test_a_retry_that_recomputes_differently_is_flagged_in_stream_delivery(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    bus.push_batch(0, 0, 0, attempt=0, first_id=0)
    bus.push_batch(0, 0, 0, attempt=1, first_id=50)       # same seq, other rows: Spark reordered them
    bus.push_batch(0, 0, 1, attempt=1, first_id=0)
    reply = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=1, batches=2, rows=8)
    assert reply["kind"] == Kind.PARTITION_COMMITTED
    closed = bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=1)
    assert closed["kind"] == Kind.OK and closed["diverged"] == [0]


def test_atomic_delivery_forwards_only_the_committed_attempt(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="atomic")
    r = bus.rank(credit=10)
    bus.push_batch(0, 0, 0, attempt=0, first_id=0)          # attempt 0 dies after one batch
    bus.push_batch(0, 0, 0, attempt=1, first_id=50)         # attempt 1 yields its rows in another order
    bus.push_batch(0, 0, 1, attempt=1, first_id=0)
    assert not r.poll(300), "atomic delivery forwarded an uncommitted batch"
    assert bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=1, batches=2,
                       rows=8)["kind"] == Kind.PARTITION_COMMITTED
    got = []
    for _ in range(2):
        header, frames = recv_header(r)
        assert header["attempt"] == 1
        got.extend(codec.decode_batch(header, frames)["id"])
    assert sorted(got) == list(range(4)) + list(range(50, 54))
    assert not r.poll(200)
    stats = bus.broker.stats()
    assert stats["streams"]["s"]["epochs"]["0"]["diverged"] == [0]
    assert stats["broker"]["buffered_bytes"] == sum(len(f) for f in codec.encode_batch(
        "s", 0, 0, 0, {"id": np.arange(4)}, attempt=1)) * 2     # attempt 0's copy was released


def test_a_rank_that_leaves_gives_back_its_unacknowledged_batches(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    r0 = bus.rank(0, 2, credit=2)
    r1 = bus.rank(1, 2, credit=0)
    for seq in range(2):
        bus.push_batch(0, 0, seq)
    assert [recv_header(r0)[0]["seq"] for _ in range(2)] == [0, 1]
    send(r0, Kind.ACK, ids=[0, 0, 0])
    send(r0, Kind.BYE)
    send(r1, Kind.CREDIT, window=5, window_bytes=0)
    assert recv_header(r1)[0]["seq"] == 1, "the unacknowledged batch went to the other rank"
    assert not r1.poll(200)


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
    send_hello(other, 0, 3, session="x")
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
        bus.push.send_multipart(codec.encode_batch("s", 0, 0, seq, {"x": np.zeros(1 << 16)}))
    stats = wait_for(lambda: (s := bus.broker.stats())["broker"]["feed_paused"] and s, 2, "the feed to pause")
    assert (1 << 20) <= stats["broker"]["buffered_bytes"] < (1 << 20) + (1 << 19) + 1024
    r = bus.rank(credit=100)
    for seq in range(8):
        header, _ = recv_header(r)
        assert header["seq"] == seq
        send(r, Kind.ACK, ids=[0, 0, seq])


def test_a_loop_that_breaks_out_of_an_epoch_can_go_on_with_the_next(bus):
    """Leaving an epoch early acknowledges the batch in hand; the next epoch() skips the rest of the old one."""
    from sparkbus.worker import BatchStream

    for epoch in (0, 1):
        bus.request(Kind.EPOCH_OPEN, stream="s", epoch=epoch, partitions=1)
        for seq in range(5):
            bus.push_batch(epoch, 0, seq, first_id=100 * epoch + 10 * seq)
        bus.request(Kind.PARTITION_END, stream="s", epoch=epoch, part=0, attempt=0, batches=5, rows=20)
        bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=epoch, partitions=1)
    with BatchStream(bus.broker.config.ranks, stream="s", timeout=5, prefetch=2, context=bus.context) as stream:
        for batch in stream.epoch():
            assert batch["id"][0] == 0
            break
        firsts = [int(batch["id"][0]) for batch in stream.epoch()]
        assert firsts == [100, 110, 120, 130, 140]
        assert stream.stats.skipped_batches == 4


def test_a_second_driver_refeeding_a_half_fed_epoch_is_checked_like_a_retry(bus):
    """Spark numbers attempts from 0 in every job; the feed run in the attempt identity keeps runs apart."""
    from sparkbus.feeder.task import attempt_id

    first, second = attempt_id(1, 0), attempt_id(2, 0)
    assert first != second and first & 0xFFFF == second & 0xFFFF == 0
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1)
    for seq in range(2):                                        # the first driver died after two batches
        bus.push_batch(0, 0, seq, attempt=first, first_id=10 * seq)
    for seq in range(4):                                        # the second recomputed them in another order
        bus.push_batch(0, 0, seq, attempt=second, first_id=10 * (3 - seq))
    assert bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=second, batches=4,
                       rows=16)["kind"] == Kind.PARTITION_COMMITTED
    stats = bus.broker.stats()
    assert stats["broker"]["rejected"].get("feed", {}).get("replayed") is None
    assert stats["streams"]["s"]["epochs"]["0"]["duplicates"] == 2
    assert stats["streams"]["s"]["epochs"]["0"]["diverged"] == [0]


def test_each_error_reply_carries_the_code_clients_act_on(bus):
    """Clients decide on ``code`` (protocol.ErrorCode), never on the words of ``reason``."""
    from sparkbus.wire.protocol import ErrorCode

    ranks = bus.broker.config.ranks
    stranger = bus.sockets(zmq.DEALER, ranks)
    send(stranger, Kind.ACK, ids=[0, 0, 0])                       # a connection that never said HELLO
    assert recv_header(stranger)[0]["code"] == ErrorCode.UNKNOWN_RANK
    bus.rank(0, 2)
    other = bus.sockets(zmq.DEALER, ranks)                        # another process asks for rank 0
    send_hello(other, 0, 2, session="other", req=3)
    reply = recv_header(other)[0]
    assert (reply["kind"], reply["req"], reply["code"]) == (Kind.ERROR, 3, ErrorCode.ALREADY_CONNECTED)
    assert bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=9, partitions=1)["code"] == ErrorCode.REFUSED
    assert bus.request(Kind.CREDIT, window=1, window_bytes=0)["code"] == ErrorCode.UNEXPECTED_KIND
    bus.control.send(b"\xc1")
    assert recv_header(bus.control)[0]["code"] == ErrorCode.MALFORMED
    bus.control.send(msgpack.packb({"v": protocol.SUPPORTED[0] - 1, "kind": int(Kind.STATS_REQUEST), "req": 1}))
    assert recv_header(bus.control)[0]["code"] == ErrorCode.VERSION


def test_a_broker_error_carries_the_code_of_the_refusal(bus):
    from sparkbus.broker.client import ControlClient
    from sparkbus.wire.errors import BrokerError
    from sparkbus.wire.protocol import ErrorCode

    with ControlClient(bus.broker.config.control, timeout=5, context=bus.context) as client:
        with pytest.raises(BrokerError) as refused:
            client.request(Kind.EPOCH_CLOSE, stream="s", epoch=3, partitions=1)
    assert refused.value.code is ErrorCode.REFUSED
