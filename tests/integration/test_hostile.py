"""Hostile input on every socket of a real broker process while a real stream runs to two ranks: random bytes, valid
msgpack of the wrong types, headers that declare huge sizes, and valid requests past every per-stream limit
(docs/PROTOCOL.md, "Limits and refusals"): epochs and streams opened and never fed, RECLAIMs of long and of many
losses, rank sessions of 30 KB, a recovery's ranges, a partition's attempts.

The stream's rows arrive exactly; the broker stays up, answers ``sparkbus status``, logs no internal error, keeps
its memory and file descriptors bounded, and counts what it refused. With a journal too: it keeps the files of at
most ``MAX_OPEN_FILES`` epochs open, and on disk only those of epochs it keeps something of.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable

import msgpack
import numpy as np
import pytest
import zmq

from sparkbus.broker.auth import client_socket
from sparkbus.broker.client import ControlClient
from sparkbus.broker.journal import MAX_OPEN_FILES
from sparkbus.broker.partitions import MAX_ATTEMPTS, MAX_OPEN_EPOCHS, MAX_PARTITIONS
from sparkbus.broker.recovery import MAX_LOSSES, MAX_RECLAIM_EPOCHS, MAX_RECOVERY_RANGES
from sparkbus.feeder.task import stream_partition
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind
from sparkbus.worker import BatchStream

from harness import run_child

pytestmark = pytest.mark.timeout(150)

VALID = "valid"
HOSTILE = "hostile"
PARTITIONS = 4
ROWS = 6_000              # per partition
MAX_MESSAGE = 4 << 20
RSS_GROWTH = 64 << 20     # what the whole run may leave the broker holding
FD_GROWTH = 64            # connections the broker may have open beyond those at its start, at any time
WAIT = 30.0               # every wait's bound


def rss(pid: int) -> int:
    """The process's resident set, bytes (``VmRSS`` of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Hostile:
    """A peer with a socket on each of the broker's three sockets. ``volley`` sends requests and waits (bounded) for
    the replies it expects, so that the broker's queues never hold more than one volley."""

    def __init__(self, context: zmq.Context, broker) -> None:
        self.sockets = {}
        for name, kind in (("feed", zmq.PUSH), ("control", zmq.DEALER), ("ranks", zmq.DEALER)):
            sock = self.sockets[name] = client_socket(context, kind)   # a valid key under SPARKBUS_TEST_AUTH
            sock.sndhwm = 0
            sock.linger = 0
            sock.connect(getattr(broker, name))
        self.sent = 0

    def send(self, socket: str, frames: list[bytes]) -> None:
        self.sockets[socket].send_multipart(frames)
        self.sent += 1

    def drain(self) -> None:
        for name in ("control", "ranks"):
            while self.sockets[name].poll(0):
                self.sockets[name].recv_multipart()

    def volley(self, socket: str, messages: list[list[bytes]], replies: int | None = None) -> list[dict]:
        """Send ``messages`` on ``socket`` and receive ``replies`` answers (one each by default), heartbeats
        skipped; returns their headers."""
        for frames in messages:
            self.send(socket, frames)
        sock, got = self.sockets[socket], []
        deadline = time.monotonic() + WAIT
        while len(got) < (len(messages) if replies is None else replies):
            assert sock.poll(max(deadline - time.monotonic(), 0) * 1000), \
                f"{len(got)} of the replies to {len(messages)} messages on {socket} came"
            header = protocol.unpack_header(sock.recv_multipart()[0])
            if header["kind"] != Kind.HEARTBEAT:
                got.append(header)
        return got

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=0)


def header(kind: Kind, **fields) -> bytes:
    return protocol.pack_header(kind, **fields)


def refusals(replies: list[dict]) -> int:
    return sum(1 for r in replies if r["kind"] == Kind.ERROR and r["code"] == protocol.ErrorCode.REFUSED)


# ---- the attacks, one phase each; the valid feed streams a partition after each ------------------------------

def random_noise(peer: Hostile, context: zmq.Context, broker, rng: random.Random) -> None:
    """Random bytes and random maps of real field names with junk values, on fresh sockets (a message over
    --max-message closes its connection)."""
    noise = Hostile(context, broker)
    try:
        fields = sorted({f for schema in protocol.SCHEMAS.values() for f in schema})
        junk = [0, -1, 2**63 - 1, 2**64 - 1, -2**63, "", "x" * 300, [], [[0, 0, 0]], [1, "a"], ["a"] * 5, {}, None,
                True, 1.5, b"\0", [2**64 - 1] * 100]
        for i in range(1_500):
            socket = rng.choice(["feed", "control", "ranks"])
            if rng.random() < 0.6:
                fields_of = {name: rng.choice(junk) for name in rng.sample(fields, rng.randint(0, 9))}
                fields_of.update(v=rng.choice([protocol.VERSION, protocol.VERSION - 1, 0, "7", None]),
                                 kind=rng.choice([int(k) for k in Kind] + [0, 99, -1, "1"]))
                noise.send(socket, [msgpack.packb(fields_of, use_bin_type=True),
                                    *[os.urandom(rng.choice([0, 8, 40, 4096])) for _ in range(rng.randint(0, 2))]])
            else:
                size = rng.choice([0, 1, 16, 300, 70_000])
                noise.send(socket, [os.urandom(size) for _ in range(rng.randint(1, 3))])
            if i % 100 == 0:
                noise.drain()
        for socket in ("feed", "control", "ranks"):          # over --max-message: the connection is closed
            noise.send(socket, [os.urandom(MAX_MESSAGE + 1)])
        peer.sent += noise.sent
    finally:
        noise.close()


def huge_sizes(peer: Hostile) -> int:
    """Headers that declare sizes no message has: rows, shapes, levels and splits past any frame, products of
    thousands of digits, mistyped elements; and requests of huge numbers on the control and ranks sockets.
    Returns how many feed messages must be counted as malformed."""
    big = 2**64 - 1
    cols = [
        [["x", "<i8", [2**48 + 1]]],                                   # past MAX_FRAME_ITEMS
        [["x", "<i8", [4, big, big]]],                                 # a product of 130 bits
        [["x", "<i8", [4] + [2**40] * 300]],                           # a product of thousands of digits
        [["x", "bin", [4], [[4, 4, False], [big, 8, True]], False]],   # a level of 2^64 entries
        [["x", "<i8", [4], [[4, 16, False]], False]],                  # an offset width that is not 4 or 8
        [["x", "<i8", ["4"]]],                                         # a dimension that is a string
        [["x", "<i8", [4]]] * 2000,                                    # 2,000 columns, no frames
    ]
    batches = [header(Kind.BATCH, stream=HOSTILE, epoch=1, part=0, seq=9, attempt=0, rows=4, cols=c, checksum=0)
               for c in cols]
    packs = ((big, {}), (4, {"splits": ["a", "b"]}), (4, {"splits": [big, 5]}), (4, {"splits": [2, 2] * 3000}),
             (4, {"splits": []}))
    batches += [header(Kind.BATCH, stream=HOSTILE, epoch=1, part=0, seq=9, attempt=0, rows=rows,
                       cols=[["x", "<i8", [rows]]], checksum=0, **splits) for rows, splits in packs]
    for frames in batches:
        peer.send("feed", [frames, b"\0" * 32])
    control = [header(Kind.EPOCH_OPEN, req=2, stream=HOSTILE, epoch=big, partitions=big, delivery="stream"),
               header(Kind.PARTITION_END, req=3, stream=HOSTILE, epoch=0, part=big, attempt=big, batches=big,
                      rows=big),
               header(Kind.PARTITION_COMMIT, req=4, stream=HOSTILE, epoch=0, parts=[big] * 3000),
               header(Kind.PARTITION_COMMIT, req=5, stream=HOSTILE, epoch=0, parts=["a", 1, 2]),
               header(Kind.EPOCH_CLOSE, req=6, stream=HOSTILE, epoch=0, partitions=big, expected=big),
               header(Kind.EPOCH_RECOVER, req=7, stream="recover", epoch=0, partitions=10, delivery="stream",
                      carries=[0, big], recovered=[], lost=[], reset=False),
               header(Kind.EPOCH_RECOVER, req=8, stream="recover", epoch=0, partitions=10, delivery="stream",
                      carries=["a", 1], recovered=[], lost=[1, 2], reset=False)]
    assert all(r["kind"] == Kind.ERROR for r in peer.volley("control", [[m] for m in control]))
    ranks = [[header(Kind.CREDIT, window=big, window_bytes=big)],
             [header(Kind.ACK, ids=[big] * 3000)],
             [header(Kind.ACK, ids=["a", 1, 2])],
             [header(Kind.RETURN, stream=HOSTILE, epoch=0, ids=[big, big, big, "a"], kept=big)],
             [header(Kind.HELLO, **hello(HOSTILE, rank=big, size=big))],
             [header(Kind.HELLO, **hello(HOSTILE, resume=True)), b"\0" * 23, b""],          # ids not whole
             [header(Kind.RECLAIM, stream=HOSTILE, epoch=0, lost="x", entries=2**62), b"\0" * 40]]
    assert all(r["kind"] == Kind.ERROR for r in peer.volley("ranks", ranks))
    return len(batches)


def hello(stream: str, rank: int = 0, size: int = 1, session: str = "hostile", resume: bool = False) -> dict:
    return {"req": 9, "role": "rank", "stream": stream, "rank": rank, "size": size, "even": False,
            "session": session, "resume": resume, "ended": -1}


def epochs_and_streams(peer: Hostile) -> int:
    """Epochs of one stream opened and never fed, past the limit, and one epoch each of 300 streams. Returns the
    refusals."""
    opens = [[header(Kind.EPOCH_OPEN, req=n, stream=HOSTILE, epoch=n, partitions=4 if n == 0 else 1,
                     delivery="stream", commit="driver" if n == 0 else "end")] for n in range(MAX_OPEN_EPOCHS + 200)]
    replies = []
    for at in range(0, len(opens), 100):
        replies += peer.volley("control", opens[at:at + 100])
    assert refusals(replies) == 200 and all("epochs open" in r["reason"] for r in replies if r["kind"] == Kind.ERROR)
    others = [[header(Kind.EPOCH_OPEN, req=n, stream=f"{HOSTILE}-{n}", epoch=n, partitions=1, delivery="stream")]
              for n in range(300)]
    assert all(r["kind"] == Kind.OK for r in peer.volley("control", others))
    return 200


def losses_and_sessions(peer: Hostile) -> int:
    """A rank of the hostile stream: sessions of 30 KB, 2,000 RECLAIMs of distinct 30 KB losses, losses past the
    limit, a RECLAIM from each of 200 sessions. Returns the refusals."""
    welcome = peer.volley("ranks", [[header(Kind.HELLO, **hello(HOSTILE))]])
    assert welcome[0]["kind"] == Kind.WELCOME, welcome
    long_sessions = [[header(Kind.HELLO, **hello(HOSTILE, session=f"{n}" + "s" * 30_000))] for n in range(200)]
    assert refusals(peer.volley("ranks", long_sessions)) == 200
    refused = 200
    rng = random.Random(11)
    for _ in range(20):                     # 2,000 distinct losses of 30 KB: each refused, none kept
        volley = [[header(Kind.RECLAIM, stream=HOSTILE, epoch=0, lost=rng.randbytes(15_000).hex(), entries=0), b""]
                  for _ in range(100)]
        assert refusals(peer.volley("ranks", volley)) == 100
        refused += 100
    short = [[header(Kind.RECLAIM, stream=HOSTILE, epoch=0, lost=f"{n:016x}", entries=0), b""]
             for n in range(MAX_LOSSES + 50)]
    for frames in short:
        peer.send("ranks", frames)
    assert refusals(peer.volley("ranks", [], replies=50)) == 50       # RECLAIM has no reply; its refusal does
    refused += 50
    for n in range(200):                    # one connection, a new session each time: a RECLAIM of each kept
        assert peer.volley("ranks", [[header(Kind.HELLO, **hello(HOSTILE, session=f"session-{n}"))]])[0]["kind"] \
            == Kind.WELCOME
        peer.send("ranks", [header(Kind.RECLAIM, stream=HOSTILE, epoch=1, lost="x", entries=0), b""])
    return refused


def recovery_and_attempts(peer: Hostile) -> tuple[int, int]:
    """EPOCH_RECOVER with losses long and many, and ranges that add up past the limit; PARTITION_ENDs and batches
    of more attempts than a partition keeps. Returns the refusals on the control socket and on the feed."""
    refused = 0
    bad_losses = [["f" * 30_000], [f"{n}" for n in range(MAX_LOSSES + 1)]]
    replies = peer.volley("control", [[header(Kind.EPOCH_RECOVER, req=1, stream="recover", epoch=0,
                                              partitions=10, delivery="stream", carries=[0, 10], recovered=[0, 1],
                                              lost=lost, reset=False)] for lost in bad_losses])
    assert refusals(replies) == 2
    refused += 2
    per = 3_000                             # disjoint single-partition ranges per request (a header of ~30 KB)
    volley = [[header(Kind.EPOCH_RECOVER, req=2, stream="recover", epoch=1, partitions=MAX_PARTITIONS,
                      delivery="stream", recovered=[], lost=["x"], reset=False,
                      carries=[v for i in range(per) for v in (k * 2 * per + 2 * i, k * 2 * per + 2 * i + 1)])]
              for k in range(MAX_RECOVERY_RANGES // per + 3)]
    replies = peer.volley("control", volley)
    accepted = MAX_RECOVERY_RANGES // per
    assert [r["kind"] for r in replies] == [Kind.OK] * accepted + [Kind.ERROR] * 3, replies[-1]
    refused += 3
    ends = [[header(Kind.PARTITION_END, req=3, stream=HOSTILE, epoch=0, part=0, attempt=a, batches=5, rows=10)]
            for a in range(MAX_ATTEMPTS + 40)]
    replies = peer.volley("control", ends, replies=40)      # waiting ones are answered when their batches come
    assert refusals(replies) == 40
    refused += 40
    for attempt in range(MAX_ATTEMPTS + 60):
        peer.send("feed", codec.encode_batch(HOSTILE, 1, 0, 0, {"id": np.arange(2)}, attempt=attempt))
    return refused, 60


# ---- the test ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("journal", [False, True], ids=["in-memory", "journal"])
def test_hostile_input_on_every_socket_leaves_a_real_stream_exact_and_the_broker_bounded(start_broker_process,
                                                                                       context, tmp_path, journal):
    journalled = ["--journal", str(tmp_path / "journal")] if journal else []
    broker = start_broker_process("--max-message", "4MiB", "--heartbeat", "200ms", *journalled)
    files = 2 * MAX_OPEN_FILES if journal else 0       # the journal's open epochs' files, beside the connections
    pid = broker.proc.pid
    broker.stats()                          # its first reply made: the imports and buffers of a serving broker
    rss_before, fds_before = rss(pid), fds(pid)
    peak_fds = [fds_before]

    # the real stream: two ranks of a group (granted steps), fed without Spark, a partition after each attack
    received: dict[int, list[np.ndarray]] = {0: [], 1: []}
    errors: list[BaseException] = []
    rank_context = zmq.Context()

    def rank_loop(rank: int) -> None:
        try:
            with BatchStream(broker.ranks, rank=rank, size=2, stream=VALID, context=rank_context, prefetch=2,
                             timeout=WAIT * 2) as stream:
                for batch in stream.epoch():
                    np.testing.assert_array_equal(batch["x"], batch["id"].astype(np.float32))
                    received[rank].append(batch["id"].copy())
        except BaseException as error:        # asserted below
            errors.append(error)

    phases_done = [threading.Event() for _ in range(PARTITIONS)]
    fed = threading.Event()

    def feed() -> None:
        try:
            with ControlClient(broker.control, WAIT) as driver:
                driver.request(Kind.EPOCH_OPEN, stream=VALID, epoch=0, partitions=PARTITIONS, delivery="stream")
                for part in range(PARTITIONS):
                    assert phases_done[part].wait(WAIT * 3), f"attack {part} did not finish"
                    ids = np.arange(part * ROWS, (part + 1) * ROWS)
                    stream_partition(({"id": ids[i:i + 500], "x": ids[i:i + 500].astype(np.float32)}
                                      for i in range(0, ROWS, 500)), broker.feed, broker.control, VALID, 0, part, 0,
                                     WAIT)
                driver.request(Kind.EPOCH_CLOSE, stream=VALID, epoch=0, partitions=PARTITIONS)
            fed.set()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(2)]
    threads.append(threading.Thread(target=feed, daemon=True))
    for thread in threads:
        thread.start()
    peer = Hostile(context, broker)
    rng = random.Random(5)
    phases: list[Callable[[], object]] = [
        lambda: random_noise(peer, context, broker, rng),
        lambda: (huge_sizes(peer), epochs_and_streams(peer)),
        lambda: losses_and_sessions(peer),
        lambda: recovery_and_attempts(peer),
    ]
    try:
        results = []
        for phase, done in zip(phases, phases_done):
            results.append(phase())
            peer.drain()
            peak_fds.append(fds(pid))
            done.set()
        for thread in threads:
            thread.join(WAIT * 2)
        assert not any(t.is_alive() for t in threads), f"the stream did not finish: {errors}"
        assert not errors, errors
        assert fed.is_set()
        status = run_child([sys.executable, "-m", "sparkbus.broker.cli", "status", broker.control], timeout=WAIT)
        stats = broker.stats(timeout=WAIT)
    finally:
        peer.close()
        if not any(t.is_alive() for t in threads):     # a rank still in its stream would hold term() up
            rank_context.term()

    # the stream: every row exactly once, over the two ranks
    ids = np.sort(np.concatenate(received[0] + received[1]))
    np.testing.assert_array_equal(ids, np.arange(PARTITIONS * ROWS))
    assert received[0] and received[1]

    # the broker: up, answering, no internal error, memory and connections bounded
    assert broker.proc.poll() is None
    assert status.returncode == 0 and VALID in status.stdout, status.stderr[-2000:]
    log = broker.log.read_text(errors="replace")
    assert "Traceback" not in log and "internal error" not in log, log[-3000:]
    grown = rss(pid) - rss_before
    assert grown < RSS_GROWTH, f"the broker's RSS grew by {grown / 2**20:.1f} MiB"
    assert max(peak_fds) < fds_before + FD_GROWTH + files, (fds_before, peak_fds)
    deadline = time.monotonic() + WAIT                    # the hostile connections closed: their descriptors go
    while fds(pid) > fds_before + 4 + files and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fds(pid) <= fds_before + 4 + files, (fds_before, fds(pid))

    # what it refused, counted; what it keeps, bounded
    rejected = stats["broker"]["rejected"]
    assert not any("internal" in by_reason for by_reason in rejected.values()), rejected
    feed_malformed, epochs_refused = results[1]
    control_refused, feed_refused = results[3]
    assert rejected["feed"].get("malformed", 0) >= feed_malformed, rejected
    assert rejected["feed"].get("refused", 0) >= feed_refused, rejected
    assert rejected["control"].get("refused", 0) >= epochs_refused + control_refused, rejected
    assert rejected["ranks"].get("refused", 0) >= results[2], rejected
    assert sum(rejected["control"].values()) > 100 and sum(rejected["ranks"].values()) > 2_000, rejected
    hostile = stats["streams"][HOSTILE]
    assert len(hostile["epochs"]) == MAX_OPEN_EPOCHS
    if journal:             # on disk: the open epochs' files, and those of epochs whose reclaims are kept; the valid
        #                     stream's epoch was delivered: its files are gone
        open_epochs = sum(len(s["epochs"]) for name, s in stats["streams"].items() if name != VALID)
        on_disk = list((tmp_path / "journal").glob("*/epoch-*.log"))
        assert not list((tmp_path / "journal" / VALID.encode().hex()).glob("epoch-*"))
        assert open_epochs <= len(on_disk) <= open_epochs + MAX_RECLAIM_EPOCHS * len(stats["streams"]), (
            open_epochs, len(on_disk))
    assert stats["streams"][VALID]["epochs"]["0"]["rows_in"] == PARTITIONS * ROWS
    assert peer.sent > 5_000
