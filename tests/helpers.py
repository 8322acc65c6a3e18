"""Helpers shared by the unit and integration tests: bounded waits and free loopback ports."""

from __future__ import annotations

import socket
import time

from broker.protocol import Kind, pack_header, unpack_header
from launch.processes import wait_for

# wait_for: the tests' bounded wait, the one the benchmark and the demo use (WaitTimeout says what it awaited)
__all__ = ["free_port_triple", "recv_header", "send", "wait_for"]


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
