"""Brokers for the tests: a real one in a thread of the test process (``start_broker_thread``) or as a child
process (``start_broker_process``), a stand-in a rank talks to (:class:`FakeBroker`), and a broker's keys."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
import zmq

from sparkbus.launch.broker import BrokerProcess
from sparkbus.wire import codec
from sparkbus.wire.protocol import Kind, pack_header, unpack_header

from harness.sockets import free_port_triple

_inproc_names = itertools.count()


@pytest.fixture
def start_broker_thread(context):
    """``start_broker_thread(**config)``: a Broker in a thread on fresh inproc endpoints of ``context`` (settings
    are :class:`broker.config.BrokerConfig` fields); stopped, and its thread joined, after the test.

    ``tcp=True``: on free loopback ports instead, for clients that make contexts of their own (the feeder's task
    code, a ``BatchStream`` without ``context=``).
    """
    from sparkbus.broker.config import BrokerConfig
    from sparkbus.broker.daemon import Broker

    running = []

    def start(*, tcp: bool = False, **settings: Any) -> Broker:
        settings.setdefault("heartbeat", 30.0)     # quiet: tests that check "nothing arrives" see no heartbeats
        settings.setdefault("dead_after", 60.0)
        if tcp:
            base = free_port_triple()
            feed, ranks, control = (f"tcp://127.0.0.1:{base + i}" for i in range(3))
        else:
            n = next(_inproc_names)
            feed, ranks, control = f"inproc://feed-{n}", f"inproc://ranks-{n}", f"inproc://control-{n}"
        config = BrokerConfig(feed=feed, ranks=ranks, control=control, **settings)
        broker = Broker(config, context=context)
        thread = threading.Thread(target=broker.run, daemon=True)
        thread.start()
        running.append((broker, thread))
        return broker

    yield start
    for broker, thread in running:
        broker.stop()
        thread.join(5)
        assert not thread.is_alive(), "broker thread did not stop"


@pytest.fixture
def start_broker_process(tmp_path):
    """``start_broker_process(*flags)``: ``python -m sparkbus.broker`` on loopback ports it picks itself, ready when
    it says so.

    The :class:`launch.broker.BrokerProcess` has ``feed``, ``ranks``, ``control``, ``proc``, ``log``,
    ``stats()`` and ``restart()``; each must stop on SIGTERM at the end of the test.
    """
    started = []

    def start(*flags: str) -> BrokerProcess:
        broker = BrokerProcess(tmp_path / f"broker-{len(started)}.log", *flags)
        started.append(broker)
        return broker.start(timeout=15)

    yield start
    for broker in started:
        broker.stop()
    assert not [broker for broker in started if broker.killed], "broker did not stop on SIGTERM"


class FakeBroker:
    """A ROUTER standing in for the broker: it welcomes one rank, sends what it is told, and records ACKs."""

    def __init__(self, context, address):
        # the harness's own socket (closed at the test's end, not a leak of the rank under test)
        self.sock = context.harness_socket(zmq.ROUTER)
        self.sock.bind(address)
        self.acks: list[list[int]] = []
        self.window = None

    def welcome(self):
        assert self.sock.poll(5000), "no HELLO from the rank"
        identity, raw = self.sock.recv_multipart()
        self.identity = identity
        self.answer(unpack_header(raw))
        self.window = self.next(Kind.CREDIT)

    def answer(self, hello, incarnation="x"):
        """WELCOME the rank whose ``hello`` this is, as a broker of ``incarnation``."""
        self.send([pack_header(Kind.WELCOME, req=hello["req"], broker="fake", incarnation=incarnation, journal=False,
                               free=0)])

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

    def send_epoch(self, epoch, batches):
        """Send ``batches`` (dicts of columns) as batches 0, 1, ... of partition 0 of ``epoch``, then its end."""
        for seq, columns in enumerate(batches):
            self.send(codec.encode_batch("s", epoch, 0, seq, columns))
        self.end(epoch, len(batches))


def joined(broker, address, context, **options):
    """A BatchStream (``options`` passed on) whose HELLO the fake broker answers (from a thread: the
    constructor waits for WELCOME)."""
    from sparkbus.worker import BatchStream

    welcomer = threading.Thread(target=broker.welcome)
    welcomer.start()
    stream = BatchStream(address, stream="s", timeout=10, context=context, **options)
    welcomer.join(10)
    return stream


def key_directory(directory, clients, roles):
    """A broker's key directory (its pair, ``feeders/``, ``ranks/``) in ``directory``, and a pair for each client
    of ``roles`` in ``clients``, its public key allowed in the role ``roles[name]`` names (None: a stranger).

    Returns:
        Each client's ``(public, secret)`` key paths, by name.
    """
    from sparkbus.broker.auth import create_keypair

    for folder in (directory / "feeders", directory / "ranks", clients):
        folder.mkdir(parents=True)
    create_keypair(directory / "broker")
    made = {}
    for name, role in roles.items():
        public, secret = create_keypair(clients / name)
        if role:
            (directory / role / public.name).write_bytes(public.read_bytes())
        made[name] = (public, secret)
    return made
