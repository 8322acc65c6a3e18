"""ZeroMQ for the tests: a context that fails the test which leaves a socket open, connected sockets closed after
the test, free loopback ports, and bounded receives."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import zmq

from sparkbus.wire.protocol import Kind, pack_header, unpack_header

TERM_SECONDS = 5.0      # a context whose sockets are all closed terminates at once; this only bounds a hang
HARNESS = str(Path(__file__).parent) + os.sep


class TrackedContext(zmq.Context):
    """A :class:`zmq.Context` that keeps every socket made from it (strongly: a leaked socket is not collected
    and closed behind the test's back), with where it was made."""

    made: list   # class-level declarations: zmq.Context treats other attribute names as context options
    harness: set

    def __init__(self) -> None:
        super().__init__()
        self.made = []
        self.harness = set()

    def _add_socket(self, socket: Any) -> None:
        super()._add_socket(socket)
        self.made.append((socket, _caller()))

    def harness_socket(self, kind: int) -> zmq.Socket:
        """A socket (linger 0) the harness closes itself: not a leak of the code under test."""
        sock = self.socket(kind)
        sock.linger = 0
        self.harness.add(sock)
        return sock

    def close_all(self) -> list[str]:
        """Close every socket still open (linger 0) and terminate; returns where each open one not made by the
        harness was made."""
        leaked = [f"{zmq.SocketType(sock.type).name} socket made at {where}"
                  for sock, where in self.made if not sock.closed and sock not in self.harness]
        for sock, _ in self.made:
            if not sock.closed:
                sock.close(linger=0)
        self.made.clear()
        term = threading.Thread(target=self.term, name="context-term", daemon=True)
        term.start()
        term.join(TERM_SECONDS)
        if term.is_alive():
            leaked.append(f"the context did not terminate within {TERM_SECONDS:g} s (a socket made elsewhere?)")
        return leaked


def _caller() -> str:
    # The innermost frame outside pyzmq and the harness: the line that asked for the socket.
    for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
        if "/zmq/" not in frame.filename and not frame.filename.startswith(HARNESS):
            return f"{frame.filename}:{frame.lineno} (in {frame.name})"
    return "an unknown place"


@pytest.fixture
def context():
    """A :class:`TrackedContext`; the test fails if it leaves a socket open (each is then closed, linger 0)."""
    ctx = TrackedContext()
    yield ctx
    leaked = ctx.close_all()
    if leaked:
        pytest.fail("sockets left open at the end of the test:\n  " + "\n  ".join(leaked), pytrace=False)


@pytest.fixture
def sockets(context):
    """``sockets(type, address)``: a connected socket, closed with linger 0 after the test."""
    made = []

    def make(kind: int, address: str) -> zmq.Socket:
        sock = context.harness_socket(kind)
        sock.connect(address)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


def below_ephemeral() -> range:
    """Loopback ports to choose from for a server that binds later: below the kernel's ephemeral range, where no
    outgoing connection made on the machine meanwhile is handed the port (EADDRINUSE was seen so, with a port
    the kernel had given to the test's own probe)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    return range(10_000, max(ephemeral, 12_000))


def free_ports(count: int, consecutive: bool = False) -> list[int]:
    """``count`` free TCP ports on 127.0.0.1 (held together while chosen) below the ephemeral range
    (:func:`below_ephemeral`); ``consecutive``: P, P+1, ... ."""
    ports = below_ephemeral()
    chooser = random.Random()
    for _ in range(200):
        chosen = [chooser.choice(ports[:-count])] if consecutive else chooser.sample(ports, count)
        if consecutive:
            chosen = list(range(chosen[0], chosen[0] + count))
        probes: list[socket.socket] = []
        try:
            for port in chosen:
                probe = socket.socket()
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return chosen
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError(f"no {count} free ports on 127.0.0.1 in {ports}")


def free_port_triple() -> int:
    """A port P on 127.0.0.1 with P, P+1 and P+2 free (feed, ranks, derived control)."""
    return free_ports(3, consecutive=True)[0]


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
