"""The ledger's rule for coordinated buckets: the batches of one global step, one per rank, from one length bucket.

A feed with ``bucket_bounds`` (``feeder.columns.bucketed_by_bounds``) sends batches that each hold rows of one length
bucket and say which in their header (``BATCH.bucket``; ``HeldBatch.bucket``). Ranks read a broker's batches in the
order they arrive, so a rank's ``i``-th batch from this broker is its ``i``-th step (granted steps). The rule:

- **Groups.** The epoch's queue stays the one place its unsent batches wait (a rank that rejoins, a resume, the
  journal all look there). Each pass looks for a *group*: the first bucket, from the queue's head, with one batch
  per connected rank. Every rank then gets one member, all in the same pass, so every rank's ``i``-th batch is
  group ``i``'s. A group forms only when every rank has room in its window. Finding one reads at most
  ``buckets * (ranks - 1) + 1`` batches of the queue (that many hold a group, by pigeonhole), whatever the
  queue's length; nothing new is kept per bucket.
- **Owed.** A member the rank's socket did not take (its queue was full) goes back to the queue's front and is
  *owed* to that rank: it goes to that rank before anything else does and no group forms meanwhile (at most one
  per rank). A rank found gone owes nothing: its member is in the queue, and what it had in flight is requeued by
  the rules of rank loss (``broker.rejoin``); both join groups again.
- **The epoch's end.** Once the epoch is closed and no bucket holds a group (fewer than ``buckets * (ranks - 1) +
  1`` batches left), the rest goes out the normal way (``Dispatch``'s rotation, then the grants' evening out and the
  remainder shared out by rows), sorted by bucket first so that neighbouring buckets share those last steps. So
  does everything while the epoch is evened out, and batches with no bucket. Independent consumers (each rank 0
  of 1) have no steps in common: they take batches as they come, coordinated or not.
- **A buffer too small for the pools.** While the queue has no group and the broker's buffer is full (the feed is
  paused), the queue goes out the normal way too: steps mixed, never a deadlock. A buffer that holds
  ``buckets * ranks`` batches beside the ranks' windows never meets it.

With several brokers, each coordinates its own batches: see docs/DECISIONS.md, "Coordinated buckets".
"""

from __future__ import annotations

import logging
from collections import deque

from sparkbus.broker.books import Books, Outcome, Transmit
from sparkbus.broker.state import EpochState, HeldBatch, RankState, StreamState

log = logging.getLogger("sparkbus.broker")


class BucketGroups:
    """Hands a coordinated epoch's batches to the ranks in groups of one bucket (see the module's notes).

    Args:
        books: the ledger's state.
    """

    def __init__(self, books: Books):
        self.books = books
        # rank connection -> the member of a group its socket did not take (back in the queue): sent to it first.
        # One per rank at most (no group forms while one is owed), forgotten with the rank.
        self.owed: dict[bytes, HeldBatch] = {}

    def send(self, stream: StreamState, ep: EpochState, transmit: Transmit) -> list[bytes] | None:
        """One pass over a coordinated epoch: what is owed, then as many groups as the windows take.

        Returns the connections found gone (as ``Dispatch._send_queued``), or None when the queue is to go out the
        normal way now: the epoch is not coordinated (no batch with a bucket), its ranks are independent consumers,
        it is being evened out, it is closed and no bucket can fill a group, or no group is there while the buffer
        is full.
        """
        for identity in [i for i in self.owed if i not in self.books.ranks]:
            del self.owed[identity]       # a rank gone: its member is back in the queue already
        queue = ep.queue
        if ep.share is not None or not queue or queue[0].bucket is None or stream.expected_ranks < 2:
            return None     # evened out, empty, not coordinated (read in O(1): the common case), or independent
            # consumers (each rank 0 of 1), who take batches as they come: no step of theirs is another's
        ranks = sorted(stream.ranks.values(), key=lambda r: r.rank)
        gone: list[bytes] = []
        if self._owes(stream):
            self._send_owed(ranks, ep, transmit, gone, stream.windows_known())
            return gone
        by_bytes = stream.windows_known()
        groups = 0
        while ranks:
            group = find_group(queue, len(ranks))
            if group is None:
                break
            members = [queue[i] for i in group]
            if not all(rank.has_room(batch.nbytes, by_bytes) for rank, batch in zip(ranks, members)):
                return gone               # the group waits for room in every window
            take_out(queue, group)
            self._send_group(ranks, members, ep, transmit, gone)
            if gone or self._owes(stream):
                return gone
            groups += 1
        if ep.closed:
            # the epoch's tail: no bucket can fill a group; neighbouring buckets share the last steps
            ep.queue = deque(sorted(queue, key=lambda b: (b.bucket is None, b.bucket or 0)))
            return None
        if not groups and self.books.feed_full():
            log.debug("stream %r epoch %d: the buffer is full and no bucket holds a group: batches go out the "
                      "normal way", stream.name, ep.epoch)
            return None
        return gone                       # the pools fill as batches arrive

    def _owes(self, stream: StreamState) -> bool:
        return any(identity in self.owed for identity in stream.ranks)

    def _send_group(self, ranks: list[RankState], members: list[HeldBatch], ep: EpochState, transmit: Transmit,
                    gone: list[bytes]) -> None:
        """One member to each rank; a member its rank's socket did not take is owed to it, one found gone goes
        back to the queue for the next group."""
        for rank, batch in zip(ranks, members):
            outcome = transmit(rank.identity, batch.frames)
            if outcome is Outcome.SENT:
                ep.sent(batch)
                rank.sent(batch)
                continue
            ep.queue.appendleft(batch)
            if outcome is Outcome.GONE:
                gone.append(rank.identity)
            else:
                self.owed[rank.identity] = batch

    def _send_owed(self, ranks: list[RankState], ep: EpochState, transmit: Transmit, gone: list[bytes],
                   by_bytes: bool) -> None:
        for rank in ranks:
            batch = self.owed.get(rank.identity)
            if batch is None or not rank.has_room(batch.nbytes, by_bytes):
                continue
            try:
                ep.queue.remove(batch)    # near the front: it went back there
            except ValueError:            # taken since (the epoch was reset, or its end cut it into pieces)
                del self.owed[rank.identity]
                continue
            outcome = transmit(rank.identity, batch.frames)
            if outcome is Outcome.FULL:
                ep.queue.appendleft(batch)
                continue
            del self.owed[rank.identity]
            if outcome is Outcome.GONE:
                ep.queue.appendleft(batch)
                gone.append(rank.identity)
                continue
            ep.sent(batch)
            rank.sent(batch)


def find_group(queue: deque[HeldBatch], ranks: int) -> list[int] | None:
    """The positions in ``queue`` of the first ``ranks`` batches of the first bucket to have that many, reading from
    the head; None if no bucket has. Batches with no bucket are passed over. Reads at most ``buckets * (ranks - 1)
    + 1`` batches with a bucket: by then one bucket has ``ranks``."""
    seen: dict[int, list[int]] = {}
    for position, batch in enumerate(queue):
        bucket = batch.bucket
        if bucket is None:
            continue
        at = seen.setdefault(bucket, [])
        at.append(position)
        if len(at) == ranks:
            return at
    return None


def take_out(queue: deque[HeldBatch], positions: list[int]) -> None:
    """Remove the batches at ``positions`` (rising) from ``queue``, the others keeping their order: the prefix up to
    the last position is read once."""
    wanted = set(positions)
    kept = [queue.popleft() for _ in range(positions[-1] + 1)]
    for position in range(len(kept) - 1, -1, -1):
        if position not in wanted:
            queue.appendleft(kept[position])
