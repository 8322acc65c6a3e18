"""The ledger's transitions as values: what it applies, what its observers see, and how the journal keeps them.

The ledger applies an event the same way live and on replay (:meth:`broker.ledger.Ledger.apply`): its applier
checks it, changes the state, then hands the event to the ledger's observers. :class:`JournalRecorder` is the one
observer, writing each as a record (``broker.journal.Record``). :func:`replayed_events` reads the records back as
the same events, which the ledger applies through the same appliers before its recorder observes it again.
One union (:data:`Event`): what is applied, and the epochs retired that only observers see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from sparkbus.broker.figures import EpochFigures
from sparkbus.broker.journal import Journal, Record, ReplayedEpoch
from sparkbus.wire import protocol
from sparkbus.wire.headers import BatchHeader
from sparkbus.wire.records import UsedCut, UsedEntry
from sparkbus.wire.requests import EpochRecoverHeader


@dataclass(frozen=True, slots=True)
class EpochOpened:
    stream: str
    epoch: int
    partitions: int
    delivery: str
    commit: str = "end"        # protocol.COMMIT_MODES


@dataclass(slots=True)     # not frozen: the feed's hot path makes one per batch, and a frozen one costs twice that
class BatchArrived:
    """A validated BATCH (applied: kept, queued or dropped by the rules). ``frames``: header frame first.

    Observers see it once the rules took it, with ``kept`` set by its applier: whether they kept its payload (the
    journal writes the payload then, else the header alone)."""

    header: BatchHeader
    frames: list[Any]
    header_bytes: bytes | None = None      # the header as it came (None: ``frames[0]``'s bytes)
    kept: bool = False

    @property
    def stream(self) -> str:
        return str(self.header["stream"])

    @property
    def epoch(self) -> int:
        return int(self.header["epoch"])

    def header_frame(self) -> bytes:
        """The header as it came on the feed socket."""
        if self.header_bytes is not None:
            return self.header_bytes
        first = self.frames[0]
        return first if isinstance(first, bytes) else bytes(first.bytes if hasattr(first, "bytes") else first)


@dataclass(frozen=True, slots=True)
class PartitionCommitted:
    stream: str
    epoch: int
    part: int
    attempt: int


@dataclass(frozen=True, slots=True)
class PartitionClaimed:
    stream: str
    epoch: int
    part: int
    broker: int                # the index, in the feed's list of brokers, of the one that streams it


@dataclass(frozen=True, slots=True)
class EpochClosed:
    stream: str
    epoch: int
    partitions: int | None = None    # the epoch's count, when the close lowered EPOCH_OPEN's upper bound


@dataclass(frozen=True, slots=True)
class BatchesAcked:
    """Batches of one epoch that ranks consumed, as ``[epoch, part, seq]`` lists."""

    stream: str
    epoch: int
    ids: list[list[int]]


@dataclass(frozen=True, slots=True)
class EpochRecovering:
    """An EPOCH_RECOVER applied: the epoch streamed again from Spark (``broker.recovery``). ``carries`` and
    ``recovered``: flat ranges, as on the wire; ``reset``: a resume, what the broker had of it forgotten first."""

    stream: str
    epoch: int
    partitions: int
    delivery: str
    commit: str
    carries: list[int]
    recovered: list[int]
    lost: list[str]
    reset: bool

    @classmethod
    def of(cls, h: EpochRecoverHeader) -> EpochRecovering:
        """The event of an EPOCH_RECOVER's (validated) header."""
        return cls(h["stream"], h["epoch"], h["partitions"], h["delivery"], h.get("commit", "end"), h["carries"],
                   h["recovered"], h["lost"], h["reset"])


@dataclass(frozen=True, slots=True)
class BatchesReclaimed:
    """A RECLAIM applied: what the rank ``member`` (rank number ``rank``) used of an epoch of the broker ``lost``
    lost (``""``: a resume): its whole batches (``entries``), and the rows it used of batches (``cuts``)."""

    stream: str
    epoch: int
    lost: str
    member: str
    rank: int
    entries: list[UsedEntry]
    cuts: tuple[UsedCut, ...] = ()


@dataclass(frozen=True, slots=True)
class EpochRetired:
    """Observed: an epoch delivered and acknowledged, dropped from the ledger with its figures."""

    stream: str
    epoch: int
    stats: EpochFigures


@dataclass(frozen=True, slots=True)
class EpochForgotten:
    """Observed: nothing is kept of an epoch the broker does not have open: the ranks' RECLAIMs of it were dropped
    (the per-stream bound), or a replay kept nothing of it. Its journal files, if any, hold nothing needed."""

    stream: str
    epoch: int


# What the ledger applies (live, and on replay from the journal's records) ...
Applied = (EpochOpened | BatchArrived | PartitionCommitted | PartitionClaimed | EpochClosed | BatchesAcked
           | EpochRecovering | BatchesReclaimed)
# ... and what its observers see: those, once applied, epochs retired, and epochs forgotten.
Event = Applied | EpochRetired | EpochForgotten
Observer = Callable[[Event], None]


class JournalRecorder:
    """The ledger's observer that writes what it must keep to the journal (fsynced where the journal says)."""

    def __init__(self, journal: Journal):
        self.journal = journal
        self._write: dict[type, Callable[[Any], None]] = {
            EpochOpened: lambda e: journal.record_open(e.stream, e.epoch, e.partitions, e.delivery, e.commit),
            BatchArrived: lambda e: journal.record_batch(e.stream, e.epoch, e.header_frame(),
                                                         e.frames[1:] if e.kept else []),
            PartitionCommitted: lambda e: journal.record_commit(e.stream, e.epoch, e.part, e.attempt),
            PartitionClaimed: lambda e: journal.record_claim(e.stream, e.epoch, e.part, e.broker),
            EpochClosed: lambda e: journal.record_close(e.stream, e.epoch, e.partitions),
            BatchesAcked: lambda e: journal.record_acks(e.stream, e.epoch, e.ids),
            EpochRecovering: self._recovering,
            BatchesReclaimed: lambda e: journal.record_reclaim(e.stream, e.epoch, e.lost, e.member, e.rank,
                                                               e.entries, e.cuts),
            EpochRetired: lambda e: journal.record_retired(e.stream, e.epoch, e.stats),
            EpochForgotten: lambda e: journal.forget_epoch(e.stream, e.epoch),
        }

    def _recovering(self, e: EpochRecovering) -> None:
        if e.reset:             # the epochs after it are forgotten, and would come back from their files
            self.journal.forget_after(e.stream, e.epoch)
        self.journal.record_recover(e.stream, e.epoch, partitions=e.partitions, delivery=e.delivery,
                                    commit=e.commit, carries=e.carries, recovered=e.recovered, lost=e.lost,
                                    reset=e.reset)

    def __call__(self, event: Event) -> None:
        write = self._write.get(type(event))
        if write is not None:
            write(event)


def replayed_events(replayed: ReplayedEpoch) -> Iterator[Applied]:
    """The events one epoch's journal records stand for, in order."""
    stream, epoch = replayed.stream, replayed.epoch
    for record in replayed.records:
        kind = record["t"]
        if kind is Record.OPEN:
            yield EpochOpened(stream, epoch, record["partitions"], record["delivery"], record.get("commit", "end"))
        elif kind is Record.BATCH:
            header = cast(BatchHeader, protocol.unpack_header(record["header"]))     # validated: a BATCH's
            yield BatchArrived(header, [record["header"], *record.get("payload", [])], record["header"])
        elif kind is Record.COMMIT:
            yield PartitionCommitted(stream, epoch, record["part"], record["attempt"])
        elif kind is Record.CLOSE:
            yield EpochClosed(stream, epoch, record.get("partitions"))
        elif kind is Record.CLAIM:
            yield PartitionClaimed(stream, epoch, record["part"], record["broker"])
        elif kind is Record.ACK:
            yield BatchesAcked(stream, epoch, record["ids"])
        elif kind is Record.RECOVER:
            yield EpochRecovering(stream, epoch, record["partitions"], record["delivery"], record["commit"],
                                  record["carries"], record["recovered"], record["lost"], record["reset"])
        elif kind is Record.RECLAIM:
            yield BatchesReclaimed(stream, epoch, record["lost"], record["member"], record["rank"],
                                   [UsedEntry._make(e) for e in record["entries"]],
                                   tuple(UsedCut._make(c) for c in record["cuts"]))
