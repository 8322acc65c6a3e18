"""The broker's rules without sockets: a ledger driven as the daemon drives it, with real batch frames, fake
identities, and :class:`Wire` standing in for the ranks socket.

Ranks state their windows and acknowledge batches through :func:`window` and :func:`ack` (and the ledger
machine's ``_window`` and ``_acknowledge``), so that a change of how they do so is mostly an edit here.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkbus.broker.books import Outcome
from sparkbus.broker.journal import Journal
from sparkbus.broker.ledger import Ledger
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind

STREAM = "s"


def batch_frames(epoch, part, seq, attempt=0, rows=2, salt=0, stream=STREAM, splits=None):
    """Frames of one batch; ``salt`` changes the data (and so the checksum) as a recomputed partition would.

    ``splits``: a pack of small batches (one message, one id) with these rows each (``rows`` is then their sum).
    """
    rows = rows if splits is None else sum(splits)
    values = np.arange(rows, dtype="<i8") + 1000 * part + 100 * seq + salt
    return codec.encode_batch(stream, epoch, part, seq, {"x": values}, attempt=attempt, splits=splits)


def push(ledger, epoch, part, seq, attempt=0, *, journalled=False, **kw):
    """Hand one batch (:func:`batch_frames` with ``kw``) to the ledger as the daemon does (validated header, the
    frames as they came). ``journalled``: as live traffic, its header's bytes given, so the ledger journals it and
    its observers hear of it."""
    frames = batch_frames(epoch, part, seq, attempt, **kw)
    return ledger.accept_batch(protocol.unpack_header(frames[0]), frames, frames[0] if journalled else None)


def nbytes(epoch, part, seq, **kw):
    """The bytes of the batch :func:`batch_frames` makes."""
    return sum(len(f) for f in batch_frames(epoch, part, seq, **kw))


def end(ledger, epoch, part, attempt, batches, req=1, identity=None, stream=STREAM):
    """A task's PARTITION_END; the task's identity names its attempt so replies can be told apart."""
    identity = identity or f"task-{part}-{attempt}".encode()
    return ledger.end_partition(identity, {"req": req, "stream": stream, "epoch": epoch, "part": part,
                                           "attempt": attempt, "batches": batches, "rows": 2 * batches})


def feed(ledger, epoch, partitions, batches, delivery="stream", close=True):
    """Open an epoch, stream ``batches`` batches into each partition with attempt 0, commit, close."""
    ledger.open_epoch(STREAM, epoch, partitions, delivery)
    for part in range(partitions):
        for seq in range(batches):
            push(ledger, epoch, part, seq)
        assert end(ledger, epoch, part, 0, batches)[0].kind == Kind.PARTITION_COMMITTED
    if close:
        assert ledger.close_epoch(STREAM, epoch, partitions) == []


def join(ledger, identity, h, prefetch=0, prefetch_bytes=0):
    """Admit a rank (HELLO) that then states a window of ``prefetch`` batches or ``prefetch_bytes`` bytes (CREDIT);
    returns its state."""
    ledger.join_rank(identity, h)
    if prefetch or prefetch_bytes:
        window(ledger, identity, prefetch, prefetch_bytes)
    return ledger.rank(identity)


def window(ledger, identity, batches, nbytes=0):
    """The rank on ``identity`` states its window (CREDIT): ``batches`` in flight, or ``nbytes`` bytes of them."""
    ledger.set_window(ledger.rank(identity), batches, nbytes)


def ack(ledger, identity, ids):
    """The rank on ``identity`` acknowledges ``ids`` (sent flat, as on the wire); returns how many were not in
    flight to it."""
    return ledger.acknowledge(ledger.rank(identity), [x for i in ids for x in i])


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


@pytest.fixture
def journals():
    """``journals(directory, **options)``: a Journal on ``directory``; every one made is closed after the test."""
    made = []

    def make(directory, **options):
        journal = Journal(directory, **options)
        made.append(journal)
        return journal

    yield make
    for journal in made:
        journal.close()


@pytest.fixture
def restart(journals):
    """``restart(directory, hold=False)``: a new Ledger replayed from the journal in ``directory``, as a restarted
    broker's; without ``hold``, as if every consumer were back (the hold for independent consumers is over)."""

    def replayed(directory, hold=False):
        ledger = Ledger(journals(directory))
        ledger.replay()
        if not hold:                            # the consumers are all back: what a restart's hold waits for
            for stream in ledger.streams.values():
                stream.held_until = 0.0
        return ledger

    return replayed
