"""Fuzzing a real broker process: over 10,000 hostile messages across its three sockets while a valid stream
flows beside them. The valid stream must arrive intact; the broker must stay up and count what it refused."""

import os
import random
import threading

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sparkbus.broker.auth import client_socket
from sparkbus.broker.client import ControlClient
from sparkbus.feeder import stream_partition
from sparkbus.wire import protocol
from sparkbus.wire.protocol import Kind

from sources import Collector

pytestmark = pytest.mark.timeout(240)

VALID = "valid"
names = st.text(min_size=0, max_size=12).filter(lambda s: s != VALID)
scalars = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-3, 40), st.booleans(), st.none(), names,
                    st.binary(max_size=16), st.floats(allow_nan=True))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(names, inner, max_size=3)), max_leaves=8)
field_names = st.sampled_from(sorted({f for schema in protocol.SCHEMAS.values() for f in schema} | {"pad"}))


@st.composite
def headers(draw):
    fields = draw(st.dictionaries(field_names, values, max_size=8))
    fields["v"] = draw(st.one_of(st.just(protocol.VERSION), st.integers(-1, 5)))
    fields["kind"] = draw(st.one_of(st.sampled_from([int(k) for k in Kind]), st.integers(-5, 300)))
    if draw(st.booleans()):                    # often a header that passes schema checks, to reach deeper code
        for name, kind in protocol.SCHEMAS.get(fields["kind"], {}).items():
            fields.setdefault(name, draw({int: st.integers(-2, 2**40), str: names, list: st.lists(
                st.lists(st.integers(-1, 5), max_size=4), max_size=4), dict: st.just({}),
                bool: st.booleans()}[kind]))
    return msgpack.packb(fields, use_bin_type=True)


messages = st.tuples(st.sampled_from(["feed", "control", "ranks"]),
                     st.lists(st.one_of(headers(), st.binary(max_size=64)), min_size=1, max_size=1),
                     st.lists(st.binary(max_size=2048), max_size=3))


def test_ten_thousand_hostile_messages_leave_a_valid_stream_intact(start_broker_process, context):
    broker = start_broker_process("--max-message", "1MiB", "--heartbeat", "200ms")
    # client_socket: with SPARKBUS_TEST_AUTH=1 the hostile peer holds a valid key (an insider); otherwise plain
    sockets = {"feed": client_socket(context, zmq.PUSH), "control": client_socket(context, zmq.DEALER),
               "ranks": client_socket(context, zmq.DEALER)}
    for name, sock in sockets.items():
        sock.sndhwm = 0
        sock.connect(getattr(broker, name))
    sent = [0]

    def send(socket, frames):
        sockets[socket].send_multipart(frames)
        sent[0] += 1
        for name in ("control", "ranks"):                   # drain replies so none pile up
            while sockets[name].poll(0):
                sockets[name].recv_multipart()

    consumer = Collector(broker.ranks, VALID, timeout=120)
    feeding_done = threading.Event()

    def feed_valid():
        with ControlClient(broker.control, 30) as driver:
            driver.request(Kind.EPOCH_OPEN, stream=VALID, epoch=0, partitions=4, delivery="stream")
            for part in range(4):
                ids = np.arange(part * 5_000, (part + 1) * 5_000)
                batches = ({"id": ids[i:i + 250], "x": ids[i:i + 250].astype(np.float32)} for i in range(0, 5_000, 250))
                stream_partition(batches, broker.feed, broker.control, VALID, 0, part, 0, 30)
            driver.request(Kind.EPOCH_CLOSE, stream=VALID, epoch=0, partitions=4)
        feeding_done.set()

    feeder = threading.Thread(target=feed_valid)
    feeder.start()
    try:
        @settings(max_examples=2_500, deadline=None, phases=[Phase.generate], database=None,
                  suppress_health_check=list(HealthCheck))
        @given(messages)
        def fuzz(message):
            socket, header, frames = message
            send(socket, header + frames)

        fuzz()
        rng = random.Random(7)
        fields = sorted({f for schema in protocol.SCHEMAS.values() for f in schema})
        junk = [0, -1, 2**40, "", "x" * 300, [], [[0, 0, 0]], [1, "a"], {}, None, True, 1.5, b"\0"]
        while sent[0] < 10_500:            # then cheaper noise: random maps of real field names, random bytes
            socket = rng.choice(["feed", "control", "ranks"])
            if rng.random() < 0.5:
                header = {name: rng.choice(junk) for name in rng.sample(fields, rng.randint(0, 8))}
                header.update(v=rng.choice([protocol.VERSION, 0, 2]), kind=rng.choice([int(k) for k in Kind] + [0, 99]))
                send(socket, [msgpack.packb(header, use_bin_type=True), *[os.urandom(rng.choice([0, 8, 4096]))
                                                                         for _ in range(rng.randint(0, 2))]])
            else:
                size = rng.choice([1, 16, 300, 70_000, 2_000_000])
                send(socket, [os.urandom(size) for _ in range(rng.randint(1, 3))])
        feeder.join(120)
        assert feeding_done.is_set(), "the valid feed did not finish"
        (ids,) = consumer.result(120)
    finally:
        for sock in sockets.values():
            sock.close(linger=0)
    assert sent[0] >= 10_000
    np.testing.assert_array_equal(np.sort(ids), np.arange(20_000))
    stats = broker.stats()
    assert broker.proc.poll() is None
    rejected = stats["broker"]["rejected"]
    # many messages are legal (a stats request, a hello) or close their connection (over --max-message), so
    # only part of them is counted; each socket must have refused plenty
    assert all(sum(rejected[name].values()) > 500 for name in ("feed", "control", "ranks")), rejected
    assert not any("internal" in r for r in rejected.values()), f"the broker hit internal errors: {rejected}"
    assert stats["streams"][VALID]["epochs"]["0"]["rows_in"] == 20_000
