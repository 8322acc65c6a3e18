"""Hostile and broken input on every socket of a real broker process: refused or dropped, counted, harmless."""

import socket
import threading

import msgpack
import numpy as np
import pytest
import zmq

from sparkbus.feeder import feed
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import ErrorCode, Kind
from sparkbus.worker import BatchStream

from harness import hello, wait_for
from sources import labelled_frame

pytestmark = pytest.mark.timeout(120)

OVERSIZED = msgpack.packb({"v": protocol.VERSION, "kind": int(Kind.HEARTBEAT), "pad": "x" * 70_000})
WRONG_VERSION = msgpack.packb({"v": 99, "kind": int(Kind.HELLO), **hello()})
UNKNOWN_KIND = msgpack.packb({"v": protocol.VERSION, "kind": 77, "req": 1})
GARBAGE = b"\xde\xad\xbe\xef not msgpack"
BAD_MESSAGES = {"garbage": [GARBAGE], "version": [WRONG_VERSION], "oversized": [OVERSIZED],
                "unknown_kind": [UNKNOWN_KIND], "extra_frames": [GARBAGE, b"second", b"third"]}


def dealer(ctx, address):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(address)
    return sock


def reply_to(sock, frames):
    sock.send_multipart(frames)
    assert sock.poll(5000), "the broker did not answer"
    return protocol.unpack_header(sock.recv())


@pytest.mark.parametrize("socket_name", ["control", "ranks"])
def test_request_sockets_answer_bad_messages_with_a_reason(start_broker_process, sockets, socket_name):
    broker = start_broker_process()
    sock = sockets(zmq.DEALER, getattr(broker, socket_name))
    reasons = {name: reply_to(sock, frames) for name, frames in BAD_MESSAGES.items()}
    assert all(r["kind"] == Kind.ERROR for r in reasons.values())
    assert "not valid msgpack" in reasons["garbage"]["reason"]
    assert (f"protocol version mismatch: peer speaks 99, this side speaks {protocol.SUPPORTED[0]} and "
            f"{protocol.VERSION}" in reasons["version"]["reason"])
    assert "exceeds the limit" in reasons["oversized"]["reason"]
    assert "unknown message kind 77" in reasons["unknown_kind"]["reason"]
    assert "expected one header frame, got 3 frames" in reasons["extra_frames"]["reason"]
    # a well-formed message of a kind this socket does not take
    wrong_place = reply_to(sock, [protocol.pack_header(Kind.CREDIT, window=1, window_bytes=0)])
    assert wrong_place["kind"] == Kind.ERROR
    rejected = broker.stats()["broker"]["rejected"][socket_name]
    expected = {"malformed": 4, "version": 1}
    if socket_name == "control":
        expected["unexpected_kind"] = 1
    else:
        expected["refused"] = 1          # CREDIT before HELLO
    assert rejected == expected


def test_a_reclaim_with_the_wrong_frames_is_malformed(start_broker_process, sockets):
    broker = start_broker_process()
    sock = sockets(zmq.DEALER, broker.ranks)
    assert reply_to(sock, [protocol.pack_header(Kind.HELLO, **hello(session="s0"))])["kind"] == Kind.WELCOME
    header = protocol.pack_header(Kind.RECLAIM, stream="s", epoch=0, lost="x", entries=1)
    entry = protocol.pack_used([(0, 0, 0, 1, 9)])
    replies = [reply_to(sock, frames) for frames in ([header], [header, entry, entry], [header, entry[:-1]])]
    assert [(r["kind"], r["code"]) for r in replies] == [(Kind.ERROR, ErrorCode.MALFORMED)] * 3
    assert "got 3 frames" in replies[1]["reason"] and "used-batch entries" in replies[2]["reason"]
    assert broker.stats()["broker"]["rejected"]["ranks"] == {"malformed": 3}


def test_feed_socket_drops_and_counts_bad_batches(start_broker_process, sockets):
    broker = start_broker_process()
    push = sockets(zmq.PUSH, broker.feed)
    good = codec.encode_batch("s", 0, 0, 0, {"x": np.zeros(4)})
    for frames in BAD_MESSAGES.values():
        push.send_multipart(frames)
    push.send_multipart([good[0], b"short"])                                     # frame size mismatch
    push.send_multipart([protocol.pack_header(Kind.CREDIT, window=1, window_bytes=0)])          # not a batch
    push.send_multipart(good)                                                    # no such epoch
    rejected = wait_for(lambda: (r := broker.stats()["broker"]["rejected"].get("feed")) and sum(r.values()) == 8
                        and r, 10, "eight rejections on the feed socket")
    assert rejected == {"malformed": 6, "version": 1, "unknown_epoch": 1}


def test_raw_tcp_garbage_and_oversized_messages_leave_valid_traffic_intact(spark, start_broker_process, context,
                                                                           sockets):
    broker = start_broker_process("--max-message", "1MiB")
    for address in (broker.feed, broker.ranks, broker.control):           # not even ZMTP
        host, port = address.removeprefix("tcp://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)) * 64)
    push = sockets(zmq.PUSH, broker.feed)
    push.send_multipart([protocol.pack_header(Kind.HEARTBEAT), b"\0" * (2 << 20)])   # over MAXMSGSIZE
    hostile = threading.Event()

    def keep_sending_garbage():
        sock = dealer(context, broker.ranks)             # made, used and closed in this thread
        while not hostile.is_set():
            sock.send_multipart([GARBAGE])
            if sock.poll(10):
                sock.recv_multipart()
        sock.close(linger=0)

    noise = threading.Thread(target=keep_sending_garbage)
    noise.start()
    received = []
    try:
        with BatchStream(broker.ranks, stream="valid", timeout=30) as stream:
            consumer = threading.Thread(target=lambda: received.extend(b["id"].copy() for b in stream.epoch()))
            consumer.start()
            report = feed(labelled_frame(spark, 3_000, 3), broker.feed, stream="valid", batch_size=200)
            consumer.join(60)
    finally:
        hostile.set()
        noise.join(10)
    assert report.rows == 3_000
    np.testing.assert_array_equal(np.sort(np.concatenate(received)), np.arange(3_000))
    assert broker.stats()["broker"]["rejected"]["ranks"]["malformed"] > 0
    assert broker.proc.poll() is None
