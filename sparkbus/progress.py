"""What the demo and the examples print of an epoch: its number, as the API numbers it, and its time split at the
first batch.

**Numbers.** Everything sparkbus prints numbers epochs from 0, as ``feed(..., epoch=)``, ``EpochStats.epoch``, a
rank's ``state_dict()`` and ``sparkbus status`` do; a progress line adds the epoch's place in the run:
``epoch 0 (1 of 3)`` (docs/DECISIONS.md, "One numbering of epochs").

**Start-up.** A rank's data wait (``EpochStats.wait_seconds``) includes the wait for the epoch's first batch
(``first_batch_seconds``): in a first epoch, Spark's start-up and its first partitions. Counted as data wait it
hides what the stream costs once it flows (a first epoch read "data wait 94 %" for a job that mostly waited for
Spark's JVM), so the figures show it apart as ``start-up`` and take the data wait and the throughput over the time
after the first batch (:class:`EpochTimes`).

**Why.** At the end of each epoch the feed's side prints one line saying why training waited while it was fed
(``FeedReport.verdict``: input-bound with the slowest Spark tasks named, compute-bound with the slowest rank named,
or balanced): :func:`waited_line`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def epoch_label(epoch: int, epochs: int) -> str:
    """``epoch 0 (1 of 3)``: the API's 0-based ``epoch``, then its place among the run's ``epochs`` (resumed ones
    included: epoch 1 of a 3-epoch run resumed there is ``epoch 1 (2 of 3)``)."""
    return f"epoch {epoch} ({epoch + 1} of {epochs})"


def waited_line(epoch: int, epochs: int, report: Any) -> str:
    """``why training waited in epoch 0 (1 of 3): compute-bound: ...``: a :class:`~sparkbus.FeedReport`'s
    verdict, the one line the demo and the examples print after an epoch's ``fed`` line."""
    return f"why training waited in {epoch_label(epoch, epochs)}: {report.verdict}"


def fed_lines(epoch: int, epochs: int, report: Any, unit: str = "rows") -> str:
    """``fed epoch 0 (1 of 3): 100,000 rows in 391 batches in 4.2 s`` and, below it, :func:`waited_line`: what
    the examples print when an epoch is fed (``unit``: what a row is, e.g. ``"documents"``)."""
    return (f"fed {epoch_label(epoch, epochs)}: {report.rows:,} {unit} in {report.batches} batches in "
            f"{report.seconds:.1f} s\n{waited_line(epoch, epochs, report)}")


@dataclass(frozen=True)
class EpochTimes:
    """One rank's epoch split at its first batch: ``start_up + streaming`` is the epoch's ``seconds``."""

    start_up: float      # seconds to the epoch's first batch (the whole epoch if none came)
    streaming: float     # seconds from the first batch to the epoch's end
    waited: float        # seconds of ``streaming`` the training loop waited for data

    @classmethod
    def split(cls, wait_seconds: float, first_batch_seconds: float, seconds: float) -> EpochTimes:
        """From an ``EpochStats``' three figures (``first_batch_seconds`` -1: no batch came)."""
        if first_batch_seconds < 0:
            return cls(seconds, 0.0, 0.0)
        return cls(first_batch_seconds, max(seconds - first_batch_seconds, 0.0),
                   max(wait_seconds - first_batch_seconds, 0.0))

    @classmethod
    def of(cls, ep: Any) -> EpochTimes:
        """From an ``EpochStats`` (``BatchStream.stats.epochs[i]``)."""
        return cls.split(ep.wait_seconds, ep.first_batch_seconds, ep.seconds)

    @property
    def wait_share(self) -> float:
        """The share of the time after the first batch that the loop waited for data (0 if none came)."""
        return self.waited / self.streaming if self.streaming > 0 else 0.0

    def rate(self, count: float) -> float:
        """``count`` (rows, images, batches) per second after the first batch (0 if none came)."""
        return count / self.streaming if self.streaming > 0 else 0.0


def wait_share(times: list[EpochTimes]) -> float:
    """The data wait after the first batch over several ranks (or epochs): their waits over their streaming time."""
    streaming = sum(t.streaming for t in times)
    return sum(t.waited for t in times) / streaming if streaming > 0 else 0.0
