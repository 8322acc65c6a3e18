"""Runs that last (issue 18 §2): a broker's state, its ``stats()`` replies and its series stay flat over thousands of
epochs and streams; unused streams retire; a reply too large for a header comes in pages; a broker serves peers of
the protocol version before its own, and a client falls back to an older broker's.
"""

from __future__ import annotations

import gc
import time
import tracemalloc

import msgpack
import pytest
import zmq

from sparkbus.broker.books import Outcome
from sparkbus.broker.config import BrokerConfig
from sparkbus.broker.daemon import Broker
from sparkbus.broker.figures import no_earlier
from sparkbus.broker.ledger import Ledger
from sparkbus.broker.status import PAGE_BYTES, merge_pages, paginate
from sparkbus.broker.versions import PeerVersions
from sparkbus.wire import protocol
from sparkbus.wire.protocol import ErrorCode, Kind

from harness import hello, push, recv_header, send

pytestmark = pytest.mark.timeout(60)

PARTITIONS, BATCHES = 1, 2          # per epoch: one partition of two batches (of two rows each)


class Sent:
    """The daemon's ``_transmit``, keeping only the batch ids of the last dispatch (nothing that grows)."""

    def __init__(self) -> None:
        self.ids: dict[bytes, list[tuple[int, int, int]]] = {}

    def transmit(self, identity: bytes, frames: list) -> Outcome:
        header = protocol.unpack_header(frames[0])
        if header["kind"] == Kind.BATCH:
            self.ids.setdefault(identity, []).append(protocol.batch_id(header))
        return Outcome.SENT


def one_epoch(ledger: Ledger, sent: Sent, stream: str, epoch: int) -> None:
    """Feed an epoch of ``stream``, hand it to its rank, acknowledge it: delivered and retired, as a job does."""
    ledger.open_epoch(stream, epoch, PARTITIONS, "stream")
    for part in range(PARTITIONS):
        for seq in range(BATCHES):
            push(ledger, epoch, part, seq, stream=stream)
        ledger.end_partition(b"task", {"req": 1, "stream": stream, "epoch": epoch, "part": part, "attempt": 0,
                                       "batches": BATCHES, "rows": 2 * BATCHES})
    ledger.close_epoch(stream, epoch, PARTITIONS)
    identity = stream.encode()
    ledger.dispatch(ledger.streams[stream], sent.transmit)
    ids = sent.ids.pop(identity)
    assert len(ids) == PARTITIONS * BATCHES
    ledger.acknowledge(ledger.rank(identity), [x for i in ids for x in i])
    ledger.dispatch(ledger.streams[stream], sent.transmit)           # EPOCH_END


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_a_thousand_epochs_on_many_streams_leave_the_ledger_and_its_replies_flat():
    streams = [f"job-{i}" for i in range(8)]
    broker = Broker(BrokerConfig(feed="inproc://long-feed", ranks="inproc://long-ranks",
                                 control="inproc://long-control", keep_epochs=16))
    ledger, sent = broker.ledger, Sent()
    for name in streams:
        ledger.join_rank(name.encode(), hello(stream=name))
        ledger.set_window(ledger.rank(name.encode()), 8, 0)
    sizes, memory = {}, {}
    tracemalloc.start()
    try:
        for epoch in range(1000):
            for name in streams:
                one_epoch(ledger, sent, name, epoch)
            if epoch + 1 in (200, 1000):
                memory[epoch + 1] = traced()
                sizes[epoch + 1] = len(msgpack.packb(broker.stats(), use_bin_type=True))
    finally:
        tracemalloc.stop()
    for name in streams:
        stream = ledger.streams[name]
        assert not stream.epochs and len(stream.finished.figures) == 16
        assert stream.finished.ranges.ranges() == [[0, 1000 - 16 - 1]]
        figures = broker.stats()["streams"][name]
        assert sorted(int(n) for n in figures["epochs"]) == list(range(1000 - 16, 1000))
        assert figures["delivered"] == 1000
        earlier = figures["earlier"]
        assert (earlier["epochs"], earlier["batches_in"], earlier["batches_out"], earlier["acked"]) == \
            (1000 - 16, 2 * (1000 - 16), 2 * (1000 - 16), 2 * (1000 - 16))
        assert earlier["rows_in"] == 4 * (1000 - 16) and earlier["duplicates"] == earlier["diverged"] == 0
    assert ledger.buffered == 0
    # 800 more epochs per stream later: the memory the ledger holds grew by less than 32 KiB (a few counters that
    # take more bytes as they grow), and the figures' reply by less than 2 % (numbers one digit longer)
    assert memory[1000] - memory[200] < 32 << 10, memory
    assert sizes[1000] < sizes[200] * 1.02 and sizes[1000] < PAGE_BYTES, sizes


def test_a_delivered_epoch_is_refused_again_long_after_its_figures_were_summed():
    ledger, sent = Ledger(), Sent()
    ledger.keep_epochs = 4
    ledger.join_rank(b"s", hello())
    ledger.set_window(ledger.rank(b"s"), 8, 0)
    for epoch in range(10):
        one_epoch(ledger, sent, "s", epoch)
    assert sorted(ledger.streams["s"].finished.figures) == [6, 7, 8, 9]
    for epoch in (0, 5, 9):
        with pytest.raises(protocol.ProtocolError, match="delivered"):
            ledger.open_epoch("s", epoch, 1, "stream")


def test_unused_streams_retire_and_a_broker_takes_more_than_4096_streams_over_time():
    from sparkbus.broker.books import MAX_STREAMS

    ledger, sent = Ledger(), Sent()
    for i in range(MAX_STREAMS + 500):
        name = f"job-{i}"
        ledger.join_rank(name.encode(), hello(stream=name))
        ledger.set_window(ledger.rank(name.encode()), 8, 0)
        one_epoch(ledger, sent, name, 0)
        ledger.rank_gone(name.encode(), "said goodbye", keep=False)
        if len(ledger.streams) == MAX_STREAMS:
            now = time.monotonic()
            assert ledger.retire_streams(now, 3600.0) == []          # not unused long enough
            assert len(ledger.retire_streams(now + 3600.0, 3600.0)) == MAX_STREAMS
    assert len(ledger.streams) == 500 and ledger.retired_count == MAX_STREAMS
    assert len(ledger.retired) == MAX_STREAMS


def test_a_stream_in_use_or_named_by_a_message_is_not_retired_and_a_retired_one_comes_back_knowing_its_epochs():
    ledger, sent = Ledger(), Sent()
    ledger.join_rank(b"a", hello(stream="a"))
    ledger.set_window(ledger.rank(b"a"), 8, 0)
    for epoch in range(3):
        one_epoch(ledger, sent, "a", epoch)
    ledger.open_epoch("b", 0, 1, "stream")                          # an epoch in progress, nobody reading it
    ledger.open_epoch("c", 0, 0, "stream")
    ledger.close_epoch("c", 0, 0)                                    # nothing to deliver: it ends once a rank joins
    start = time.monotonic()
    assert ledger.retire_streams(start + 10, 5.0) == []              # a has a rank, b and c an epoch in progress
    assert ledger.retire_streams(start + 20, 5.0) == []              # a sweep sees them in use: their clock starts
    ledger.rank_gone(b"a", "said goodbye", keep=False)               # a: unused from now on
    assert ledger.retire_streams(start + 22, 5.0) == []
    ledger.touch("a", start + 24)                                    # a message named it
    assert ledger.retire_streams(start + 28, 5.0) == []
    assert ledger.retire_streams(start + 29, 5.0) == ["a"]
    assert sorted(ledger.streams) == ["b", "c"] and ledger.retired["a"].ranges() == [[0, 2]]
    assert ledger.retired_count == 1
    for epoch in (0, 2):
        with pytest.raises(protocol.ProtocolError, match="delivered"):
            ledger.open_epoch("a", epoch, 1, "stream")               # the stream is back, its epochs known
    ledger.open_epoch("a", 3, 1, "stream")
    assert "a" not in ledger.retired and sorted(ledger.streams["a"].epochs) == [3]


def test_at_the_stream_limit_a_new_stream_retires_the_one_unused_longest_and_is_refused_only_if_all_are_used():
    from sparkbus.broker.books import MAX_STREAMS

    ledger = Ledger()
    for i in range(MAX_STREAMS):
        ledger.open_epoch(f"s{i}", 0, 1, "stream")             # in use: an epoch in progress
    with pytest.raises(protocol.ProtocolError, match="already tracks 4096 streams, all in use"):
        ledger.open_epoch("one-more", 0, 1, "stream")
    for i in (7, 3):                                            # two become unused, s3 the later
        ledger.streams[f"s{i}"].epochs.clear()
        ledger.streams[f"s{i}"].finished.figures[0] = {}
        ledger.touch(f"s{i}", time.monotonic())
    ledger.open_epoch("one-more", 0, 1, "stream")
    assert "s7" not in ledger.streams and "s3" in ledger.streams and ledger.retired_count == 1
    assert ledger.retired["s7"].ranges() == [[0, 0]] and len(ledger.streams) == MAX_STREAMS


def test_retirement_is_off_with_zero():
    ledger = Ledger()
    ledger.open_epoch("a", 0, 0, "stream")
    ledger.streams["a"].epochs.clear()
    assert ledger.retire_streams(time.monotonic() + 1e9, 0.0) == [] and "a" in ledger.streams


# ---- pages ------------------------------------------------------------------------------------------------------


def large_figures(streams: int, ranks: int) -> dict:
    rank = {"rank": 0, "size": 1, "even": False, "window": 4, "window_bytes": 0, "inflight": 0, "inflight_bytes": 0,
            "batches": 123456, "bytes": 1 << 40, "acked": 123456, "idle_s": 0.25}
    epoch = {"partitions": 200, "delivery": "stream", "committed": 200, "closed": True, "ended": True, "queued": 0,
             "batches_in": 1 << 20, "bytes_in": 1 << 40, "rows_in": 1 << 30, "batches_out": 1 << 20,
             "bytes_out": 1 << 40, "rows_out": 1 << 30, "acked": 1 << 20, "duplicates": 3, "redelivered": 2,
             "given_twice": 0, "diverged": [], "steps": 0, "dropped": 0, "moved": 0}
    return {"broker": {"version": protocol.VERSION, "pid": 1, "incarnation": "i"},
            "streams": {f"stream-{s:05d}": {"expected_ranks": ranks, "rejoins": 0, "delivered": 80, "idle_s": 0.0,
                                            "earlier": no_earlier(),
                                            "epochs": {str(n): dict(epoch) for n in range(16 + s % 5)},
                                            "ranks": [dict(rank, rank=r) for r in range(ranks)], "orphans": []}
                        for s in range(streams)}}


@pytest.mark.parametrize("streams, ranks", [(1, 2), (300, 4), (2, 2000)])
def test_figures_too_large_for_a_header_come_in_pages_that_merge_back(streams, ranks):
    figures = large_figures(streams, ranks)
    pages = paginate(figures)
    whole = len(msgpack.packb(figures, use_bin_type=True))
    if whole <= PAGE_BYTES:
        assert pages == [figures]
        return
    assert len(pages) > 1 and [p["page"] for p in pages] == [[i, len(pages)] for i in range(len(pages))]
    for page in pages:
        assert len(protocol.pack_header(Kind.STATS_REPLY, req=1 << 40, stats=page)) <= protocol.MAX_HEADER_BYTES
        assert page["broker"] == figures["broker"]
    assert merge_pages(list(reversed(pages))) == figures


def test_a_status_reply_larger_than_a_header_reaches_the_client_whole(start_broker_thread, context):
    from sparkbus.broker.client import fetch_stats
    from sparkbus.broker.status import render_stats

    broker = start_broker_thread(tcp=True)          # the client makes a context of its own
    for i in range(400):                                    # about 400 bytes a stream: some 160 KB of figures
        broker.ledger.open_epoch(f"stream-{i:04d}", 0, 3, "stream")
    figures = fetch_stats(broker.config.control, timeout=10)
    assert sorted(figures["streams"]) == [f"stream-{i:04d}" for i in range(400)] and "page" not in figures
    assert len(msgpack.packb(figures, use_bin_type=True)) > 2 * protocol.MAX_HEADER_BYTES
    assert render_stats(figures).count("epoch 0 (open): partitions 0/3") == 400


# ---- versions ---------------------------------------------------------------------------------------------------


def old(kind: Kind, **fields) -> bytes:
    return protocol.pack_header(kind, v=protocol.VERSION - 1, **fields)


def test_a_header_of_the_version_before_is_read_as_it_defined_it():
    assert protocol.SUPPORTED == (protocol.VERSION - 1, protocol.VERSION) == (6, 7)
    h = protocol.unpack_header(old(Kind.EPOCH_OPEN, req=1, stream="s", epoch=0, partitions=2, delivery="stream",
                                   commit="driver"))
    assert h["v"] == 6 and "commit" not in h and h["partitions"] == 2     # v6 had no commit by the driver
    assert protocol.unpack_header(protocol.pack_header(Kind.EPOCH_OPEN, req=1, stream="s", epoch=0, partitions=2,
                                                       delivery="stream", commit="driver"))["commit"] == "driver"
    with pytest.raises(protocol.ProtocolError, match="PARTITION_COMMIT is not a message of protocol version 6"):
        protocol.unpack_header(old(Kind.PARTITION_COMMIT, req=1, stream="s", epoch=0, parts=[]))
    with pytest.raises(protocol.ProtocolError, match="PARTITION_RECEIVED is not a message of protocol version 6"):
        protocol.unpack_header(old(Kind.PARTITION_RECEIVED, req=1, stream="s", epoch=0, part=0, attempt=0))
    with pytest.raises(protocol.VersionMismatch, match="peer speaks 5"):
        protocol.unpack_header(protocol.pack_header(Kind.HEARTBEAT, v=5))
    assert protocol.negotiated(6) == 6 and protocol.negotiated(7) == 7
    assert protocol.negotiated(5) is None and protocol.negotiated(8) is None and protocol.negotiated(True) is None


def test_a_forwarded_header_is_re_encoded_in_the_older_version_without_its_newer_fields():
    new = protocol.pack_header(Kind.EPOCH_OPEN, req=1, stream="s", epoch=3, partitions=7, delivery="stream",
                               commit="driver")
    again = protocol.unpack_header(protocol.reencode(new, 6))
    assert (again["v"], again["epoch"], again["partitions"], "commit" in again) == (6, 3, 7, False)
    assert protocol.reencode(new, 7) == new
    assert protocol.reencode(memoryview(old(Kind.HEARTBEAT)), 6) == old(Kind.HEARTBEAT)


def test_the_broker_remembers_only_older_peers_and_forgets_them():
    peers = PeerVersions(limit=2, forget_after=10.0)
    assert peers.version("ranks", b"a") == protocol.VERSION and not peers
    peers.heard("ranks", b"a", 4, 0.0)
    peers.heard("control", b"a", 4, 5.0)
    assert peers.version("ranks", b"a") == 4 and peers.version("ranks", b"b") == protocol.VERSION
    peers.heard("ranks", b"c", 4, 6.0)                         # over the limit: the least recent goes
    assert peers.version("ranks", b"a") == protocol.VERSION and peers.counts() == {"4": 2}
    peers.prune(15.5)
    assert peers.counts() == {"4": 1} and peers.version("ranks", b"c") == 4
    peers.prune(16.0)
    assert not peers


def test_a_rank_of_the_version_before_is_served_in_its_version(start_broker_thread, sockets):
    """Everything a v6 rank gets is a v6 header: WELCOME, BATCH (re-encoded, payload frames the same), EPOCH_END,
    heartbeats; a v7 rank on the same broker gets v7 headers and the batch's frames untouched."""
    import numpy as np

    from sparkbus.wire import codec

    broker = start_broker_thread(heartbeat=0.2)
    control = sockets(zmq.DEALER, broker.config.control)
    push = sockets(zmq.PUSH, broker.config.feed)
    ranks = {v: sockets(zmq.DEALER, broker.config.ranks) for v in (6, 7)}
    for v, sock in ranks.items():
        stream = f"s{v}"
        sock.send(protocol.pack_header(Kind.HELLO, v=v, **hello(stream=stream, session=f"x{v}")))
        welcome = recv_header(sock)[0]
        assert (welcome["kind"], welcome["v"], welcome["broker"]) == (Kind.WELCOME, v, "sparkbus/7")
        sock.send(protocol.pack_header(Kind.CREDIT, v=v, window=4, window_bytes=0))
        control.send(protocol.pack_header(Kind.EPOCH_OPEN, v=v, req=1, stream=stream, epoch=0, partitions=1,
                                          delivery="stream"))
        assert recv_header(control)[0]["v"] == v
    frames = {v: codec.encode_batch(f"s{v}", 0, 0, 0, {"x": np.arange(5, dtype="<i8")}) for v in (6, 7)}
    for v in (6, 7):
        push.send_multipart(frames[v])
    for v, sock in ranks.items():
        header, payload = recv_header(sock)
        assert (header["kind"], header["v"], header["seq"]) == (Kind.BATCH, v, 0)
        assert payload == [bytes(f) for f in frames[v][1:]]
        if v == 7:
            assert header == protocol.unpack_header(frames[7][0])
        beat = recv_header(sock, heartbeats=True)[0]
        while beat["kind"] != Kind.HEARTBEAT:
            beat = recv_header(sock, heartbeats=True)[0]
        assert beat["v"] == v
        control.send(protocol.pack_header(Kind.PARTITION_END, v=v, req=2, stream=f"s{v}", epoch=0, part=0,
                                          attempt=0, batches=1, rows=5))
        assert recv_header(control)[0]["kind"] == Kind.PARTITION_COMMITTED
        control.send(protocol.pack_header(Kind.EPOCH_CLOSE, v=v, req=3, stream=f"s{v}", epoch=0, partitions=1))
        assert recv_header(control)[0]["kind"] == Kind.OK
        sock.send(protocol.pack_header(Kind.ACK, v=v, ids=[0, 0, 0]))
        end = recv_header(sock)[0]
        assert (end["kind"], end["v"], end["epoch"], end["batches"]) == (Kind.EPOCH_END, v, 0, 1)
    send(control, Kind.STATS_REQUEST, req=9)
    figures = recv_header(control)[0]["stats"]["broker"]
    # the v6 rank; the control connection spoke 6, then 7: it is answered in 7 now
    assert (figures["versions"], figures["older_peers"]) == ([6, 7], {"6": 1})
    control.send(protocol.pack_header(Kind.HEARTBEAT, v=5))
    refused = recv_header(control)[0]
    assert (refused["kind"], refused["code"], refused["v"]) == (Kind.ERROR, ErrorCode.VERSION, 7)
    assert "peer speaks 5" in refused["reason"]


def test_a_journal_of_more_streams_than_the_limit_replays_and_still_refuses_their_delivered_epochs(tmp_path,
                                                                                                monkeypatch):
    """Retired streams stay in the journal's retired.log: a restart replays more streams than a broker tracks at
    once (here the limit is made 8), retiring the least recent ones early; none of their epochs is fed again."""
    from sparkbus.broker import books
    from sparkbus.broker.journal import Journal

    monkeypatch.setattr(books, "MAX_STREAMS", 8)
    journal = Journal(tmp_path)
    ledger, sent = Ledger(journal), Sent()
    for i in range(12):
        name = f"job-{i}"
        ledger.join_rank(name.encode(), hello(stream=name))
        ledger.set_window(ledger.rank(name.encode()), 8, 0)
        one_epoch(ledger, sent, name, 0)
        ledger.rank_gone(name.encode(), "said goodbye", keep=False)
    assert len(ledger.streams) == 8 and ledger.retired_count == 4
    retired = sorted(set(f"job-{i}" for i in range(12)) - set(ledger.streams))
    assert not [name for name in retired if (tmp_path / name.encode().hex()).exists()]     # their folders gone
    journal.compact_retired()              # the retired streams keep their ranges, not their figures
    records = list(journal.retired())
    assert [r for r in records if r["stream"] in retired] == [{"stream": n, "delivered": [[0, 0]]} for n in retired]
    assert sorted(r["stream"] for r in records if "stats" in r) == sorted(ledger.streams)
    journal.close()
    again = Ledger(Journal(tmp_path))
    again.replay()
    assert len(again.streams) == 8 and sorted(set(again.streams) | set(again.retired)) == \
        sorted(f"job-{i}" for i in range(12))
    for i in range(12):
        with pytest.raises(protocol.ProtocolError, match="delivered"):
            again.open_epoch(f"job-{i}", 0, 1, "stream")
    assert again.journal is not None
    again.journal.close()
