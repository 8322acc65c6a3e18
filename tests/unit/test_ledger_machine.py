"""A state machine over the ledger (`hypothesis.stateful`): tasks, drivers and ranks in any order, restarts too.

The invariant is the delivery promise: every committed row is delivered once, nothing else is. Precisely:

- a batch goes to a rank only as the copy the rules choose: in stream delivery the first copy the broker kept
  of that (partition, seq); in atomic delivery the committed attempt's copy, and only once it committed;
- a batch goes to a rank only when its window has room for it (fewer than ``window`` batches in flight, or the
  batch fits in ``window_bytes`` beside them), and after a dispatch no rank with room is left idle while the
  delivering epoch has batches queued;
- a batch is *consumed* when a rank acknowledges it, and no id is consumed twice, even though a batch whose rank
  died or whose broker restarted before the acknowledgement is sent again;
- ``ledger.buffered`` is always the bytes of the batches queued, in flight and held for an atomic commit, and a
  rank's ``inflight_bytes`` the bytes of the batches in flight to it;
- the figures count batches, a pack of small batches as many as it carries (``batches_in``, ``batches_out``,
  ``acked``, ``redelivered``, a rank's ``batches`` and ``acked``), and ``duplicates`` counts messages;
- at the end (every partition committed, every epoch closed, ranks with room acknowledging everything), each
  committed partition's batches were consumed exactly once, as its committing attempt sent them, unless the
  partition was reported diverged at close in stream delivery (where the promise is "detected", not "exact").

Tasks are modelled per attempt: attempts 0 and 1 are Spark retries that recompute the partition identically;
attempt 2 recomputes it differently (other data from seq 1 on, and one batch more). Any attempt may send a seq
as a pack of two one-row batches (the same rows, so the same checksum, as that seq sent alone).
"""

from __future__ import annotations

import itertools
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sparkbus.broker.books import Outcome
from sparkbus.broker.journal import Journal
from sparkbus.broker.ledger import Ledger, Rejected
from sparkbus.broker.state import MAX_WINDOW
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import STREAM, batch_frames, hello

MAX_EPOCHS = 3
NEVER_OPENED = 99
DELIVERY = st.sampled_from(protocol.DELIVERY_MODES)
BATCHES = st.lists(st.sampled_from([2, 1, 3, 0]), min_size=1, max_size=2)
PARTS = st.integers(0, 1)
ATTEMPTS = st.sampled_from([0, 1, 2])
DIVERGENT = 2            # the attempt that recomputes its partition in another way
FINISHER = 9             # the attempt that completes, at the end, every partition still uncommitted
WHICH = st.integers(0, 7)
PACK = [1, 1]            # a seq sent as a pack: two one-row batches (a batch alone has two rows)
# A window's bytes: none, about one batch (a batch alone has 101 bytes, a pack 111), two, three.
WINDOW_BYTES = st.sampled_from([0, 120, 230, 340])


def planned(batches: int, attempt: int) -> int:
    """How many batches an attempt sends for a partition whose honest attempts send ``batches``."""
    return batches + 1 if attempt == DIVERGENT else batches


def salt(attempt: int, seq: int) -> int:
    return 50 if attempt == DIVERGENT and seq >= 1 else 0


def task(epoch: int, part: int, attempt: int) -> bytes:
    """The control identity of a task attempt: replies say which attempt they answer."""
    return f"task {epoch} {part} {attempt}".encode()


def journal_directory() -> str:
    # Commits and closes are fsynced; on tmpfs that costs nothing, so the machine can run many of them.
    shm = "/dev/shm"
    return tempfile.mkdtemp(prefix="sparkbus-machine-", dir=shm if os.path.isdir(shm) else None)


class Copy(NamedTuple):
    """One attempt's copy of a batch: which attempt, its data's checksum, the batches it carries (a pack: 2)."""

    attempt: int
    checksum: int
    count: int


@dataclass
class RankModel:
    number: int
    window: int = 0
    window_bytes: int = 0
    held: dict = field(default_factory=dict)      # batch id -> the Copy it was sent
    nbytes: dict = field(default_factory=dict)    # batch id -> its bytes, while held
    ended: set = field(default_factory=set)       # epochs it was told had ended
    batches: int = 0                              # batches sent to it, a pack counting its batches
    acked: int = 0

    def has_room(self, nbytes: int) -> bool:
        """The window rule, as documented: by batches or by bytes, whichever admits more."""
        held = len(self.held)
        return held < self.window or (held < MAX_WINDOW and sum(self.nbytes.values()) + nbytes <= self.window_bytes)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.directory: str | None = None
        self.journals: list[Journal] = []
        self.ledger = Ledger()
        self.size, self.even = 1, False
        self.opened: dict[int, dict] = {}                 # epoch -> partitions, delivery, batches per partition
        self.closed: set[int] = set()
        self.diverged: dict[int, set[int]] = {}           # epoch -> partitions the OK to EPOCH_CLOSE named
        self.sent: dict[tuple, set[int]] = {}             # (epoch, part, attempt) -> seqs the broker accepted
        self.copies: dict[tuple, Copy] = {}               # (epoch, part, attempt, seq) -> the copy it sent
        self.splits: dict[tuple, list | None] = {}        # (epoch, part, attempt, seq) -> its splits (None: alone)
        self.first: dict[tuple, Copy] = {}                # batch id -> the copy kept first
        self.committed: dict[tuple, tuple] = {}           # (epoch, part) -> (attempt, its seqs when it committed)
        self.pending: dict[tuple, int] = {}               # (epoch, part, attempt) -> batches its PARTITION_END said
        self.consumed: dict[tuple, Copy] = {}             # batch id -> the copy a rank acknowledged
        self.duplicates: Counter = Counter()              # epoch -> messages accepted but not kept
        self.redelivered: Counter = Counter()             # epoch -> batches sent again (since the last restart)
        self.ever_sent: set = set()                       # batch ids sent to a rank (since the last restart)
        self.ranks: dict[bytes, RankModel] = {}
        self.identities = itertools.count()

    # ---- helpers --------------------------------------------------------------------------------------------

    def _journal(self) -> Journal:
        journal = Journal(self.directory)
        self.journals.append(journal)
        return journal

    def _pick(self, which: int, among=None) -> bytes:
        identities = sorted(self.ranks if among is None else among)
        return identities[which % len(identities)]

    def _epoch(self, which: int) -> int:
        return sorted(self.opened)[which % len(self.opened)]

    def _part(self, epoch: int, part: int) -> int:
        return part % self.opened[epoch]["partitions"]

    def _count(self, epoch: int, part: int, attempt: int) -> int:
        return planned(self.opened[epoch]["batches"][part], attempt)

    def _frames(self, epoch: int, part: int, attempt: int, seq: int, splits=None) -> list:
        return batch_frames(epoch, part, seq, attempt, salt=salt(attempt, seq), splits=splits)

    def _push(self, epoch: int, part: int, attempt: int, seq: int, splits=None) -> list:
        frames = self._frames(epoch, part, attempt, seq, splits)
        return self.ledger.accept_batch(protocol.unpack_header(frames[0]), frames,
                                        frames[0] if self.directory else None)

    def _answered(self, replies, expected: list[tuple[Kind, tuple]]) -> None:
        """Check the replies a step produced against the model's prediction, then apply them."""
        assert [(r.kind, r.identity) for r in replies] == [(kind, task(*key)) for kind, key in expected]
        for kind, (epoch, part, attempt) in expected:
            self.pending.pop((epoch, part, attempt), None)
            if kind == Kind.PARTITION_COMMITTED and (epoch, part) not in self.committed:
                self.committed[(epoch, part)] = (attempt, frozenset(self.sent.get((epoch, part, attempt), ())))

    def _window(self, identity: bytes, batches: int, nbytes: int = 0) -> None:
        """The rank states its window (CREDIT): absolute, whatever it has in flight."""
        self.ledger.set_window(self.ledger.rank(identity), batches, nbytes)
        self.ranks[identity].window, self.ranks[identity].window_bytes = batches, nbytes

    def _forget(self, identity: bytes) -> None:
        """A rank is gone: what it held unacknowledged was not consumed and will be sent again."""
        del self.ranks[identity]

    def _join(self, number: int) -> bytes:
        identity = f"rank {next(self.identities)}".encode()
        self.ledger.join_rank(identity, hello(rank=number, size=self.size, even=self.even))
        self.ranks[identity] = RankModel(number)
        return identity

    # ---- the feed: driver and tasks ------------------------------------------------------------------------

    @initialize(size=st.sampled_from([1, 2]), even=st.booleans(), journal=st.sampled_from([True, False]),
                prefetch=st.integers(1, 3), prefetch_bytes=WINDOW_BYTES, delivery=DELIVERY, batches=BATCHES)
    def start(self, size, even, journal, prefetch, prefetch_bytes, delivery, batches):
        """A broker (with a journal or not), a job of ``size`` ranks waiting for the stream, a first epoch."""
        self.size, self.even = size, even
        if journal:
            self.directory = journal_directory()
            self.ledger = Ledger(self._journal())
        for number in range(size):
            self._window(self._join(number), prefetch, prefetch_bytes)
        self.open_epoch(0, delivery, batches)

    @precondition(lambda self: len(self.opened) < MAX_EPOCHS)
    @rule(gap=st.sampled_from([0, 0, 0, 1]), delivery=DELIVERY, batches=BATCHES)
    def open_epoch(self, gap, delivery, batches):
        """The driver opens the next epoch (numbers may skip one: the lowest epoch not ended goes first).

        ``batches``: per partition, how many batches its honest attempts send.
        """
        epoch = max(self.opened, default=-1) + 1 + gap
        self.ledger.open_epoch(STREAM, epoch, len(batches), delivery)
        self.opened[epoch] = {"partitions": len(batches), "delivery": delivery, "batches": batches}

    @rule(which=WHICH, part=PARTS, attempt=ATTEMPTS, burst=st.integers(1, 3), again=st.booleans(),
          pack=st.booleans())
    def push_batches(self, which, part, attempt, burst, again, pack):
        """A task attempt's next batches (and with ``again``, one it sent already), then the broker dispatches.

        ``which`` picks an opened epoch, or one never opened; with ``pack``, each is a pack of small batches.
        """
        epochs = sorted(self.opened) + [NEVER_OPENED]
        epoch = epochs[which % len(epochs)]
        if epoch == NEVER_OPENED:
            with pytest.raises(Rejected) as refused:
                self._push(epoch, 0, attempt, 0)
            assert refused.value.reason == "unknown_epoch"
            return
        for _ in range(burst):
            self._push_next(epoch, self._part(epoch, part), attempt, pack=pack)
        if again:
            self._push_next(epoch, self._part(epoch, part), attempt, again=True)
        self._dispatch()

    def _push_next(self, epoch, part, attempt, again=False, pack=False) -> None:
        key = (epoch, part, attempt)
        sent = self.sent.setdefault(key, set())
        if again and sent:
            seq = max(sent)
        else:
            seq = len(sent)
            if seq >= self._count(epoch, part, attempt):
                return                          # this attempt has sent everything
        # a message sent again is the same message; a new one is a pack or not as the rule said
        splits = self.splits.setdefault(key + (seq,), PACK if pack else None)
        stream = self.ledger.streams[STREAM]
        if epoch in stream.finished or seq in sent:
            reason = "late_duplicate" if epoch in stream.finished else "replayed"
            with pytest.raises(Rejected) as refused:
                self._push(epoch, part, attempt, seq, splits)
            assert refused.value.reason == reason
            assert reason != "late_duplicate" or epoch in self.closed
            return
        batch_id = (epoch, part, seq)
        was_committed = (epoch, part) in self.committed
        kept = not was_committed and (batch_id not in self.first or self.opened[epoch]["delivery"] == "atomic")
        replies = self._push(epoch, part, attempt, seq, splits)
        sent.add(seq)
        copy = Copy(attempt, codec.batch_checksum(self._frames(epoch, part, attempt, seq, splits)[1:]),
                    1 if splits is None else len(splits))
        self.copies[key + (seq,)] = copy
        if not kept:
            self.duplicates[epoch] += 1         # one message, however many batches it carries
        if batch_id not in self.first and not was_committed:
            self.first[batch_id] = copy
        waiting = self.pending.get(key)
        self._answered(replies, [(Kind.PARTITION_COMMITTED, key)] if waiting is not None and len(sent) >= waiting
                       else [])

    @precondition(lambda self: self.opened)
    @rule(which=WHICH, part=PARTS, attempt=ATTEMPTS, short=st.booleans())
    def end_partition(self, which, part, attempt, short):
        """A task attempt's PARTITION_END; with ``short``, it counts one batch fewer than the attempt sends."""
        epoch = self._epoch(which)
        part = self._part(epoch, part)
        key = (epoch, part, attempt)
        batches = max(self._count(epoch, part, attempt) - short, 0)
        request = {"req": 1, "stream": STREAM, "epoch": epoch, "part": part, "attempt": attempt,
                   "batches": batches, "rows": 2 * batches}
        if epoch in self.closed:
            with pytest.raises(ProtocolError, match="is not open"):
                self.ledger.end_partition(task(*key), request)
            return
        replies = self.ledger.end_partition(task(*key), request)
        got = len(self.sent.get(key, ()))
        if (epoch, part) in self.committed or got == batches:
            self._answered(replies, [(Kind.PARTITION_COMMITTED, key)])
        elif got > batches:
            self._answered(replies, [(Kind.ERROR, key)])
        else:
            self._answered(replies, [])
            self.pending[key] = batches

    @precondition(lambda self: self.opened)
    @rule(which=WHICH, part=PARTS, attempt=ATTEMPTS, end_first=st.booleans(), pack=st.booleans())
    def task_runs_to_its_end(self, which, part, attempt, end_first, pack=False):
        """A task attempt sends what it has left (as packs, with ``pack``) and its PARTITION_END, which may reach
        the broker first."""
        epoch = self._epoch(which)
        if end_first:
            self.end_partition(which, part, attempt, short=False)
        for _ in range(self._count(epoch, self._part(epoch, part), attempt)):
            self._push_next(epoch, self._part(epoch, part), attempt, pack=pack)
        if not end_first:
            self.end_partition(which, part, attempt, short=False)
        self._dispatch()                        # as the broker's loop does after reading a burst

    @precondition(lambda self: self.opened.keys() - self.closed)
    @rule(which=WHICH)
    def close_epoch(self, which):
        """The driver closes an epoch: refused unless every partition committed, and again once closed."""
        epoch = sorted(self.opened.keys() - self.closed)[which % len(self.opened.keys() - self.closed)]
        self._close(epoch)
        self._close(epoch)                      # a driver repeating its request: refused now

    def _close(self, epoch: int) -> None:
        terms = self.opened[epoch]
        if epoch in self.closed or any((epoch, p) not in self.committed for p in range(terms["partitions"])):
            with pytest.raises(ProtocolError):
                self.ledger.close_epoch(STREAM, epoch, terms["partitions"])
            return
        self.diverged[epoch] = set(self.ledger.close_epoch(STREAM, epoch, terms["partitions"]))
        self.closed.add(epoch)

    # ---- ranks ----------------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.ranks) < 3)
    @rule(number=st.integers(0, 1), prefetch=st.integers(0, 3), prefetch_bytes=WINDOW_BYTES)
    def join(self, number, prefetch, prefetch_bytes):
        """A rank says HELLO, then states its window."""
        number %= self.size
        if self.size > 1 and any(r.number == number for r in self.ranks.values()):
            with pytest.raises(ProtocolError, match="already connected"):
                self.ledger.join_rank(b"intruder", hello(rank=number, size=self.size, even=self.even))
            return
        identity = self._join(number)
        self._window(identity, prefetch, prefetch_bytes)

    @precondition(lambda self: self.ranks)
    @rule(which=WHICH, batches=st.integers(0, 3), nbytes=WINDOW_BYTES)
    def window(self, which, batches, nbytes):
        """A rank states another window: larger, or smaller than what it has in flight."""
        self._window(self._pick(which), batches, nbytes)

    @rule(consume=st.sampled_from([1, 2, 0]), failure=st.sampled_from([None, "refused", "gone"]), which=WHICH)
    def broker_loop(self, consume, failure, which):
        """One turn of the broker's loop: each rank's training loop has consumed up to ``consume`` batches and
        acknowledged them (the ACK frees room in its window); then the broker hands out batches, and a send to one
        rank may fail (EAGAIN) or find it gone."""
        for identity, model in sorted(self.ranks.items()):
            ids = list(model.held)[:consume]
            if ids:
                self._acknowledge(identity, ids)
        self._dispatch(failure, which)

    def _dispatch(self, failure=None, which=0):
        stream = self.ledger.streams.get(STREAM)
        if stream is None:
            return
        victim = self._pick(which) if failure and self.ranks else None

        def transmit(identity, frames):        # the daemon's I/O: it never calls back into the ledger
            header = protocol.unpack_header(frames[0])
            ep = stream.epochs[header["epoch"]]
            if header["kind"] == Kind.EPOCH_END:
                self._ended(identity, ep)
                return Outcome.SENT
            if identity == victim:
                if failure == "gone":
                    self._forget(identity)
                    return Outcome.GONE
                return Outcome.FULL
            batch = next(b for b in ep.queue if b.id == protocol.batch_id(header))
            assert frames is batch.frames
            self._delivered(identity, batch)
            return Outcome.SENT

        self.ledger.dispatch(stream, transmit)
        # No rank with room is left idle while the epoch being delivered has batches queued (but the one whose
        # send failed: the batch waits for the next turn).
        ep = stream.delivering()
        if stream.ready() and ep is not None and ep.queue:
            idle = [i for i in stream.ranks if i != victim and self.ranks[i].has_room(ep.queue[0].nbytes)]
            assert not idle, f"ranks {idle} have room and {len(ep.queue)} batches of epoch {ep.epoch} wait"

    def _delivered(self, identity: bytes, batch) -> None:
        """A batch leaves for a rank: check it is the right copy of a batch nobody consumed or holds."""
        header = protocol.unpack_header(batch.frames[0])
        epoch, part, seq = batch.id
        assert protocol.batch_id(header) == batch.id
        assert codec.batch_checksum(batch.frames[1:]) == header["checksum"], "payload damaged on the way"
        assert batch.id not in self.consumed, f"{batch.id} sent again after it was consumed"
        assert all(batch.id not in r.held for r in self.ranks.values()), f"{batch.id} sent to two ranks"
        assert epoch not in self.ranks[identity].ended, f"{batch.id} sent after EPOCH_END({epoch})"
        stream = self.ledger.streams[STREAM]
        assert all(ep.end_sent for n, ep in stream.epochs.items() if n < epoch), "epochs out of order"
        splits = header.get("splits")
        copy = Copy(header["attempt"], header["checksum"], 1 if splits is None else len(splits))
        assert batch.count == copy.count and batch.nbytes == sum(len(f) for f in batch.frames)
        if self.opened[epoch]["delivery"] == "atomic":
            attempt, seqs = self.committed[(epoch, part)]
            assert header["attempt"] == attempt and seq in seqs, "atomic: not the committed attempt's batch"
            assert self.copies[(epoch, part, attempt, seq)] == copy
        else:
            assert self.first.get(batch.id) == copy, "stream: not the first copy kept"
        model = self.ranks[identity]
        assert model.has_room(batch.nbytes), f"{batch.id} sent beyond the window of {identity!r}"
        model.held[batch.id] = copy
        model.nbytes[batch.id] = batch.nbytes
        model.batches += copy.count
        if batch.id in self.ever_sent:
            self.redelivered[epoch] += copy.count
        self.ever_sent.add(batch.id)

    def _ended(self, identity, ep) -> None:
        assert ep.closed and not ep.queue
        if not self.even:
            assert all(i[0] != ep.epoch for r in self.ranks.values() for i in r.held), "ended with batches unacked"
        stream = self.ledger.streams[STREAM]
        assert all(e.end_sent for n, e in stream.epochs.items() if n < ep.epoch), "epochs ended out of order"
        self.ranks[identity].ended.add(ep.epoch)

    @precondition(lambda self: any(r.held for r in self.ranks.values()))
    @rule(which=WHICH, count=st.integers(1, 4), bogus=st.sampled_from([None, "unknown", "short"]))
    def ack(self, which, count, bogus):
        """A rank's loop consumed some batches: ACK(ids), and the broker dispatches."""
        identity = self._pick(which, [i for i, r in self.ranks.items() if r.held])
        ids = list(self.ranks[identity].held)[:count]
        self._acknowledge(identity, ids, bogus)
        self._dispatch()

    def _acknowledge(self, identity: bytes, ids: list[tuple], bogus: str | None = None) -> None:
        """The rank's training loop consumed ``ids``, sent flat. With ``bogus`` "unknown" it also names a batch it
        never had; with "short" the ids do not end on a whole triple, and the ACK is refused as a whole."""
        model = self.ranks[identity]
        raw = [x for i in ids for x in i] + {None: [], "unknown": [7, 0, 0], "short": [7, 0]}[bogus]
        if bogus == "short":
            with pytest.raises(ProtocolError, match="triples"):
                self.ledger.acknowledge(self.ledger.rank(identity), raw)
            return
        assert self.ledger.acknowledge(self.ledger.rank(identity), raw) == (bogus == "unknown")
        for batch_id in ids:
            assert batch_id not in self.consumed, f"{batch_id} consumed twice"
            self.consumed[batch_id] = copy = model.held.pop(batch_id)
            del model.nbytes[batch_id]
            model.acked += copy.count

    @precondition(lambda self: self.ranks)
    @rule(which=WHICH)
    def rank_gone(self, which):
        identity = self._pick(which)
        self.ledger.rank_gone(identity, "said goodbye")
        self._forget(identity)

    @precondition(lambda self: self.directory is not None)
    @rule(ranks_return=st.booleans())
    def restart(self, ranks_return):
        """The broker is killed and restarted on its journal. Its ranks connect again, holding nothing (what they
        held comes again), and state their windows anew; or the job died too, and later ranks join."""
        self.ledger = Ledger(self._journal())
        self.ledger.replay()
        for stream in self.ledger.streams.values():
            stream.held_until = 0.0             # the consumers are all back: what a restart's hold waits for
        self.pending.clear()                    # those tasks time out; Spark retries them
        self.redelivered.clear()                # the figures of sends start again with the new broker
        self.ever_sent.clear()
        numbers = [r.number for r in self.ranks.values()] if ranks_return else []
        self.ranks.clear()
        for number in numbers:
            self._window(self._join(number), 2)

    # ---- invariants -----------------------------------------------------------------------------------------

    @invariant()
    def every_byte_is_accounted_for(self):
        ledger = self.ledger
        stream = ledger.streams.get(STREAM)
        epochs = stream.epochs if stream else {}
        queued = sum(b.nbytes for ep in epochs.values() for b in ep.queue)
        inflight = sum(b.nbytes for r in ledger.ranks.values() for b in r.inflight.values())
        held = sum(b.nbytes for ep in epochs.values() for p in ep.parts.values() for h in p.held.values()
                   for b in h)
        assert ledger.buffered == queued + inflight + held
        assert ledger.held_bytes == held
        for identity, rank in ledger.ranks.items():
            assert rank.inflight_bytes == sum(b.nbytes for b in rank.inflight.values()) == \
                sum(self.ranks[identity].nbytes.values())

    @invariant()
    def each_batch_is_in_one_place_until_consumed(self):
        stream = self.ledger.streams.get(STREAM)
        epochs = stream.epochs if stream else {}
        places = Counter(b.id for ep in epochs.values() for b in ep.queue)
        places.update(i for r in self.ledger.ranks.values() for i in r.inflight)
        assert all(n == 1 for n in places.values()), places
        assert not places.keys() & self.consumed.keys()

    def _batches_in(self, epoch: int) -> int:
        """The batches the rules keep of an epoch so far: first copies, or committed attempts' copies (atomic)."""
        if self.opened[epoch]["delivery"] == "stream":
            return sum(c.count for i, c in self.first.items() if i[0] == epoch)
        return sum(self.copies[(e, part, attempt, seq)].count
                   for (e, part), (attempt, seqs) in self.committed.items() if e == epoch for seq in seqs)

    @invariant()
    def the_figures_count_batches_and_duplicates_count_messages(self):
        stream = self.ledger.streams.get(STREAM)
        for number, ep in (stream.epochs if stream else {}).items():
            out = sum(b.count for r in self.ledger.ranks.values() for i, b in r.inflight.items() if i[0] == number)
            acked = sum(c.count for i, c in self.consumed.items() if i[0] == number)
            assert (ep.batches_in, ep.acked, ep.batches_out, ep.duplicates, ep.redelivered) == \
                (self._batches_in(number), acked, acked + out, self.duplicates[number], self.redelivered[number])
        for identity, model in self.ranks.items():
            rank = self.ledger.ranks[identity]
            assert (rank.batches, rank.acked) == (model.batches, model.acked)

    @invariant()
    def the_count_in_flight_is_what_the_ranks_hold(self):
        """Control apart from stats: the epoch's end waits for ``in_flight``, the one count of its batches in the
        ranks' (and lost ranks') inflight sets."""
        stream = self.ledger.streams.get(STREAM)
        for number, ep in (stream.epochs if stream else {}).items():
            held = sum(b.count for r in stream.members() for i, b in r.inflight.items() if i[0] == number)
            assert ep.in_flight == held, (number, ep.in_flight, held)

    @invariant()
    def the_handed_figures_only_grow_and_cover_what_is_out(self):
        """Stats apart from control: ``batches_handed`` (what the metrics draw) never falls, whatever requeues
        do to ``batches_out`` (control: the epoch's end waits for it to be acknowledged)."""
        stream = self.ledger.streams.get(STREAM)
        if self.__dict__.get("_handed_ledger") is not self.ledger:     # a restarted broker counts from 0 again
            self._handed_ledger, self._handed_seen = self.ledger, {}
        seen = self._handed_seen
        for number, ep in (stream.epochs if stream else {}).items():
            figures = ep.stats()
            handed = (figures["batches_handed"], figures["bytes_handed"], figures["rows_handed"])
            assert all(h >= o for h, o in zip(handed, (ep.batches_out, ep.bytes_out, ep.rows_out))), (handed, ep)
            before = seen.get(number, (0, 0, 0))
            assert all(h >= b for h, b in zip(handed, before)), (number, before, handed)
            seen[number] = handed

    @invariant()
    def the_ranks_hold_what_the_ledger_thinks(self):
        assert {i: set(r.inflight) for i, r in self.ledger.ranks.items()} == \
            {i: set(r.held) for i, r in self.ranks.items()}

    # ---- the end --------------------------------------------------------------------------------------------

    def teardown(self):
        try:
            if sys.exc_info()[0] is None:       # a step failed: that is the failure to report, not this
                self.finish_and_check()
        finally:
            for journal in self.journals:
                journal.close()
            if self.directory:
                shutil.rmtree(self.directory, ignore_errors=True)

    def finish_and_check(self):
        """Spark finishes every partition, the driver closes every epoch, a new job consumes all of it."""
        for epoch, terms in self.opened.items():
            if epoch in self.closed:
                continue
            for part in range(terms["partitions"]):
                if (epoch, part) in self.committed:
                    continue
                self.task_runs_to_its_end(sorted(self.opened).index(epoch), part, FINISHER, end_first=False,
                                          pack=True)
            self._close(epoch)
        for identity in list(self.ranks):
            self.ledger.rank_gone(identity, "job finished")
            self._forget(identity)
        for number in range(self.size):
            self._join(number)
        for identity in self.ranks:
            self._window(identity, MAX_WINDOW)
        stream = self.ledger.streams.get(STREAM)
        for _ in range(20):
            if stream is None or not stream.epochs:
                break
            self._dispatch()
            for identity, model in self.ranks.items():
                self._acknowledge(identity, list(model.held))
            self.each_batch_is_in_one_place_until_consumed()
            self.the_figures_count_batches_and_duplicates_count_messages()
        assert stream is None or not stream.epochs, "epochs left undelivered"
        assert sorted(stream.finished.figures if stream else []) == sorted(self.opened)
        assert self.ledger.buffered == 0 and self.ledger.held_bytes == 0
        for epoch in self.opened:               # every batch kept was consumed, and the figures say so
            stats = stream.finished.figures[epoch]
            kept = self._batches_in(epoch)
            assert stats["batches_in"] == stats["batches_out"] == stats["acked"] == kept
            assert kept == sum(c.count for i, c in self.consumed.items() if i[0] == epoch)
            assert stats["duplicates"] == self.duplicates[epoch]

        expected = set()
        for (epoch, part), (attempt, seqs) in self.committed.items():
            ids = {(epoch, part, seq) for seq in seqs}
            expected |= ids
            got = {i for i in self.consumed if i[:2] == (epoch, part)}
            if self.opened[epoch]["delivery"] == "stream" and part in self.diverged[epoch]:
                continue                        # reported to the driver: the promise is that it was said
            assert got == ids, f"partition {part} of epoch {epoch}: consumed {sorted(got)}, committed {sorted(ids)}"
            for batch_id in ids:
                committed_copy = self.copies[(epoch, part, attempt, batch_id[2])]
                assert self.consumed[batch_id].checksum == committed_copy.checksum, \
                    f"{batch_id} consumed with other data than its committing attempt's"
        stray = {i for i in self.consumed if i not in expected and
                 not (self.opened[i[0]]["delivery"] == "stream" and i[1] in self.diverged[i[0]])}
        assert not stray, f"consumed batches no committed attempt sent: {sorted(stray)}"

        if self.directory:                      # a broker restarted now remembers it all as delivered
            again = Ledger(self._journal())
            again.replay()
            assert sorted(again.streams[STREAM].finished.figures) == sorted(self.opened)
            assert not again.streams[STREAM].epochs and again.buffered == 0


# A few seconds in all. One failure is shrunk, not each distinct one: that keeps a failing run within the timeout.
LedgerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=60, deadline=None,
                                           report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
test_ledger_machine = LedgerMachine.TestCase
