"""Equal steps granted by the broker: the plan a ``BatchStream`` epoch follows with ``rank=``/``size=`` (any
launcher), and the default with an MPI communicator too.

The rank needs no collective: each broker says how many of its batches every rank of the group may use
(``STEPS``, cumulative per epoch, the smallest count it has given any rank), and at the epoch's end tells the
ranks with more than the share to keep the share, drop what is left over and return the rest (``RELEASE``), which
it gives to the ranks short of it. ``EPOCH_END`` then says the epoch's steps from that broker, the same on every
rank. See ``broker.grants`` for the broker's side, docs/PROTOCOL.md "Granted steps" and docs/GUARANTEES.md.

A rank takes a batch of a broker only while it has used fewer than that broker's grant, so at the end it can keep
the share and give back what the others need: what it gives back it has never yielded.

After a loss (docs/design/RECOVERY.md), what this rank had used of the lost broker is matched by the broker that
took its partitions over, and that broker counts it as this rank's (``STEPS.adopted``, cumulative): the rank counts
``taken + adopted`` against the grant, the epoch's steps and RELEASE's ``keep``. The lost broker's grant starts
again from 0 (:meth:`GrantedSteps.forget`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator

from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.headers import BatchHeader
from sparkbus.wire.protocol import Kind
from sparkbus.worker.connection import BrokerConnection
from sparkbus.worker.intake import Batch, Intake, Item
from sparkbus.worker.stats import EpochStats
from sparkbus.worker.steps import Step

log = logging.getLogger("sparkbus.worker")


class GrantedSteps:
    """The steps the brokers grant this rank in one epoch, taking turns among brokers with a grant to use.

    Args:
        intake: this rank's batches.
        ep: the epoch's figures (data-wait, dropped batches).
        on_drop: called with each batch dropped at the epoch's end to keep the ranks even.
    """

    def __init__(self, intake: Intake, ep: EpochStats, on_drop: Callable[[Batch], None] | None):
        self._intake, self._ep, self._on_drop = intake, ep, on_drop
        brokers = intake.connections
        self._held: dict[BrokerConnection, deque[Item]] = {b: deque() for b in brokers}   # received, not used
        self._granted = dict.fromkeys(brokers, 0)      # the broker's last STEPS
        self._taken = dict.fromkeys(brokers, 0)        # used (yielded)
        self._adopted = dict.fromkeys(brokers, 0)      # used of lost brokers, counted here (STEPS.adopted)
        self._final: dict[BrokerConnection, int] = {}  # the epoch's steps, from its EPOCH_END
        self._turn = 0

    def steps(self) -> Generator[Step, None, None]:
        """The epoch's steps. Closing it early (the loop left) puts back what this rank holds (the next epoch skips
        and acknowledges it)."""
        ep = self._ep
        try:
            while True:
                item = self._next()
                if item is not None:
                    yield Step(*item)
                    continue
                if self._over():
                    break
                with self._intake.waiting(ep, for_peers=self._waiting_for_grant()):
                    self._pump()
        except BaseException:
            self._intake.put_back(deque(item for held in self._held.values() for item in held))
            raise
        self._drop_left_over()

    # ---- taking -----------------------------------------------------------------------------------------------

    def _next(self) -> Item | None:
        """A batch of a broker whose grant this rank has not used up, taking turns among brokers."""
        brokers = list(self._held)         # a broker gone for good after its end still has its batches here
        for _ in range(len(brokers)):
            self._turn = (self._turn + 1) % len(brokers)
            broker = brokers[self._turn]
            held = self._held[broker]
            if held and self._used(broker) < self._final.get(broker, self._granted[broker]):
                self._taken[broker] += 1
                return held.popleft()
        return None

    def _waiting_for_grant(self) -> bool:
        """Whether this rank holds batches it may not use yet: a peer has fewer (the grant is the smallest count)."""
        return any(held and self._used(b) >= self._final.get(b, self._granted[b]) for b, held in self._held.items())

    def _over(self) -> bool:
        """Every broker ended the epoch and this rank took the steps each said.

        Raises:
            ProtocolError: a broker ended the epoch with more steps than it gave this rank batches for.
        """
        if len(self._final) < len(self._taken):
            return False
        for broker, steps in self._final.items():
            if self._used(broker) < steps:
                if not self._held[broker]:
                    raise ProtocolError(f"the broker at {broker.address} ended epoch {self._ep.epoch} with {steps} "
                                        f"steps, but this rank has had only {self._used(broker)} of its batches "
                                        f"({self._adopted[broker]} of them adopted)")
                return False
        return True

    def _used(self, broker: BrokerConnection) -> int:
        """What counts as taken from ``broker``: the batches yielded of it, and those it adopted."""
        return self._taken[broker] + self._adopted[broker]

    def forget(self, broker: BrokerConnection, gone: bool) -> None:
        """``broker`` lost this epoch: drop what this rank holds of it (it comes again from Spark), and start its
        grant again from 0 (what this rank took of it is adopted by the broker that takes it over). ``gone``: it
        is no longer read at all."""
        self._held[broker].clear()
        self._granted[broker] = self._taken[broker] = self._adopted[broker] = 0
        self._final.pop(broker, None)
        if gone:
            for books in (self._held, self._granted, self._taken, self._adopted):
                del books[broker]

    def _pump(self) -> None:
        """Wait for the next message from a broker still in the epoch, and take it in."""
        message = self._intake.receive(block=True)
        if message is None:
            return
        broker, header, frames = message
        if header["kind"] == Kind.BATCH:
            self._held[broker].extend(self._intake.unpack(broker, header, frames, self._ep))
        elif header["kind"] == Kind.STEPS:
            self._granted[broker] = max(self._granted[broker], header["steps"])
            self._adopted[broker] = max(self._adopted[broker], header.get("adopted", 0))
        elif header["kind"] == Kind.RELEASE:
            self._release(broker, header["epoch"], header["keep"], header["drop"])
        elif header["kind"] == Kind.EPOCH_END:
            steps = header.get("steps")
            if steps is None:
                raise ProtocolError(f"the broker at {broker.address} ended epoch {header['epoch']} without granted "
                                    f"steps (is another group of ranks consuming stream {broker.stream!r}?)")
            self._final[broker] = steps
            self._intake.ended(broker, header, self._ep)

    # ---- the epoch's end ----------------------------------------------------------------------------------

    def _release(self, broker: BrokerConnection, epoch: int, keep: int, drop: int) -> None:
        """RELEASE: keep ``keep`` of this broker's batches (those used and adopted included), drop the next
        ``drop``, return the rest, which this rank has not used, for the ranks short of the share."""
        held = list(self._held[broker])
        used = self._used(broker)
        keep_more = max(keep - used, 0)
        if keep < used:
            log.warning("rank %d had used %d batches of the broker at %s in epoch %d, more than the share of %d: "
                        "its group changed in the middle of the epoch", broker.rank, used, broker.address, epoch, keep)
        dropped = held[keep_more:keep_more + drop]
        self._held[broker] = deque(held[:keep_more])
        for header, batch in dropped:
            self._intake.ack(header, send=False)
            self._count_drop(header, batch)
        self._intake.give_back(broker, epoch, held[keep_more + drop:], kept=used + keep_more)

    def _drop_left_over(self) -> None:
        # The broker gives no rank more than its steps after RELEASE; should one, the batch counts as dropped.
        for held in self._held.values():
            while held:
                header, batch = held.popleft()
                log.warning("a batch beyond the epoch's granted steps: dropped")
                self._intake.ack(header, send=False)
                self._count_drop(header, batch)

    def _count_drop(self, header: BatchHeader, batch: Batch) -> None:
        self._ep.dropped_batches += 1
        self._ep.dropped_rows += header["rows"]
        if self._on_drop is not None:
            self._on_drop(batch)
