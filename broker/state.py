"""The broker's bookkeeping: streams, their epochs, partitions and ranks. No sockets here; ``daemon`` owns them.

A batch is held as the list of frames it arrived in and is forwarded as that same list: the broker reads
its header, never its payload. An epoch's and a rank's counters change only through their methods here (the
ledger's rules call them), so that what a figure counts is said in one place.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sparkbus.broker.figures import REPORTED, EpochFigures, OrphanFigures, RankFigures, StreamFigures
from sparkbus.broker.journal import DeliveredEpochs
from sparkbus.wire.protocol import PartitionRanges
from sparkbus.wire.records import UsedCut, UsedEntry
from sparkbus.wire.requests import RankReport


@dataclass
class HeldBatch:
    """A data batch in the broker: queued for a rank, or sent and not yet acknowledged."""

    # (epoch, part, seq): the numbers of the wire's BatchId (wire.records), kept as the plain tuple they are equal to
    # (same hash, same key): made per message on the broker's hot path, a BatchId there costs 0.15-0.2 us a message
    id: tuple[int, int, int]
    frames: list[Any]       # header frame + column frames, exactly as received
    nbytes: int
    rows: int
    sends: int = 0          # times sent to a rank: above 1, it was redelivered
    count: int = 1          # the batches it carries: a pack of small batches (header "splits") counts each
    first: int = 0          # a piece of a pack cut at an epoch's end (granted steps): its batches first..stop-1
    whole: HeldBatch | None = None     # ... and the pack it was cut from, which counts the pieces out
    pieces: int = 1         # on a pack that was cut: its pieces not yet consumed
    used: int = 0           # a pack in flight: its batches before this one were used (the rank's ACK upto)
    cut: tuple[int, int] | None = None     # rows lo..hi-1 of its one batch only (the epoch's remainder)
    repeat: bool = False    # ... a copy of rows another rank has too (remainder "pad")
    bucket: int | None = None   # a coordinated feed's length bucket (header "bucket"): broker.buckets groups by it

    def settle(self) -> bool:
        """This batch, or piece, was consumed. Whether its whole message now is (the last piece of a cut pack)."""
        whole = self.whole
        if whole is None:
            return True
        whole.pieces -= 1
        return whole.pieces == 0


@dataclass
class PendingCommit:
    """A PARTITION_END that arrived before all of its batches: answered when the last one comes."""

    identity: bytes
    req: int
    batches: int
    rows: int


@dataclass
class PartitionState:
    """One partition of an epoch, across the Spark task attempts that stream it.

    ``checksums`` holds, per seq, the checksum of the first copy the broker accepted: a later attempt's copy of the
    same seq is a duplicate, and a duplicate with another checksum means Spark recomputed the partition
    differently (``diverged``).
    """

    checksums: dict[int, int] = field(default_factory=dict)
    attempts: dict[int, set[int]] = field(default_factory=dict)          # attempt -> seqs it sent
    held: dict[int, list[HeldBatch]] = field(default_factory=dict)       # atomic: attempt -> batches
    pending: dict[int, PendingCommit] = field(default_factory=dict)      # attempt -> its PARTITION_END
    complete: set[int] = field(default_factory=set)    # attempts whose every batch arrived ("driver" commits)
    committed_attempt: int | None = None
    diverged: bool = False


class Reclaimed(NamedTuple):
    """What one rank (session) said it used of an epoch in a RECLAIM for one loss: its whole batches, and the rows it
    used of batches it used part of (``cuts``)."""

    rank: int
    entries: list[UsedEntry]
    cuts: tuple[UsedCut, ...] = ()


class Used(NamedTuple):
    """Batches ``first..stop-1`` of one message that the rank ``member`` (rank number ``rank``) said it used, and the
    message's checksum as that rank had it; ``rows``: ``(lo, hi)``, the rows it used of batch ``first`` only (a cut),
    or None: all of them. What a recovering epoch's index holds per ``(part, seq)`` (``broker.matching``)."""

    first: int
    stop: int
    checksum: int
    member: str
    rank: int
    rows: tuple[int, int] | None


class Handed(NamedTuple):
    """The most of an epoch ever out at once (handed to ranks, a requeued batch counting once): each figure's own
    most, so that they only grow (``batches_handed``, ``bytes_handed``, ``rows_handed``)."""

    batches: int = 0
    nbytes: int = 0
    rows: int = 0


@dataclass
class EpochRecovery:
    """An epoch this broker streams again from Spark's lineage (EPOCH_RECOVER; broker.recovery has the rules)."""

    carries: PartitionRanges   # the partitions this broker streams; batches of others are dropped (unassigned)
    recovered: PartitionRanges  # of them, a lost broker's (or all, for a resume): matched with the ranks' reclaims
    lost: list[str]            # the losses waited for: every member's RECLAIM for each before batches go out
    reset: bool = False        # a resume: what the broker had of the epoch was forgotten first
    held: list[HeldBatch] = field(default_factory=list)    # batches of recovered partitions, held until then
    index: dict[tuple[int, int], list[Used]] | None = None     # (part, seq) -> what the ranks used of it
    expected: dict[str, tuple[int, int]] | None = None   # member -> (rank number, batches it used of recovered)
    matched: dict[str, int] = field(default_factory=dict)   # member -> of those, matched so far (adopted)


@dataclass
class EpochState:
    """One epoch of one stream: partitions expected and committed, the queue to the ranks, counters."""

    epoch: int
    partitions: int
    delivery: str = "stream"   # "stream": forward on arrival; "atomic": forward a partition once committed
    commit: str = "end"        # who commits an attempt: its PARTITION_END ("end") or the driver ("driver")
    parts: dict[int, PartitionState] = field(default_factory=dict)
    claims: dict[int, int] = field(default_factory=dict)   # partition -> broker index (several brokers, home here)
    queue: deque[HeldBatch] = field(default_factory=deque)
    closed: bool = False       # EPOCH_CLOSE accepted: every partition is committed
    end_sent: bool = False     # EPOCH_END went to the ranks
    # Control, read by the rules (each changes in the methods below only):
    batches_out: int = 0       # given out, net of requeues: consumed, or in the ranks' hands (EPOCH_END's count)
    in_flight: int = 0         # in the inflight sets of the stream's ranks and lost ranks: the one count of them
    # Stats, never read to decide: they only grow (``acked`` falls only where broker.dispatch takes back a pack's
    # batches it had counted used, to count the whole pack at its acknowledgement)
    batches_in: int = 0
    bytes_in: int = 0
    rows_in: int = 0
    bytes_given: int = 0       # counted out (sent, adopted, found at a rank that rejoined), requeues not taken off
    rows_given: int = 0
    bytes_back: int = 0        # requeued: :attr:`bytes_out` is what was given less what came back
    rows_back: int = 0
    # the most ever out at once: handed to ranks, a requeued batch counting once (only :meth:`requeue` raises it)
    handed: Handed = Handed()
    acked: int = 0
    duplicates: int = 0
    redelivered: int = 0       # sends of a batch that had gone out before (its rank died or left)
    given_twice: int = 0       # batches a rank came back with after --rejoin-grace, given to another meanwhile
    steps: int = 0             # granted streams: the steps granted so far (the last STEPS)
    share: int | None = None   # ... each rank's steps, once the epoch is being evened out at its end
    dropped: dict[int, int] = field(default_factory=dict)   # ... rank number -> batches it drops to even out
    returns_due: set[int] = field(default_factory=set)      # ... rank numbers told to RELEASE, not yet returned
    owed: dict[int, tuple[int, int]] = field(default_factory=dict)   # ... RELEASEs not sent yet: (drop, return)
    moved: int = 0             # ... batches returned by one rank and given to another to even out
    cut: int = 0               # ... batches left over, shared out as pieces: one to each rank (broker.remainder)
    pieces: int = 0            # ... the pieces they went out as (rows, or repeats)
    repeated: int = 0          # ... of them, repeats of rows another rank has
    cut_done: bool = False     # ... the remainder of this evening is shared out
    acked_before: dict[tuple[int, int, int], int] = field(default_factory=dict)   # replay: acked before a restart
    recovery: EpochRecovery | None = None   # streamed again from Spark after a loss or for a resume
    unassigned: int = 0        # ... batches of partitions it does not carry, dropped (a cancelled task's)
    adopted: int = 0           # ... batches the ranks had used already (their RECLAIM): counted consumed, not sent
    superseded: int = 0        # attempts that sent all they had but that Spark did not declare successful

    @property
    def all_acked(self) -> bool:
        """No batch of this epoch is in flight: every one given out was acknowledged (or requeued)."""
        return not self.in_flight

    def delivered(self, even: bool) -> bool:
        """Whether the epoch may end on the ranks: closed and fully sent, and with independent ranks (not
        ``even``) also fully acknowledged, so that batches of a rank that dies still go to the others."""
        return (self.closed and not self.queue and (even or not self.in_flight)
                and (self.recovery is None or not self.recovery.held))

    @property
    def bytes_out(self) -> int:
        """Bytes of the batches :attr:`batches_out` counts (a figure)."""
        return self.bytes_given - self.bytes_back

    @property
    def rows_out(self) -> int:
        return self.rows_given - self.rows_back

    @property
    def committed(self) -> set[int]:
        """The partitions committed: those whose committed attempt is known (derived, never kept twice)."""
        return {n for n, p in self.parts.items() if p.committed_attempt is not None}

    @property
    def diverged(self) -> list[int]:
        return sorted(n for n, p in self.parts.items() if p.diverged)

    def part(self, number: int) -> PartitionState:
        state = self.parts.get(number)
        if state is None:
            state = self.parts[number] = PartitionState()
        return state

    # ---- the counters: each changes here only ----------------------------------------------------------------

    def take(self, batch: HeldBatch) -> None:
        """A batch (first copy, or an atomic partition's at its commit) joins the queue to the ranks."""
        self.queue.append(batch)
        self.count_in(batch)

    def count_in(self, batch: HeldBatch) -> None:
        self.batches_in += batch.count
        self.bytes_in += batch.nbytes
        self.rows_in += batch.rows

    def adopt(self, batch: HeldBatch) -> None:
        """A batch (or piece, counted in already) a rank used before a loss: out and acknowledged at once, never
        sent."""
        self.count_out(batch)
        self.count_acked(batch)
        self.adopted += batch.count

    def count_duplicate(self) -> None:
        self.duplicates += 1        # a message: a pack copied counts once

    def count_out(self, batch: HeldBatch) -> None:
        """The batch is in a rank's hands: sent, or found at a rank that rejoined with it."""
        self.batches_out += batch.count
        self.in_flight += batch.count
        self.bytes_given += batch.nbytes
        self.rows_given += batch.rows

    def sent(self, batch: HeldBatch) -> None:
        """The batch went out to a rank (again, if it had gone out before): :meth:`resent` and :meth:`count_out`,
        written out (the hot path)."""
        batch.sends += 1
        if batch.sends > 1:
            self.redelivered += batch.count
        self.batches_out += batch.count
        self.in_flight += batch.count
        self.bytes_given += batch.nbytes
        self.rows_given += batch.rows

    def resent(self, batch: HeldBatch) -> None:
        """The batch went out once more, still counted out (to a rank that lost it with its old connection)."""
        batch.sends += 1
        if batch.sends > 1:
            self.redelivered += batch.count

    def requeue(self, batch: HeldBatch) -> None:
        """A batch in flight that will not be acknowledged goes back to the front of the queue: its send is undone."""
        self.handed = self._handed()
        self.queue.appendleft(batch)
        self.batches_out -= batch.count
        self.in_flight -= batch.count
        self.bytes_back += batch.nbytes
        self.rows_back += batch.rows

    def used_off(self, used: HeldBatch) -> None:
        """The used batches of a pack in flight, cut off as the rest is requeued: out of flight, and consumed
        (counted acknowledged as the rank said it used them)."""
        self.in_flight -= used.count

    def _handed(self) -> Handed:
        handed = self.handed
        return Handed(max(handed.batches, self.batches_out), max(handed.nbytes, self.bytes_out),
                      max(handed.rows, self.rows_out))

    def count_acked(self, batch: HeldBatch) -> None:
        """The batch was consumed: out of flight."""
        self.acked += batch.count
        self.in_flight -= batch.count

    def count_given_twice(self, batches: int) -> None:
        """A rank came back with ``batches`` that another rank was given meanwhile (a pack counts its batches)."""
        self.given_twice += batches

    def stats(self) -> EpochFigures:
        handed = self._handed()
        return {"partitions": self.partitions, "delivery": self.delivery, "committed": len(self.committed),
                "closed": self.closed, "ended": self.end_sent, "queued": len(self.queue),
                "batches_in": self.batches_in, "bytes_in": self.bytes_in, "rows_in": self.rows_in,
                "batches_out": self.batches_out, "bytes_out": self.bytes_out, "rows_out": self.rows_out,
                "batches_handed": handed.batches, "bytes_handed": handed.nbytes, "rows_handed": handed.rows,
                "acked": self.acked, "duplicates": self.duplicates, "redelivered": self.redelivered,
                "given_twice": self.given_twice, "diverged": self.diverged, "steps": self.steps,
                "dropped": sum(self.dropped.values()), "moved": self.moved,
                "cut": self.cut, "pieces": self.pieces, "repeated": self.repeated, "unassigned": self.unassigned,
                "adopted": self.adopted, "commit": self.commit, "superseded": self.superseded,
                "held": len(self.recovery.held) if self.recovery is not None else 0}


MAX_WINDOW = 4096     # batches in flight to one rank at most, however small they are


@dataclass
class RankState:
    """A rank's connection: its window (what it lets be in flight to it) and the batches it holds unacknowledged.

    A batch fits the window when fewer than ``window`` batches are in flight, or when it fits in ``window_bytes``
    beside those in flight (at most :data:`MAX_WINDOW` of them): whichever admits more. Small batches then flow
    many at a time, large ones a few, and a rank's memory stays bounded by the larger of the two budgets.
    """

    identity: bytes
    stream: str
    rank: int
    size: int
    even: bool = False
    grants: bool = False       # its steps are granted by the broker (STEPS), not agreed among the ranks
    remainder: str = "drop"    # ... what the epoch's last batches become (protocol.REMAINDERS; a v6 rank drops)
    session: str = ""          # the rank's BatchStream: the same across its reconnections, new in a new process
    window: int = 0
    window_bytes: int = 0
    window_stated: bool = False    # a CREDIT has come from this connection
    inflight: dict[tuple[int, int, int], HeldBatch] = field(default_factory=dict)     # by HeldBatch.id
    inflight_bytes: int = 0
    batches: int = 0
    bytes: int = 0
    acked: int = 0
    reported: dict[str, Any] = field(default_factory=dict)     # the rank's own figures (wait_s, ...), as last said
    given: dict[int, int] = field(default_factory=dict)        # epoch -> its batches this rank has (had) in hand
    told: dict[int, int] = field(default_factory=dict)         # epoch -> the steps last granted to it (STEPS)
    adopted: dict[int, int] = field(default_factory=dict)      # epoch -> of given, batches it used of lost brokers
    told_adopted: dict[int, int] = field(default_factory=dict)  # epoch -> the adopted count last told (STEPS)
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def member(self) -> str:
        """Who this rank is to a recovery (its RECLAIMs are kept under this): its session, else its connection."""
        return self.session or f"@{self.identity.hex()}"

    def has_room(self, nbytes: int, by_bytes: bool = True) -> bool:
        held = len(self.inflight)
        return held < self.window or (by_bytes and held < MAX_WINDOW
                                      and self.inflight_bytes + nbytes <= self.window_bytes)

    def report(self, header: RankReport) -> None:
        """Keep the figures a rank reports about itself on ACK and HEARTBEAT (data-wait, first batch, consumed)."""
        figures: Mapping[str, Any] = header      # the names are REPORTED's, a tuple: not literals to mypy
        for name in REPORTED:
            if name in figures:
                self.reported[name] = figures[name]

    def hold(self, batch: HeldBatch) -> None:
        """The batch is in flight to this rank (sent, or held by it when it rejoined)."""
        self.inflight[batch.id] = batch
        self.inflight_bytes += batch.nbytes
        self.given[batch.id[0]] = self.given.get(batch.id[0], 0) + batch.count

    def sent(self, batch: HeldBatch) -> None:
        """The batch went out to this connection: held (:meth:`hold`), and counted."""
        self.inflight[batch.id] = batch
        self.inflight_bytes += batch.nbytes
        self.batches += batch.count
        self.bytes += batch.nbytes
        epoch = batch.id[0]
        self.given[epoch] = self.given.get(epoch, 0) + batch.count

    def take_back(self, batch: HeldBatch) -> None:
        """A batch (or piece) this rank returned: no longer in flight to it, nor counted as given."""
        del self.inflight[batch.id]
        self.inflight_bytes -= batch.nbytes
        self.given[batch.id[0]] -= batch.count

    def forget_counts(self, epoch: int) -> None:
        """Forget what this rank counted of ``epoch`` (retired, or reset for a resume): the one place it is."""
        for counts in (self.given, self.told, self.adopted, self.told_adopted):
            counts.pop(epoch, None)

    def forget_inflight(self, epoch: int) -> int:
        """Forget the batches of ``epoch`` in flight to this rank (a resume resets the epoch). Returns their bytes."""
        freed = 0
        for batch_id, batch in list(self.inflight.items()):
            if batch_id[0] == epoch:
                del self.inflight[batch_id]
                freed += batch.nbytes
        self.inflight_bytes -= freed
        return freed

    def consumed(self, batches: Iterable[HeldBatch], held: bool = True) -> int:
        """Batches this rank consumed, taken out of :attr:`inflight` already (``held``), or never in it (found
        elsewhere when it rejoined). Returns their bytes."""
        freed = 0
        for batch in batches:
            freed += batch.nbytes
            self.acked += batch.count
            if not held:
                self.given[batch.id[0]] = self.given.get(batch.id[0], 0) + batch.count
        if held:
            self.inflight_bytes -= freed
        return freed

    def stats(self) -> RankFigures:
        return {"rank": self.rank, "size": self.size, "even": self.even, "window": self.window,
                "window_bytes": self.window_bytes, "inflight": len(self.inflight),
                "inflight_bytes": self.inflight_bytes, "batches": self.batches, "bytes": self.bytes,
                "acked": self.acked, "idle_s": round(time.monotonic() - self.last_seen, 3),
                **self.reported}  # type: ignore[typeddict-item]


@dataclass
class Orphan:
    """A rank whose connection was lost while it held batches: they wait for it to rejoin until ``deadline``."""

    rank: RankState
    deadline: float

    def stats(self, now: float) -> OrphanFigures:
        return {"rank": self.rank.rank, "inflight": len(self.rank.inflight),
                "expires_in_s": round(self.deadline - now, 3)}


@dataclass
class StreamState:
    """A named stream ("train", "val", a job id): its epochs and the ranks consuming it. Streams share nothing."""

    name: str
    epochs: dict[int, EpochState] = field(default_factory=dict)
    ranks: dict[bytes, RankState] = field(default_factory=dict)
    expected_ranks: int = 0    # the communicator size the first rank announced
    group_size: int = 0        # the size of the group that consumed it last (kept when the ranks leave)
    held_until: float = 0.0    # restarted from the journal: independent consumers get batches from then on
    complete: bool = False     # all expected ranks have joined since the stream last had none
    finished: DeliveredEpochs = field(default_factory=DeliveredEpochs)  # epochs done and acked: the last K's figures
    orphans: dict[str, Orphan] = field(default_factory=dict)           # by session
    rejoins: int = 0           # ranks that came back (new connection or restarted broker) and were reconciled
    reclaims: dict[int, dict[str, dict[str, Reclaimed]]] = field(default_factory=dict)  # epoch -> loss -> member
    awaiting_reset: int | None = None    # a rank resumes at this epoch: none from it on goes out until its reset
    last_used: float = field(default_factory=time.monotonic)   # when last in use or named by a message
    _turn: int = 0

    def members(self) -> list[RankState]:
        """The ranks connected and those whose lost connection waits for them (orphans)."""
        return [*self.ranks.values(), *(o.rank for o in self.orphans.values())]

    def in_use(self) -> bool:
        """Whether anything of the stream is live: ranks, lost ranks waiting, epochs not yet delivered."""
        return bool(self.ranks or self.epochs or self.orphans)

    def delivering(self) -> EpochState | None:
        """The epoch whose batches go to the ranks now: the lowest one not yet ended."""
        live = [e for e in self.epochs.values() if not e.end_sent]
        return min(live, key=lambda e: e.epoch) if live else None

    def ready(self) -> bool:
        """Whether batches may go out: every rank of the group has joined since the stream last had none; after a
        restart from the journal, independent consumers (each rank 0 of 1) also once ``held_until`` has passed."""
        return self.complete and (self.expected_ranks > 1 or not self.held_until
                                  or time.monotonic() >= self.held_until)

    def windows_known(self) -> bool:
        """Whether every rank has stated its window. Until then ranks get batches by their batch window only:
        the first to state a byte window could otherwise take a whole window of small batches alone."""
        return all(r.window_stated for r in self.ranks.values())

    def even(self) -> bool:
        """Whether the ranks keep equal steps (then an epoch ends once sent, not once acknowledged)."""
        return any(r.even for r in self.ranks.values())

    def granted(self) -> bool:
        """Whether the broker grants the ranks' steps (``broker.grants``)."""
        return any(r.grants for r in self.ranks.values())

    def counts(self, epoch: int) -> list[int]:
        """Per rank number, the batches of ``epoch`` in its hands (held, consumed, dropped to even out), over the
        ranks connected and those whose lost connection waits for them. A number nobody holds counts 0."""
        counts = [0] * self.expected_ranks
        for rank in self.members():
            if rank.rank < len(counts):
                counts[rank.rank] = rank.given.get(epoch, 0)
        return counts

    def rotation(self) -> list[RankState]:
        """The ranks, starting one further each call, so that equal windows mean equal shares."""
        ranks = list(self.ranks.values())
        if ranks:
            self._turn = (self._turn + 1) % len(ranks)
            ranks = ranks[self._turn:] + ranks[:self._turn]
        return ranks

    def stats(self) -> StreamFigures:
        """The stream's figures: bounded, whatever it has delivered (the last K epochs', the rest summed)."""
        finished = self.finished
        epochs = {str(n): s for n, s in finished.figures.items()}
        epochs.update({str(n): e.stats() for n, e in self.epochs.items()})
        now = time.monotonic()
        return {"expected_ranks": self.expected_ranks, "rejoins": self.rejoins, "delivered": finished.delivered,
                "idle_s": 0.0 if self.in_use() else round(now - self.last_used, 3),
                "earlier": dict(finished.earlier),      # type: ignore[typeddict-item]
                "epochs": epochs,
                "ranks": [r.stats() for r in self.ranks.values()],
                "orphans": [o.stats(now) for o in self.orphans.values()]}
