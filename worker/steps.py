"""How many steps a rank takes in an epoch, and with which batches: the plans a ``BatchStream`` epoch follows.

- :class:`IndependentSteps`: a rank on its own (``even=False``) takes every batch as it comes.
- :class:`EvenRounds`: the ranks of a communicator take the same number of steps (``even=True``). They agree,
  over MPI, in rounds, and at the epoch's end pool what is left and share it out evenly
  (:mod:`worker.rebalance`); what is left over (fewer batches than ranks) follows ``remainder``
  (``wire.remainder``: split by rows, dropped, or padded).

A plan (:class:`StepPlan`) yields one :class:`Step` per step; the stream hands its batch to the training loop,
counts it, and acknowledges it when the loop comes back for the next (unless the plan has acknowledged it
already). Steps granted by the broker would be a third plan.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any, NamedTuple, Protocol

from sparkbus.wire.headers import BatchHeader
from sparkbus.worker import collectives, rebalance
from sparkbus.worker.intake import Batch, Intake, Item
from sparkbus.worker.stats import EpochStats

ROUND_BATCHES = 8       # even ranks short of data wait for a round of this many batches, or half a byte window,
ROUND_LINGER = 0.02     # ... but no longer than this (seconds)


class Step(NamedTuple):
    """One step's batch."""

    header: BatchHeader
    batch: Batch
    acknowledge: bool = True    # when the loop comes back for the next; False: acknowledged already


class StepPlan(Protocol):
    """What an epoch of a ``BatchStream`` follows."""

    def steps(self) -> Generator[Step, None, None]:
        """The epoch's steps, in order. Closing it early (the loop left) settles what the plan started."""
        ...


class IndependentSteps:
    """Every batch this rank receives, as it comes, until the epoch's end."""

    def __init__(self, intake: Intake, ep: EpochStats):
        self._intake, self._ep = intake, ep

    def steps(self) -> Generator[Step, None, None]:
        while (item := self._intake.next_batch(self._ep)) is not None:
            yield Step(*item)


class EvenRounds:
    """The same number of steps on every rank of ``comm``, agreed in rounds.

    A round is as many steps as the rank holding the fewest batches has (a ``MIN`` allreduce of the batches each
    holds). A round longer than ``ROUND_BATCHES`` (the data keeps ahead) starts the next round's agreement before
    its last step, on the batches each rank holds beyond it, so that the agreement completes while the loop
    trains. Otherwise, or when that early agreement comes back 0 (some rank holds nothing more: the data is late,
    or the epoch ends), the ranks agree again at the round's end, each first waiting a little for a round's worth
    of batches or the epoch's end (:meth:`_take_arrived`). An agreement of 0 then ends the rounds, and the ranks
    pool what is left and share it out (:meth:`_share_out`). Every agreement costs each rank a few wake-ups, so
    rounds are kept long.

    Args:
        intake: this rank's batches.
        comm: the mpi4py communicator of the ranks that keep even.
        ep: the epoch's figures (data-wait, dropped batches).
        prefetch, prefetch_bytes: this rank's window (what a round's worth can be, see :meth:`_round_full`).
        on_drop: called with each batch dropped at the epoch's end (``remainder="drop"``).
        remainder: what the batches left over at the epoch's end become (``wire.remainder``); every rank the same.
    """

    def __init__(self, intake: Intake, comm: Any, ep: EpochStats, *, prefetch: int, prefetch_bytes: int,
                 on_drop: Callable[[Batch], None] | None, remainder: str = "split"):
        self._intake, self._comm, self._ep, self._remainder = intake, comm, ep, remainder
        self._prefetch, self._prefetch_bytes, self._on_drop = prefetch, prefetch_bytes, on_drop
        self._ready: deque[Item] = deque()                  # batches held for the coming steps
        self._ahead: collectives.PendingMin | None = None   # the next round's agreement, posted early

    def steps(self) -> Generator[Step, None, None]:
        """The epoch's steps. Closing it early (the loop left) completes an agreement this rank posted."""
        try:
            while (steps := self._agree()) > 0:
                for step in range(steps - 1, -1, -1):
                    if step == 0 and steps > ROUND_BATCHES:
                        self._agree_ahead()
                    yield Step(*self._ready.popleft())
        except BaseException:                   # the loop left early (break, or an error)
            self._abandon()
            raise
        yield from self._share_out()

    # ---- rounds ---------------------------------------------------------------------------------------------

    def _agree(self) -> int:
        """The steps of the next round, the same on every rank: the early agreement if one was posted and is
        not 0, else a new one at the round's end. 0: some rank's share is used up."""
        ep, intake = self._ep, self._intake
        if self._ahead is not None:
            pending, self._ahead = self._ahead, None     # an error while waiting must not wait again on the way out
            with intake.waiting(ep, for_peers=True):
                steps = pending.result(idle=intake.service)
            if steps:
                return steps
        if not self._ready and not intake.end_seen:
            item = intake.next_batch(ep)
            if item is not None:
                self._ready.append(item)
        # Some rank ran short: agreements would come one step at a time while the data trickles in; hold on
        # briefly for a round's worth instead.
        self._take_arrived(until_full=True)
        with intake.waiting(ep, for_peers=True):
            intake.flush()              # nothing of ours may hold the broker back while we agree
            return collectives.allreduce_min(self._comm, len(self._ready), idle=intake.service)

    def _agree_ahead(self) -> None:
        """Before a long round's last step: post the next round's agreement on what this rank holds beyond it."""
        self._take_arrived()
        self._intake.flush()
        self._ahead = collectives.PendingMin(self._comm, len(self._ready) - 1)

    def forget(self, broker: Any, gone: bool) -> None:
        """``broker`` lost this epoch. The batches held for the coming steps were counted in an agreement with the
        other ranks, so they stay and are trained from this rank's copy: they count as used now (what the loss's
        RECLAIM says), and the broker that takes the lost partitions over drops its recomputed copies. Conservative:
        one that ends up dropped for evenness, or skipped by a loop that leaves early, is then not trained."""
        for header, _ in self._ready:
            if self._intake.source_of(header) is broker:
                self._intake.note_used(header)

    def _abandon(self) -> None:
        """The loop left the epoch early: complete the agreement every rank posted, and put back what this rank
        holds (the next epoch skips and acknowledges it)."""
        if self._ahead is not None:
            self._ahead.result(idle=self._intake.service)
        self._intake.put_back(self._ready)

    def _take_arrived(self, until_full: bool = False) -> None:
        """Move the batches that have arrived to the round's. With ``until_full``, then wait up to ``ROUND_LINGER``
        seconds (in ``poll``, counted as data-wait) for a round's worth (:meth:`_round_full`) or the epoch's end."""
        intake, ep = self._intake, self._ep
        deadline = time.monotonic() + ROUND_LINGER
        while not intake.end_seen:
            item = intake.next_batch(ep, block=False)
            if item is not None:
                self._ready.append(item)
                continue
            now = time.monotonic()
            if intake.end_seen or not until_full or now >= deadline or self._round_full():
                return
            with intake.waiting(ep, for_peers=False):
                intake.poll(math.ceil((deadline - now) * 1000))      # whole ms: 0 would not wait at all

    def _round_full(self) -> bool:
        """This rank holds ROUND_BATCHES batches, or as many as the window is sure to admit (``prefetch``) and half
        its bytes: more may not come until it consumes."""
        if len(self._ready) >= ROUND_BATCHES:
            return True
        return (len(self._ready) >= self._prefetch
                and 2 * sum(h["nbytes"] for h, _ in self._ready) >= self._prefetch_bytes)

    # ---- the epoch's end ------------------------------------------------------------------------------------

    def _share_out(self) -> Iterator[Step]:
        """Some rank's share is used up: gather what is left everywhere and share it out evenly. Every batch is
        acknowledged before the exchange; the ``sum % size`` left over follow ``remainder``: one more step on
        every rank, a piece of them (:func:`worker.rebalance.share_remainder`), or dropped."""
        ep, intake = self._ep, self._intake
        held, self._ready = list(self._ready), deque()
        for header, _ in held:
            intake.ack(header, send=False)
        if not intake.end_seen:         # next_batch counts its own wait
            while (more := intake.next_batch(ep)) is not None:
                held.append(more)
                intake.ack(more.header, send=False)
        with intake.waiting(ep, for_peers=False):      # the ranks' exchange
            intake.flush()
            counts = collectives.allgather_count(self._comm, len(held), idle=intake.service)
            transfers, target = rebalance.plan_transfers(counts)
            held = rebalance.exchange(self._comm, held, transfers, idle=intake.service)
            piece = None
            if sum(counts) % len(counts):     # something is left over: every rank shares it out (or drops it)
                piece = rebalance.share_remainder(self._comm, held[target:], self._remainder, idle=intake.service)
        if piece is not None:
            yield from (Step(header, batch, acknowledge=False) for header, batch in held[:target])
            yield Step(*piece, acknowledge=False)
            return
        for header, batch in held[target:]:
            ep.dropped_batches += 1
            ep.dropped_rows += header["rows"]
            if self._on_drop is not None:
                self._on_drop(batch)
        for header, batch in held[:target]:
            yield Step(header, batch, acknowledge=False)
