"""In-process fixtures: a broker in a thread on inproc:// endpoints, and sockets that are always closed."""

import itertools
import threading

import pytest
import zmq

from broker.config import BrokerConfig
from broker.daemon import Broker

_names = itertools.count()


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def sockets(context):
    """``sockets(type, address)``: a connected socket, closed with linger 0 after the test."""
    made = []

    def make(kind, address):
        sock = context.socket(kind)
        sock.linger = 0
        sock.connect(address)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


@pytest.fixture
def start_broker(context):
    """``start_broker(**config)`` runs a Broker in a thread on fresh inproc endpoints; stopped after the test."""
    running = []

    def start(**settings):
        settings.setdefault("heartbeat", 30.0)     # quiet: tests that check "nothing arrives" see no heartbeats
        settings.setdefault("dead_after", 60.0)
        n = next(_names)
        config = BrokerConfig(feed=f"inproc://feed-{n}", ranks=f"inproc://ranks-{n}",
                              control=f"inproc://control-{n}", **settings)
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
