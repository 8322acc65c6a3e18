"""Helpers shared by the unit and integration tests: bounded waits, free loopback ports, a rank's HELLO, a
stand-in broker (over a socket) and a stand-in ranks socket (for the ledger). The fixtures are in ``harness``."""

from __future__ import annotations

import socket
import threading
import time

import zmq

from sparkbus.broker.books import Outcome
from sparkbus.launch.processes import wait_for
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind, pack_header, unpack_header

# wait_for: the tests' bounded wait, the one the benchmark and the demo use (WaitTimeout says what it awaited)
__all__ = ["FakeBroker", "Wire", "free_port_triple", "hello", "joined", "key_directory", "recv_header", "send",
           "send_hello", "wait_for"]


def steps_of(batches: int, size: int, remainder: str = "split") -> int:
    """The steps each of ``size`` ranks takes of an epoch of ``batches`` batches from one broker: the share, and
    one more (a piece of the batches left over) unless they are dropped (``BatchStream(remainder=)``)."""
    return batches // size + (1 if batches % size and remainder != "drop" else 0)


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


def hello(rank=0, size=1, *, even=False, stream="s", session="", resume=False, ended=-1, req=1,
          grants=None, got=None) -> dict:
    """A rank's HELLO (every field of ``protocol.SCHEMAS[Kind.HELLO]``), as the ledger's ``join_rank`` takes it;
    ``grants``: the optional field (a rank whose steps the broker grants).

    The default ``session`` is empty: a rank that cannot rejoin, so what it held is requeued as soon as it goes.
    """
    h = {"req": req, "role": "rank", "stream": stream, "rank": rank, "size": size, "even": even,
         "session": session, "resume": resume, "ended": ended}
    if grants is not None:
        h["grants"] = grants
    if got is not None:
        h["got"] = got
    return h


def send_hello(sock, rank=0, size=1, **fields):
    """Send a rank's HELLO on ``sock`` (``fields`` as :func:`hello` takes them)."""
    send(sock, Kind.HELLO, **hello(rank, size, **fields))


class Wire:
    """Stands in for the daemon's ranks socket, handed to the ledger's sending rules: it records what was sent to
    which connection, in sending order.

    ``refuse``: sends to these fail for now (EAGAIN, ``Outcome.FULL``); ``gone``: these connections are found
    closed (``Outcome.GONE``); ``cut``: sends to these succeed but never arrive (a dead link, not yet noticed).
    """

    def __init__(self, ledger):
        self.ledger = ledger
        self.sent: list[tuple[bytes, tuple]] = []      # (rank identity, batch id) as they arrived
        self.ends: list[tuple[bytes, int]] = []        # (rank identity, epoch)
        self.headers: list[tuple[bytes, dict]] = []    # (rank identity, header) of everything that arrived
        self.refuse: set[bytes] = set()
        self.gone: set[bytes] = set()
        self.cut: set[bytes] = set()

    def transmit(self, identity, frames):
        """The daemon's ``_transmit``: I/O only, never a call back into the ledger."""
        if identity in self.gone:
            return Outcome.GONE
        if identity in self.refuse:
            return Outcome.FULL
        if identity not in self.cut:
            header = protocol.unpack_header(frames[0])
            self.headers.append((identity, header))
            if header["kind"] == Kind.EPOCH_END:
                self.ends.append((identity, header["epoch"]))
            elif header["kind"] == Kind.BATCH:
                self.sent.append((identity, protocol.batch_id(header)))
        return Outcome.SENT

    def dispatch(self, stream="s"):
        self.ledger.dispatch(self.ledger.streams[stream], self.transmit)

    def to(self, identity):
        """The ids of the batches that arrived at ``identity``, in order."""
        return [i for who, i in self.sent if who == identity]

    def ended(self, identity):
        """The epochs whose end arrived at ``identity``, in order."""
        return [epoch for who, epoch in self.ends if who == identity]

    def of_kind(self, identity, kind):
        """The headers of ``kind`` that arrived at ``identity``, in order."""
        return [h for who, h in self.headers if who == identity and h["kind"] == kind]


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
