"""The broker's rules for batches, partitions, epochs and ranks, without sockets: what to keep, forward, commit.

The daemon calls the ledger with validated headers and does the I/O it asks for; the rules live in its parts,
one role each:

============================  ===========================================================================
``broker.books``              the shared state, batches consumed, epochs retired, the feed gate
``broker.partitions``         epochs opened and closed, batches kept or dropped, commits, claims
``broker.rejoin``             ranks joining, rejoining, lost and gone; what goes back to the queue
``broker.dispatch``           windows, batches to ranks, acknowledgements, epoch ends
``broker.recovery``           epochs streamed again after a loss or for a resume: hold, match, reclaims
============================  ===========================================================================

What the journal must keep, the ledger hands to its observers as events (``broker.events``); replay applies the
journal's records as the same events, through the same code, with the observers muted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sparkbus.broker.dispatch import MAX_WINDOW_BYTES
from sparkbus.broker.events import (
    Applied,
    BatchArrived,
    BatchesAcked,
    EpochClosed,
    EpochOpened,
    JournalRecorder,
    PartitionClaimed,
    PartitionCommitted,
    replayed_events,
)
from sparkbus.broker.journal import DeliveredEpochs, Journal
from sparkbus.broker.partitions import MAX_PARTITIONS, Rejected, Reply
from sparkbus.broker.recovery import Recovery
from sparkbus.broker.rejoin import MissedEnd
from sparkbus.broker.state import HeldBatch

log = logging.getLogger("sparkbus.broker")


class Ledger(Recovery):
    """Streams, epochs, partitions and ranks: every decision about a batch. The daemon only moves frames.

    Args:
        journal: where to keep what the broker promised (observes the ledger's events); None: memory only.
        rejoin_grace: seconds a lost rank's batches wait for it.
        max_buffer: bytes of batches held before the feed pauses (:meth:`update_feed_gate`); None: never.
    """

    def __init__(self, journal: Journal | None = None, rejoin_grace: float = 10.0, max_buffer: int | None = None):
        super().__init__(max_buffer, rejoin_grace)
        self.journal = journal
        if journal is not None:
            self.observe(JournalRecorder(journal))
        self._appliers: dict[type, Callable[[Any], list[Reply] | None]] = {
            EpochOpened: self._open, BatchArrived: lambda e: self._arrived(e.header, e.frames, e.header_bytes),
            PartitionCommitted: self._commit,
            PartitionClaimed: self._claim, EpochClosed: self._close, BatchesAcked: self._acked_while_away}
        self._away: dict[tuple[str, int], set[tuple[int, ...]]] = {}     # replay: acked ids per epoch

    def apply(self, event: Applied) -> list[Reply]:
        """Apply one event as the rules do live (the replies are those owed to tasks, if any).

        Raises:
            Rejected: a batch the rules drop.
        """
        return self._appliers[type(event)](event) or []

    def _acked_while_away(self, event: BatchesAcked) -> None:
        """Replay: batches a rank consumed before the restart. No rank holds them now (the ranks are gone), so they
        wait in the queue; :meth:`_settle_acked` takes them out once the epoch's records are read (one pass over
        the queue per epoch, not one per ACK record)."""
        self._away.setdefault((event.stream, event.epoch), set()).update(tuple(i) for i in event.ids)

    def _settle_acked(self, stream: str, epoch: int) -> None:
        ep = self.streams[stream].epochs.get(epoch)
        acked = self._away.pop((stream, epoch), set())
        if ep is None or not acked:
            return
        kept: deque[HeldBatch] = deque()
        for batch in ep.queue:
            if batch.id in acked:                # sent and acknowledged before the restart
                self.buffered -= batch.nbytes
                ep.count_out(batch)
                ep.count_acked(batch)
                ep.acked_before[batch.id] = batch.count    # a rank that rejoins may name it as consumed
            else:
                kept.append(batch)
        ep.queue = kept

    # ---- restart ----------------------------------------------------------------------------------------

    def replay(self) -> None:
        """Rebuild streams and epochs from the journal: committed and acknowledged state as it was."""
        assert self.journal is not None
        for record in self.journal.retired():
            stream = self.stream(record["stream"])
            if "delivered" in record:        # a compacted journal: epochs delivered long ago, figures dropped
                stream.finished = DeliveredEpochs(record["delivered"], stream.finished, self.journal.keep_stats)
            else:
                stream.finished[record["epoch"]] = record["stats"]
        self._muted = True                   # what is applied now is in the journal already
        try:
            for replayed in self.journal.replay():
                if replayed.epoch in self.stream(replayed.stream).finished:
                    continue
                events = replayed_events(replayed)
                first = next(events, None)
                if not isinstance(first, EpochOpened):
                    continue                 # nothing before the epoch's open is worth anything
                self.apply(first)
                for event in events:
                    try:
                        self.apply(event)
                    except Rejected:
                        pass
                self._settle_acked(replayed.stream, replayed.epoch)
        finally:
            self._muted = False
            self._away.clear()
        restored = sum(len(e.queue) for s in self.streams.values() for e in s.epochs.values())
        log.info("journal replayed: %d epochs, %d unacknowledged batches to deliver",
                 sum(len(s.epochs) for s in self.streams.values()), restored)
        # Independent consumers are each "rank 0 of 1": the first to come back would complete its stream and could
        # be given a batch another one had in hand, or had consumed without the journal hearing of it. Their
        # streams wait --rejoin-grace for every consumer to come back and name what it has.
        until = time.monotonic() + self.rejoin_grace
        for stream in self.streams.values():
            if stream.epochs:
                stream.held_until = until


__all__ = ["Ledger", "MissedEnd", "Rejected", "Reply", "MAX_PARTITIONS", "MAX_WINDOW_BYTES"]
