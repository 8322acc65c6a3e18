"""A rank's side of rejoining, against a stand-in broker over inproc: the HELLO that names what the rank holds and
consumed, and redeliveries of batches it has, which it does not yield again."""

import numpy as np

from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import ErrorCode, Kind, pack_header, unpack_header

from harness import FakeBroker, joined


def batch(seq):
    return {"id": np.array([seq])}


def resume_hello(broker, timeout=5.0):
    """The rank's next HELLO (heartbeats skipped), with its two id frames: held, consumed."""
    while True:
        assert broker.sock.poll(timeout * 1000), "no HELLO from the rank"
        identity, raw, *ids = broker.sock.recv_multipart()
        header = unpack_header(raw)
        if header["kind"] == Kind.HELLO:
            return header, [protocol.unpack_ids(frame) for frame in ids]


def unknown_rank(broker):
    broker.send([pack_header(Kind.ERROR, req=0, reason="unknown rank", code=ErrorCode.UNKNOWN_RANK)])


def told_unknown_after_two_batches(context, address):
    """A rank joined to a stand-in broker that sent it batches 0 and 1 of epoch 0, then "unknown rank"."""
    broker = FakeBroker(context, address)
    stream = joined(broker, address, context)
    for seq in (0, 1):
        broker.send(codec.encode_batch("s", 0, 0, seq, batch(seq)))
    unknown_rank(broker)
    return broker, stream


def test_a_rank_told_it_is_unknown_names_what_it_holds_and_consumed_and_drops_a_second_copy(context):
    broker, stream = told_unknown_after_two_batches(context, "inproc://rank-rejoin")
    with stream:
        got = []
        epoch = stream.epoch()
        got.append(int(next(epoch)["id"][0]))
        got.append(int(next(epoch)["id"][0]))
        # the loop holds batch 1; waiting in a collective, the rank hears that the broker does not know it
        stream._service()
        hello, (held, consumed) = resume_hello(broker)
        assert hello["resume"] and hello["ended"] == -1
        assert (held, consumed) == ([(0, 0, 1)], [(0, 0, 0)])
        assert hello["incarnation"] == "x", "a rejoin names the incarnation it knew"
        broker.answer(hello)            # the same incarnation (a cut link; a restart without journal is a loss)
        broker.send(codec.encode_batch("s", 0, 0, 0, batch(0)))      # a copy of one it consumed: dropped
        broker.send(codec.encode_batch("s", 0, 0, 2, batch(2)))
        broker.end(0, 3)
        got.extend(int(b["id"][0]) for b in epoch)
        assert got == [0, 1, 2]
        assert broker.next(Kind.CREDIT)["window"] == 4, "the rank states its window again once welcomed"
        assert stream.stats.rejoins == 1 and stream.stats.epochs[-1].batches == 3


def test_after_an_epochs_end_a_rejoining_rank_names_nothing_of_it(context):
    broker = FakeBroker(context, "inproc://rank-rejoin-end")
    with joined(broker, "inproc://rank-rejoin-end", context) as stream:
        broker.send(codec.encode_batch("s", 0, 0, 0, batch(0)))
        broker.end(0, 1)
        assert [int(b["id"][0]) for b in stream.epoch()] == [0]
        unknown_rank(broker)
        stream._service()
        hello, (held, consumed) = resume_hello(broker)
        assert hello["ended"] == 0 and (held, consumed) == ([], [])


def test_a_rank_that_rejoins_while_it_waits_for_its_peers_names_what_arrived_meanwhile(context):
    broker, stream = told_unknown_after_two_batches(context, "inproc://rank-rejoin-wait")
    with stream:
        epoch = stream.epoch()
        try:
            got = [int(next(epoch)["id"][0])]
            stream._service()               # keeps batch 1 for later, then hears that the broker does not know it
            hello, (held, consumed) = resume_hello(broker)
            assert (sorted(held), consumed) == ([(0, 0, 0), (0, 0, 1)], [])
            broker.answer(hello)
            broker.send(codec.encode_batch("s", 0, 0, 1, batch(1)))   # a second copy of the one kept: dropped
            broker.send(codec.encode_batch("s", 0, 0, 2, batch(2)))
            broker.end(0, 3)
            got.extend(int(b["id"][0]) for b in epoch)
        finally:
            epoch.close()
    assert got == [0, 1, 2] and stream.stats.epochs[-1].batches == 3
