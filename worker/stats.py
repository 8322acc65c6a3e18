"""A rank's figures: :class:`EpochStats` (one epoch as this rank saw it) and :class:`StreamStats` (the totals of a
:class:`~worker.stream.BatchStream`, and each epoch's). Counts only: nothing on the rank decides by them.

In a module of their own so that the step plans and the intake, which count into them, need not import the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkbus.wire.verdict import of_rank


@dataclass
class EpochStats:
    """One epoch as this rank saw it."""

    epoch: int
    batches: int = 0
    rows: int = 0
    bytes: int = 0
    dropped_batches: int = 0    # left over to keep ranks even (remainder="drop": at most size - 1 across all ranks)
    dropped_rows: int = 0
    cut_batches: int = 0        # steps that took some rows of a batch: the epoch's remainder shared out by rows
    repeated_batches: int = 0   # steps that took a batch another rank took too (remainder="pad")
    repeated_rows: int = 0
    wait_seconds: float = 0.0   # time the training loop waited for data (and for the other ranks to agree)
    # of wait_seconds, the time this rank held batches it could not use yet because a peer had fewer (equal steps:
    # waiting for the broker's grant, or in the MPI agreement); the rest is a wait for data (see data_wait_seconds)
    peer_wait_seconds: float = 0.0
    step_seconds: float = 0.0   # the loop's own time with the batches: from each yield to its next request
    seconds: float = 0.0        # from the first request of the epoch to its end
    resumed_batches: int = 0    # steps of this epoch taken before the checkpoint it resumed from (not in batches)
    # the wait before the epoch's first batch (-1: none came), included in wait_seconds: in a first epoch, Spark's
    # start-up and the feed's first partitions; wait_seconds - first_batch_seconds is the wait once data flowed
    first_batch_seconds: float = -1.0

    @property
    def data_wait_seconds(self) -> float:
        """The wait for data once it flowed: ``wait_seconds`` less the peers' part and the wait for the first
        batch (in a first epoch, Spark's start-up)."""
        return max(self.wait_seconds - self.peer_wait_seconds - max(self.first_batch_seconds, 0.0), 0.0)

    @property
    def verdict(self) -> str:
        """Why this rank's training waited, in a word (:func:`sparkbus.wire.verdict.of_rank`): ``"input-bound"``
        (its data wait after the first batch is above a tenth of its own step time), ``"peer-bound"`` (it waited
        more for slower peers than for data, above a tenth of its step time), else ``"compute-bound"``."""
        return of_rank(self.data_wait_seconds, self.peer_wait_seconds, self.step_seconds)


@dataclass
class StreamStats:
    """Totals over the epochs of a :class:`BatchStream`, and each epoch's figures in ``epochs``."""

    batches: int = 0
    rows: int = 0
    bytes: int = 0
    dropped_batches: int = 0
    dropped_rows: int = 0
    cut_batches: int = 0
    repeated_batches: int = 0
    repeated_rows: int = 0
    wait_seconds: float = 0.0
    peer_wait_seconds: float = 0.0
    step_seconds: float = 0.0
    first_batch_seconds: float = -1.0   # from the stream's start to its first batch (-1: none yet)
    skipped_batches: int = 0    # left unread when the loop broke out of an epoch early
    rejoins: int = 0            # times this rank joined the broker again (a lost connection, a restarted broker)
    resumed_batches: int = 0    # steps taken before the checkpoint this stream resumed from (not in batches)
    epochs: list[EpochStats] = field(default_factory=list)

    def add(self, ep: EpochStats) -> None:
        self.epochs.append(ep)
        for name in ("batches", "rows", "bytes", "dropped_batches", "dropped_rows", "cut_batches", "repeated_batches",
                     "repeated_rows", "wait_seconds", "peer_wait_seconds", "step_seconds", "resumed_batches"):
            setattr(self, name, getattr(self, name) + getattr(ep, name))
