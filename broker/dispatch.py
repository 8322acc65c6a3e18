"""The ledger's rules for handing batches to ranks: windows, the rotation among ranks, acknowledgements, epoch ends.

:meth:`Dispatch.dispatch` sends through a :data:`~broker.books.Transmit` that only does the I/O and says what became
of each message; consequences (a rank found gone) are queued during a pass over the ranks and applied after it,
so nothing changes the ranks or the queue while a pass iterates over them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from sparkbus.broker.books import Books, Outcome, RankGone, Transmit
from sparkbus.broker.buckets import BucketGroups
from sparkbus.broker.grants import Grants
from sparkbus.broker.pieces import cut
from sparkbus.broker.state import MAX_WINDOW, EpochState, HeldBatch, RankState, StreamState
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import ErrorCode, Kind
from sparkbus.wire.requests import RankReport

log = logging.getLogger("sparkbus.broker")

MAX_WINDOW_BYTES = 1 << 40


class Dispatch:
    """Windows stated by ranks, batches sent within them, acknowledgements, and the end of each epoch.

    Args:
        books: the ledger's state.
        grants: the rules of granted steps (STEPS as batches go out, the epoch's end evened out).
        gone: the ledger's "a rank is gone".

    A coordinated epoch's batches (a feed with ``bucket_bounds``) go out in groups of one bucket, one batch per
    rank (:class:`~broker.buckets.BucketGroups`, held here); the rest of the queue, and its end, by the rotation.
    """

    def __init__(self, books: Books, grants: Grants, gone: RankGone):
        self.books = books
        self.grants = grants
        self.gone = gone
        self.buckets = BucketGroups(books)

    def rank(self, identity: bytes) -> RankState:
        """The rank on this connection. Raises :class:`ProtocolError` (``UNKNOWN_RANK``) if it has not joined."""
        rank = self.books.ranks.get(identity)
        if rank is None:
            raise ProtocolError("unknown rank: send HELLO with role 'rank' first", ErrorCode.UNKNOWN_RANK)
        return rank

    def heard_from(self, identity: bytes, now: float | None = None) -> None:
        """A message came from this connection (its rank's ``idle_s`` starts again)."""
        rank = self.books.ranks.get(identity)
        if rank is not None:
            rank.last_seen = time.monotonic() if now is None else now

    def set_window(self, rank: RankState, batches: int, nbytes: int) -> None:
        """A rank says how much may be in flight to it: ``batches`` batches, or ``nbytes`` bytes of batches."""
        if not 0 <= batches <= MAX_WINDOW or not 0 <= nbytes <= MAX_WINDOW_BYTES:
            raise ProtocolError(f"a window of {batches} batches or {nbytes} bytes is outside 0..{MAX_WINDOW} "
                                f"batches and 0..{MAX_WINDOW_BYTES} bytes")
        rank.window, rank.window_bytes, rank.window_stated = batches, nbytes, True

    def report(self, rank: RankState, h: RankReport) -> None:
        """Keep the figures a rank reports about itself (data-wait, time to first batch, batches consumed)."""
        rank.report(h)

    def acknowledge(self, rank: RankState, ids: Sequence[Any], upto: Sequence[Any] = ()) -> int:
        """Forget acknowledged batches (``ids``: epoch, part, seq, epoch, part, seq, ...), and the used batches of
        packs still in use (``upto``: epoch, part, seq, stop, ...: the pack's batches before ``stop``): should the
        rank die, they are cut off the pack, and only the rest of it goes to another rank.

        Returns how many ids were not in flight to that rank.
        Raises:
            ProtocolError: ids that are not whole triples of integers, or ``upto`` not whole quadruples.
        """
        if len(ids) % 3 or len(upto) % 4:
            raise ProtocolError(f"ACK ids must be (epoch, part, seq) triples and upto (epoch, part, seq, stop) "
                                f"quadruples, got {len(ids)} and {len(upto)} numbers")
        if not all(type(i) is int for i in ids) or not all(type(i) is int for i in upto):
            raise ProtocolError("ACK ids must be integers")      # checked whole first: a refused ACK changes nothing
        pop, consumed = rank.inflight.pop, []
        unknown = 0
        if upto:
            values = iter(upto)
            for epoch, part, seq, stop in zip(values, values, values, values):
                piece = rank.inflight.get((epoch, part, seq))
                if piece is None or not piece.first < stop <= piece.first + piece.count:
                    unknown += piece is None
                    continue
                if stop == piece.first + piece.count:
                    consumed.append(pop((epoch, part, seq)))
                elif stop > piece.used:
                    # noted, and counted as acknowledged; cut off only if the pack goes to another rank
                    self._count_used(rank, piece, stop - max(piece.used, piece.first))
                    piece.used = stop
        cut_off = len(consumed)
        triples = iter(ids)
        for key in zip(triples, triples, triples):
            batch = pop(key, None)
            if batch is not None:
                consumed.append(batch)
        for batch in consumed:
            if batch.used > batch.first:        # its used batches were counted already
                self._count_used(rank, batch, batch.first - batch.used)
        self.books.consumed(self.books.streams[rank.stream], rank, consumed)
        return unknown + len(ids) // 3 - (len(consumed) - cut_off)

    def _count_used(self, rank: RankState, batch: HeldBatch, n: int) -> None:
        """Count ``n`` (or take back ``-n``) batches of a pack in flight to ``rank`` as acknowledged, in the rank's
        and the epoch's figures."""
        rank.acked += n
        ep = self.books.streams[rank.stream].epochs.get(batch.id[0])
        if ep is not None:
            ep.acked += n

    def dispatch(self, stream: StreamState, transmit: Transmit) -> None:
        """Hand queued batches of the delivering epoch to ranks with room; end the epoch once delivered.

        ``transmit(identity, frames)`` sends one message and says what became of it. A batch it could not send
        stays first in the queue; a rank it found gone is forgotten (the ledger's ``rank_gone``) once the pass over
        the ranks is over, and the pass runs again for what that put back in the queue.
        """
        while stream.ready():
            ep = stream.delivering()
            if ep is None:
                return
            gone = self.buckets.send(stream, ep, transmit)
            if gone is None:
                gone = self._send_queued(stream, ep, transmit)
            if gone:
                for identity in gone:
                    self.gone(identity, "disconnected")
                continue
            granted = stream.granted()
            if granted and self.grants.share_remainder(stream, ep):
                continue                  # the remainder's pieces go out on the next pass
            if granted:
                self.grants.grant(stream, ep, transmit)
            if not ep.delivered(stream.even()):
                return
            if granted:
                if not self.grants.evened(stream, ep, transmit):
                    return                # RELEASE sent, or waiting for a RETURN or for a rank to come back
                end = protocol.pack_header(Kind.EPOCH_END, stream=stream.name, epoch=ep.epoch,
                                           batches=ep.batches_out, steps=ep.share)
            else:
                end = protocol.pack_header(Kind.EPOCH_END, stream=stream.name, epoch=ep.epoch,
                                           batches=ep.batches_out)
            gone = [r.identity for r in stream.ranks.values() if transmit(r.identity, [end]) is Outcome.GONE]
            ep.end_sent = True
            log.info("stream %r epoch %d delivered to %d ranks", stream.name, ep.epoch, len(stream.ranks) - len(gone))
            for identity in gone:
                self.gone(identity, "disconnected")
            self.books.retire(stream)

    def _send_queued(self, stream: StreamState, ep: EpochState, transmit: Transmit) -> list[bytes]:
        """One pass: the queue's batches, in order, to the ranks in rotation while they have room. Returns the
        identities of the ranks found gone (skipped for the rest of the pass)."""
        queue = ep.queue
        rotation = stream.rotation() if queue else []
        by_bytes = stream.windows_known()
        gone: list[bytes] = []
        sent = Outcome.SENT
        progress = True
        while queue and progress:
            progress = False
            for rank in rotation:
                if not queue:
                    break
                batch = queue[0]
                if not rank.has_room(batch.nbytes, by_bytes) or (gone and rank.identity in gone):
                    continue
                if ep.share is not None:          # being evened out: only to ranks short of the share
                    wanted = self.grants.may_take(ep, rank, batch)
                    if not wanted:
                        continue
                    if wanted < batch.count:
                        head, queue[0] = cut(batch, batch.first + wanted)
                        queue.appendleft(head)
                        batch = head
                outcome = transmit(rank.identity, batch.frames)
                if outcome is sent:           # it takes room in the rank's window until acknowledged
                    queue.popleft()
                    ep.sent(batch)
                    rank.sent(batch)
                    progress = True
                elif outcome is Outcome.GONE:
                    gone.append(rank.identity)
        return gone
