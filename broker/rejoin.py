"""The ledger's rules for ranks that come and go: admission, rejoining, orphans, and what goes back to the queue.

A rank that comes back (its ``session`` is known: a new connection of the same BatchStream, or any ``resume``
after a broker restart) names the batches of its current epoch that it holds unacknowledged and those it
consumed; neither is sent again nor given to another rank. See docs/PROTOCOL.md, "A rank".
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from sparkbus.broker.books import Books, Outcome, RankGone, Transmit
from sparkbus.broker.pieces import cut
from sparkbus.broker.state import HeldBatch, Orphan, RankState, StreamState
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import ErrorCode, Kind
from sparkbus.wire.records import BatchId
from sparkbus.wire.requests import HelloHeader

log = logging.getLogger("sparkbus.broker")

# Characters of a rank's session (a BatchStream draws 16 hex digits): kept with its connection, its lost connection
# and its RECLAIMs, so a peer's long strings are refused rather than kept.
MAX_SESSION = 64


def check_rank_hello(h: HelloHeader) -> None:
    """Raise :class:`ProtocolError` for a rank's HELLO whose number is outside its communicator or whose session is
    longer than :data:`MAX_SESSION`: checked before anything changes."""
    if not 0 <= h["rank"] < h["size"]:
        raise ProtocolError(f"rank {h['rank']} is outside a communicator of size {h['size']}")
    if len(h["session"]) > MAX_SESSION:
        raise ProtocolError(f"a rank's session must have at most {MAX_SESSION} characters, got {len(h['session'])} "
                            f"(BatchStream draws 16 hex digits)")


class MissedEnd(NamedTuple):
    """An epoch that ended while a rank was away: what to send it again, then ``EPOCH_END(epoch, batches)``."""

    epoch: int
    batches: int
    resend: list[HeldBatch]      # batches of the epoch sent into its lost connection, now in flight to it again


class Rejoin:
    """Ranks joining, rejoining and leaving; the batches of those that leave.

    Args:
        books: the ledger's state.
        gone: the ledger's "a rank is gone", for a rank found gone here (every rule that follows from it runs).
    """

    def __init__(self, books: Books, gone: RankGone):
        self.books = books
        self.gone = gone

    def join(self, identity: bytes, h: HelloHeader, held: Iterable[BatchId] = (),
             consumed: Iterable[BatchId] = ()) -> list[MissedEnd]:
        """Admit a rank that said HELLO on the ranks socket, or take back one that rejoins.

        A rank that comes back names the batches of its current epoch that it ``held`` unacknowledged and those it
        ``consumed``. Held ones are in flight to the new connection, consumed ones count as acknowledged. What the
        old connection had in flight beyond them never reached the rank and goes back to the queue.

        Returns:
            Each epoch that ended while a resuming rank was away, in order: its EPOCH_END may have been lost with
            the old connection, so it is sent again (:meth:`send_missed`), after the batches of that epoch the old
            connection lost.
        Raises:
            ProtocolError: a rank number outside its communicator, a communicator size other than the stream's
                ranks have, or (``ALREADY_CONNECTED``) a rank number that another process (another session) holds
                connected.
        """
        size, number, name, session = h["size"], h["rank"], h["stream"], h["session"]
        check_rank_hello(h)
        stream = self.books.stream(name)
        current = self.books.ranks.get(identity)
        if current is not None and session and current.session == session and current.stream == name:
            return []                    # the same HELLO again on the same connection: nothing changes
        if current is not None:
            self.gone(identity, "said hello again", keep=False)
        if stream.ranks and size != stream.expected_ranks:
            raise ProtocolError(f"stream {name!r} is consumed by {stream.expected_ranks} ranks; "
                                f"a rank of a communicator of size {size} cannot join it")
        previous = self.same_session(stream, session, number)
        if size > 1 and any(r.rank == number and r is not previous for r in stream.ranks.values()):
            raise ProtocolError(f"rank {number} of stream {name!r} is already connected",
                                ErrorCode.ALREADY_CONNECTED)
        for other, orphan in list(stream.orphans.items()):
            if size > 1 and orphan.rank.rank == number and other != session:
                del stream.orphans[other]          # another process took this rank number: the old one is gone
                self.requeue(stream, orphan.rank)
        if previous is not None:
            stream.orphans.pop(previous.session, None)
            if self.books.ranks.get(previous.identity) is previous:
                del self.books.ranks[previous.identity], stream.ranks[previous.identity]
        stream.expected_ranks = size
        rank = stream.ranks[identity] = self.books.ranks[identity] = RankState(identity, name, number, size,
                                                                         even=h["even"], session=session)
        if len(stream.ranks) >= stream.expected_ranks:
            stream.complete = True
        if previous is None and not h["resume"]:
            log.info("rank %d/%d joined stream %r", number, size, name)
            return []
        lost = self._reconcile(stream, rank, previous, set(held), set(consumed))
        stream.rejoins += 1
        missed = self._missed_ends(stream, h["ended"], lost)
        self.requeue_batches(stream, lost)      # what is left of them belongs to epochs still being delivered
        for batch in (b for m in missed for b in m.resend):
            rank.hold(batch)                     # sent again by send_missed, beyond its window: acknowledged first
            stream.epochs[batch.id[0]].resent(batch)
        log.info("rank %d/%d rejoined stream %r: %d batches stay with it, %d of its old connection's are requeued",
                 number, size, name, len(rank.inflight), len(lost))
        return missed

    def send_missed(self, identity: bytes, missed: list[MissedEnd], transmit: Transmit) -> None:
        """Send a rank that rejoined what it missed (:meth:`join`'s answer), after its WELCOME: per epoch, the
        batches its old connection lost, then the epoch's EPOCH_END. Stops if the rank is gone again: what it holds
        waits for it as before."""
        rank = self.books.ranks.get(identity)
        for end in missed:
            if rank is None or self.books.ranks.get(identity) is not rank:
                return
            for batch in end.resend:
                outcome = transmit(identity, batch.frames)
                if outcome is not Outcome.SENT:
                    if outcome is Outcome.GONE:
                        self.gone(identity, "disconnected")
                    return
            header = protocol.pack_header(Kind.EPOCH_END, stream=rank.stream, epoch=end.epoch, batches=end.batches)
            if transmit(identity, [header]) is Outcome.GONE:
                self.gone(identity, "disconnected")
                return

    def same_session(self, stream: StreamState, session: str, number: int) -> RankState | None:
        """The earlier connection (live or orphaned) of the rank that says HELLO, if there is one."""
        if not session:
            return None
        orphan = stream.orphans.get(session)
        if orphan is not None and orphan.rank.rank == number:
            return orphan.rank
        return next((r for r in stream.ranks.values() if r.session == session and r.rank == number), None)

    def _reconcile(self, stream: StreamState, rank: RankState, previous: RankState | None, held: set[BatchId],
                   consumed: set[BatchId]) -> list[HeldBatch]:
        """Give ``rank`` the batches it holds and acknowledge those it consumed.

        Returns the batches the old connection had in flight that never reached the rank.
        """
        inflight = previous.inflight if previous is not None else {}
        wanted = held | consumed
        found = {i: b for i, b in inflight.items() if i in wanted}
        missing = wanted - found.keys()
        if missing:                      # after a restart or a requeue they wait in a queue: take them out
            for ep in stream.epochs.values():
                if not any(b.id in missing for b in ep.queue):
                    continue
                rest: deque[HeldBatch] = deque()
                for batch in ep.queue:
                    if batch.id in missing:
                        found[batch.id] = batch
                        ep.count_out(batch)          # out again: to the rank that has it
                    else:
                        rest.append(batch)
                ep.queue = rest
        late = missing - found.keys()
        if previous is not None:
            late -= consumed             # acknowledged on the old connection, which is still known: consumed once
        for batch_id in late & consumed:
            before = stream.epochs.get(batch_id[0])
            if before is not None and batch_id in before.acked_before:     # consumed before the broker restarted
                count = before.acked_before.pop(batch_id)
                rank.given[batch_id[0]] = rank.given.get(batch_id[0], 0) + count
                late.discard(batch_id)
        if late:
            # Batches it had that are nowhere to take back from: its grace ran out and they went to another rank
            # (or were consumed there). Both ranks have them; say so, loudly, and count them.
            for batch_id in late:
                twice = stream.epochs.get(batch_id[0])
                if twice is not None:
                    # a message in flight to another rank counts its batches (a pack's); one consumed there, 1
                    given = next((r.inflight[batch_id] for r in stream.ranks.values() if batch_id in r.inflight),
                                 None)
                    twice.count_given_twice(1 if given is None else given.count)
            log.warning("rank %d of stream %r came back to find %d batches it held or consumed already gone to "
                        "another rank: they are trained twice (it was away longer than --rejoin-grace, or the broker "
                        "restarted and handed them out before it was back; raise --rejoin-grace above the longest "
                        "outage to ride out)", rank.rank, stream.name, len(late))
        acked: list[HeldBatch] = []
        for batch_id, batch in found.items():
            if batch_id in held:
                rank.hold(batch)
            else:
                acked.append(batch)
        self.books.consumed(stream, rank, acked, held=False)
        return [b for i, b in inflight.items() if i not in wanted]

    def _missed_ends(self, stream: StreamState, ended: int, lost: list[HeldBatch]) -> list[MissedEnd]:
        """Epochs after ``ended`` that ended meanwhile; lost batches of them move from ``lost`` to a resend."""
        # EPOCH_END's count: what batches_out was when the epoch ended (a retired epoch's, in its figures)
        ends = {n: s["batches_out"] for n, s in stream.finished.figures.items() if n > ended}
        ends.update((n, e.batches_out) for n, e in stream.epochs.items() if n > ended and e.end_sent)
        missed = []
        for number, batches in sorted(ends.items()):
            resend = sorted((b for b in lost if b.id[0] == number), key=lambda b: b.id)
            missed.append(MissedEnd(number, batches, resend))
        if missed:
            rank_lost = {b.id for m in missed for b in m.resend}
            lost[:] = [b for b in lost if b.id not in rank_lost]
        return missed

    # ---- leaving ----------------------------------------------------------------------------------------

    def leave(self, identity: bytes, why: str, keep: bool = True) -> None:
        """Forget a rank's connection.

        With ``keep`` (the connection was lost, not closed with BYE) and batches in flight to it, the rank is an
        orphan for ``rejoin_grace`` seconds: its batches wait for it to come back on a new connection (it may be
        alive behind a cut link) and go back to the front of their queues only when the grace runs out, so that a
        rank that lives never sees them trained by another. Otherwise they go back at once.
        """
        rank = self.books.ranks.pop(identity, None)
        if rank is None:
            return
        stream = self.books.streams[rank.stream]
        del stream.ranks[identity]
        if not stream.ranks:
            stream.complete = False
            stream.expected_ranks = 0            # the next job may have another size
        if keep and rank.session and rank.inflight and self.books.rejoin_grace > 0:
            stream.orphans[rank.session] = Orphan(rank, time.monotonic() + self.books.rejoin_grace)
            log.info("rank %d of stream %r %s; its %d unacknowledged batches wait %g s for it to rejoin",
                     rank.rank, stream.name, why, len(rank.inflight), self.books.rejoin_grace)
            return
        self.requeue(stream, rank)
        log.info("rank %d of stream %r %s (%d unacknowledged batches requeued)", rank.rank, stream.name, why,
                 len(rank.inflight))

    def expire_orphans(self, now: float) -> None:
        """Requeue the batches of ranks that did not come back within the grace: they are dead."""
        for stream in self.books.streams.values():
            for session, orphan in list(stream.orphans.items()):
                if orphan.deadline <= now:
                    del stream.orphans[session]
                    self.requeue(stream, orphan.rank)
                    log.info("rank %d of stream %r did not rejoin within %g s: %d batches requeued",
                             orphan.rank.rank, stream.name, self.books.rejoin_grace, len(orphan.rank.inflight))

    def requeue(self, stream: StreamState, rank: RankState) -> None:
        self.requeue_batches(stream, rank.inflight.values())
        self._reopen_if_abandoned(stream)

    def requeue_batches(self, stream: StreamState, batches: Iterable[HeldBatch]) -> None:
        """Batches in flight that will not be acknowledged go back to the front of their queues, in order. Of a pack
        the rank had used in part (ACK ``upto``), only the rest goes back: the used batches count as consumed."""
        for batch in sorted(batches, key=lambda b: b.id, reverse=True):
            ep = stream.epochs[batch.id[0]]
            if batch.used > batch.first:
                used, batch = cut(batch, batch.used)     # its used batches were counted acknowledged already
                used.settle()                    # the pack's last piece is the one going back: nothing to journal
                self.books.free(used.nbytes)
                ep.used_off(used)
            ep.requeue(batch)

    def _reopen_if_abandoned(self, stream: StreamState) -> None:
        # The consumers are all gone (a job died): epochs they had been told were over, but that still hold
        # unacknowledged batches, are delivered again to whoever joins next, remainder first.
        if not stream.ranks:
            for ep in stream.epochs.values():
                if ep.end_sent and ep.queue:
                    ep.end_sent = False
