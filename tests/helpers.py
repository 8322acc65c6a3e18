"""Helpers shared by the unit and integration tests: bounded waits, free loopback ports, a stand-in broker."""

from __future__ import annotations

import socket
import threading
import time

import zmq

from broker.protocol import Kind, pack_header, unpack_header
from launch.processes import wait_for

# wait_for: the tests' bounded wait, the one the benchmark and the demo use (WaitTimeout says what it awaited)
__all__ = ["FakeBroker", "free_port_triple", "joined", "recv_header", "send", "wait_for"]


def free_port_triple() -> int:
    """A port P on 127.0.0.1 with P, P+1 and P+2 free (feed, ranks, derived control)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 65530:
            continue
        held = []
        try:
            for port in (base, base + 1, base + 2):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no three consecutive free ports on 127.0.0.1")


def recv_header(sock, timeout=2.0, heartbeats=False):
    """The next header on ``sock`` (and the frames after it), heartbeats skipped; fails instead of hanging."""
    deadline = time.monotonic() + timeout
    while True:
        assert sock.poll(max(deadline - time.monotonic(), 0) * 1000), "no message within the timeout"
        frames = sock.recv_multipart()
        header = unpack_header(frames[0])
        if heartbeats or header["kind"] != Kind.HEARTBEAT:
            return header, frames[1:]


def send(sock, kind, **fields):
    sock.send(pack_header(kind, **fields))


class FakeBroker:
    """A ROUTER standing in for the broker: it welcomes one rank, sends what it is told, and records ACKs."""

    def __init__(self, context, address):
        self.sock = context.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(address)
        self.acks: list[list[int]] = []
        self.window = None

    def welcome(self):
        assert self.sock.poll(5000), "no HELLO from the rank"
        identity, raw = self.sock.recv_multipart()
        hello = unpack_header(raw)
        self.identity = identity
        self.sock.send_multipart([identity, pack_header(
            Kind.WELCOME, req=hello["req"], broker="fake", incarnation="x", journal=False, free=0)])
        self.window = self.next(Kind.CREDIT)

    def next(self, kind, timeout=5.0):
        while True:
            assert self.sock.poll(timeout * 1000), f"no {kind.name} from the rank"
            identity, raw, *_ = self.sock.recv_multipart()
            header = unpack_header(raw)
            if header["kind"] == kind:
                return header

    def send(self, frames):
        self.sock.send_multipart([self.identity, *frames])

    def end(self, epoch, batches):
        self.send([pack_header(Kind.EPOCH_END, stream="s", epoch=epoch, batches=batches)])


def joined(broker, address, context, **options):
    """A BatchStream (``options`` passed on) whose HELLO the fake broker answers (from a thread: the
    constructor waits for WELCOME)."""
    from worker import BatchStream

    welcomer = threading.Thread(target=broker.welcome)
    welcomer.start()
    stream = BatchStream(address, stream="s", timeout=10, context=context, **options)
    welcomer.join(10)
    return stream
