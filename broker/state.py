"""The broker's bookkeeping: streams, their epochs and ranks. No sockets here; the loop in ``daemon`` owns them.

A batch is held as the list of frames it arrived in and is forwarded as that same list: the broker reads
its header, never its payload.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

BatchId = tuple[int, int, int]   # (epoch, partition, seq)


@dataclass
class HeldBatch:
    """A data batch in the broker: queued for a rank, or sent and not yet acknowledged."""

    id: BatchId
    frames: list[Any]       # header frame + column frames, exactly as received
    nbytes: int
    rows: int


@dataclass
class PendingCommit:
    """A PARTITION_END that arrived before all of its batches: answered when the last one comes."""

    identity: bytes
    req: int
    batches: int
    rows: int


@dataclass
class EpochState:
    """One epoch of one stream: partitions expected and committed, the queue to the ranks, counters."""

    epoch: int
    partitions: int
    committed: set[int] = field(default_factory=set)
    seqs: dict[int, set[int]] = field(default_factory=dict)        # partition -> seqs received
    rows_by_part: dict[int, int] = field(default_factory=dict)
    pending: dict[int, PendingCommit] = field(default_factory=dict)
    queue: deque[HeldBatch] = field(default_factory=deque)
    closed: bool = False       # EPOCH_CLOSE accepted: every partition is committed
    end_sent: bool = False     # EPOCH_END went to the ranks
    batches_in: int = 0
    bytes_in: int = 0
    rows_in: int = 0
    batches_out: int = 0
    bytes_out: int = 0
    acked: int = 0
    duplicates: int = 0

    @property
    def drained(self) -> bool:
        """Closed and nothing left to send: the ranks can be told the epoch is over."""
        return self.closed and not self.queue

    def stats(self) -> dict[str, Any]:
        return {"partitions": self.partitions, "committed": len(self.committed), "closed": self.closed,
                "ended": self.end_sent, "queued": len(self.queue),
                "batches_in": self.batches_in, "bytes_in": self.bytes_in, "rows_in": self.rows_in,
                "batches_out": self.batches_out, "bytes_out": self.bytes_out, "acked": self.acked,
                "duplicates": self.duplicates}


@dataclass
class RankState:
    """A rank's connection: its credit (batches it asked for) and the batches it holds unacknowledged."""

    identity: bytes
    stream: str
    rank: int
    size: int
    credit: int = 0
    inflight: dict[BatchId, HeldBatch] = field(default_factory=dict)
    batches: int = 0
    bytes: int = 0
    acked: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    last_sent: float = field(default_factory=time.monotonic)

    def stats(self) -> dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "credit": self.credit, "inflight": len(self.inflight),
                "batches": self.batches, "bytes": self.bytes, "acked": self.acked,
                "idle_s": round(time.monotonic() - self.last_seen, 3)}


@dataclass
class StreamState:
    """A named stream ("train", "val", a job id): its epochs and the ranks consuming it. Streams share nothing."""

    name: str
    epochs: dict[int, EpochState] = field(default_factory=dict)
    ranks: dict[bytes, RankState] = field(default_factory=dict)
    expected_ranks: int = 0    # the communicator size the first rank announced
    finished: dict[int, dict[str, Any]] = field(default_factory=dict)   # stats of epochs done and acked
    _turn: int = 0

    def delivering(self) -> EpochState | None:
        """The epoch whose batches go to the ranks now: the lowest one not yet ended."""
        live = [e for e in self.epochs.values() if not e.end_sent]
        return min(live, key=lambda e: e.epoch) if live else None

    def all_ranks_joined(self) -> bool:
        return bool(self.ranks) and len(self.ranks) >= self.expected_ranks

    def ranks_with_credit(self) -> Iterator[RankState]:
        """Ranks that may take a batch, in rotating order so that equal credit means equal shares."""
        ranks = list(self.ranks.values())
        if not ranks:
            return
        self._turn = (self._turn + 1) % len(ranks)
        for rank in ranks[self._turn:] + ranks[:self._turn]:
            if rank.credit > 0:
                yield rank

    def retire_finished_epochs(self) -> None:
        """Drop the state of epochs that ended and were fully acknowledged, keeping their counters."""
        for number, ep in list(self.epochs.items()):
            if ep.end_sent and ep.acked >= ep.batches_out:
                self.finished[number] = ep.stats()
                del self.epochs[number]

    def stats(self) -> dict[str, Any]:
        epochs = {str(n): s for n, s in self.finished.items()}
        epochs.update({str(n): e.stats() for n, e in self.epochs.items()})
        return {"expected_ranks": self.expected_ranks, "epochs": epochs,
                "ranks": [r.stats() for r in self.ranks.values()]}
