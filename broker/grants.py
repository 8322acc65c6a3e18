"""The ledger's rules for equal steps granted by the broker: STEPS as batches go out, and the epoch's end evened out.

A stream whose ranks join with ``grants`` (HELLO) keeps its ranks' steps equal without any collective among them:

- **Grants.** The broker counts, per rank number, the batches of the delivering epoch that rank has in hand
  (``RankState.given``: sent to it, or named by it when it rejoined; a pack counts each of its batches). The
  smallest count is a number of steps every rank can take, since each has that many batches: received, or on
  their way ahead of the ``STEPS`` on the same connection. ``STEPS`` (cumulative per epoch) goes out whenever it
  grows. Counting each batch where it is, the counts add up to at most the epoch's batches, so a grant never
  exceeds the final share.
- **The epoch's end.** Once the epoch is closed, nothing is queued and no lost rank holds its batches, the share
  is ``total // size``. A rank with more is told (``RELEASE``) to keep the share, drop what is left over (at most
  ``size - 1`` batches in all, counted) and return the rest, which it has not used: a grant never exceeded the
  share. Its ``RETURN`` puts them back at the front of the queue, a pack's unused tail as a piece of it (the
  same frames, with ``take`` in its header); they go only to ranks short of the share, cut to what each needs.
  When every rank has the share, ``EPOCH_END`` says ``steps``: the share.
- **The remainder.** What the ranks agreed in HELLO (``remainder``, ``wire.remainder``): with ``"drop"`` the
  RELEASE drops what is left over, as above. With ``"split"`` or ``"pad"`` nothing is dropped: the ranks with more
  return everything beyond the share, and once every rank has the share, the batches left in the queue (fewer than
  the ranks) are cut into one piece per rank (rows, or repeats), and the share grows by one
  (:meth:`Grants.share_remainder`).

A rank that joins, leaves or comes back while an epoch is evened out starts the evening over, from the counts as
they are then. See docs/PROTOCOL.md, "Granted steps", and docs/GUARANTEES.md.
"""

from __future__ import annotations

import logging

from sparkbus.broker.books import Books, Outcome, RankGone, Transmit
from sparkbus.broker.matching import Matching
from sparkbus.broker.pieces import RowRange, batch_rows, cut, cut_rows, singles
from sparkbus.broker.rejoin import Rejoin
from sparkbus.broker.state import EpochState, HeldBatch, RankState, StreamState
from sparkbus.wire import protocol, remainder
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind
from sparkbus.wire.requests import HelloHeader, ReturnHeader

log = logging.getLogger("sparkbus.broker")


def midway(stream: StreamState, ep: EpochState) -> bool:
    """Whether ``ep`` is in the middle of being consumed: some of it in the ranks' hands, and some consumed (given out
    and no longer in flight, or the used batches of a pack still in flight)."""
    if not ep.in_flight:
        return False
    return ep.batches_out > ep.in_flight or any(
        b.used > b.first for r in stream.members() for i, b in r.inflight.items() if i[0] == ep.epoch)


class Grants:
    """STEPS, RELEASE and RETURN: equal steps for a stream's ranks, granted by the broker.

    Args:
        books: the ledger's state.
        rejoin: the rules of ranks that leave (a group of another size lets the old one's lost ranks go).
        matching: what ranks used of a lost broker, counted as theirs before it is matched (:meth:`counts`).
        gone: the ledger's "a rank is gone".
    """

    def __init__(self, books: Books, rejoin: Rejoin, matching: Matching, gone: RankGone):
        self.books = books
        self.rejoin = rejoin
        self.matching = matching
        self.gone = gone

    # ---- joining and leaving: a group that changes starts an evening over ----------------------------------

    def admit(self, identity: bytes, h: HelloHeader) -> None:
        """Before a rank joins (:meth:`Rejoin.join`): a rank with ``grants`` may also start a group of another size,
        at an epoch boundary only (nothing of the delivering epoch consumed yet): the ranks of the old group are
        let go.

        Raises:
            ProtocolError: a group that mixes granted and agreed steps, or remainders; another size mid-epoch.
        """
        grants = bool(h.get("grants", False))
        rest = h.get("remainder", "drop")
        if rest not in protocol.REMAINDERS:
            raise ProtocolError(f"remainder must be one of {', '.join(protocol.REMAINDERS)}, got {rest!r:.40}")
        stream = self.books.stream(h["stream"])
        others = [r for r in stream.ranks.values() if r.identity != identity]
        if any(r.grants != grants for r in others):
            raise ProtocolError(f"the ranks of stream {stream.name!r} take "
                                f"{'granted' if not grants else 'agreed'} steps; a rank cannot join them with "
                                f"{'granted' if grants else 'agreed'} steps")
        if grants and any(r.remainder != rest and r.size == h["size"] for r in others):
            theirs = next(r.remainder for r in others if r.size == h["size"])
            raise ProtocolError(f"the ranks of stream {stream.name!r} share an epoch's remainder with "
                                f"remainder={theirs!r}; a rank cannot join them with remainder={rest!r} (every rank "
                                f"of a group must pass the same BatchStream(remainder=))")
        if grants and h["size"] != stream.group_size and stream.group_size:
            ep = stream.delivering()
            resumes = h.get("resumes")       # a rank resuming this epoch from its group's checkpoint: its feed
            if ep is not None and midway(stream, ep) and resumes != ep.epoch:     # a resume resets the epoch
                raise ProtocolError(
                    f"stream {stream.name!r} is in the middle of epoch {ep.epoch} ({ep.acked} batches consumed by "
                    f"a group of {stream.group_size} ranks): a group of {h['size']} ranks can join it only at an "
                    f"epoch boundary, or resuming it from a checkpoint (BatchStream(resume=[every rank's "
                    f"state])). Restart with {stream.group_size} ranks, or feed a new stream")
            for old in others:
                log.info("rank %d/%d of stream %r gives way to a group of %d ranks", old.rank, old.size,
                         stream.name, h["size"])
                self.gone(old.identity, "was replaced by a group of another size", keep=False)
            for session in list(stream.orphans):
                self.rejoin.requeue(stream, stream.orphans.pop(session).rank)

    def joined(self, identity: bytes, h: HelloHeader) -> None:
        """After a rank joined (:meth:`Rejoin.join`): its grants and remainder, its own count of a resumed epoch;
        every evening out of the stream starts over."""
        stream = self.books.streams[h["stream"]]
        rank = self.books.ranks[identity]
        grants = bool(h.get("grants", False))
        rest = h.get("remainder", "drop")
        rank.grants = grants
        rank.remainder = rest
        got = h.get("got")
        current = stream.epochs.get(h["ended"] + 1)
        if h["resume"] and got is not None and current is not None and not current.end_sent:
            rank.given[current.epoch] = got           # its own count: what it had of the epoch, wherever it went
        stream.group_size = rank.size
        self.start_over(stream)
        if not h["resume"]:
            # A new process (a restarted rank, or a new job): what was granted and dropped was the old group's.
            # Steps start again from the counts of the ranks there are now.
            for ep in stream.epochs.values():
                if not ep.end_sent:
                    ep.steps = 0
                    ep.dropped.clear()

    def start_over(self, stream: StreamState) -> None:
        """The group changed (a rank joined, left or came back): every evening out of ``stream`` starts over."""
        for ep in stream.epochs.values():
            if ep.share is not None and not ep.end_sent:
                ep.share = None
                ep.cut_done = False
                ep.returns_due.clear()
                for number, (drop, _) in ep.owed.items():      # never told: those batches are not dropped
                    ep.dropped[number] -= drop
                ep.owed.clear()

    # ---- grants -------------------------------------------------------------------------------------------

    def counts(self, stream: StreamState, ep: EpochState,
               pending: list[tuple[RankState, int]] | None = None) -> list[int]:
        """Per rank number, the batches of ``ep`` it has in hand for steps (those it drops to even out left out,
        those it used of a lost broker in: ``pending``, :meth:`Matching.pending` unless given)."""
        counts = stream.counts(ep.epoch)
        for number, dropped in ep.dropped.items():
            if number < len(counts):
                counts[number] -= dropped
        for rank, left in self.matching.pending(stream, ep) if pending is None else pending:
            if rank.rank < len(counts):
                counts[rank.rank] += left
        return counts

    def grant(self, stream: StreamState, ep: EpochState, transmit: Transmit) -> None:
        """Tell every rank the steps it may take in ``ep`` when that grew: the smallest count (the share, at most)."""
        pending = self.matching.pending(stream, ep)
        counts = self.counts(stream, ep, pending)
        if counts:
            steps = min(counts) if ep.share is None else min(min(counts), ep.share)
            ep.steps = max(ep.steps, steps)
        if not ep.steps:
            return
        header: bytes | None = None
        gone = []
        still_to_adopt: dict[bytes, int] = {}
        for owner, left in pending:
            still_to_adopt[owner.identity] = still_to_adopt.get(owner.identity, 0) + left
        for rank in stream.ranks.values():
            adopted = rank.adopted.get(ep.epoch, 0) + still_to_adopt.get(rank.identity, 0)
            if rank.told.get(ep.epoch, 0) >= ep.steps and rank.told_adopted.get(ep.epoch, 0) >= adopted:
                continue
            if adopted:        # batches it used of a lost broker, matched here (broker.recovery): its own STEPS
                message = protocol.pack_header(Kind.STEPS, stream=stream.name, epoch=ep.epoch, steps=ep.steps,
                                               adopted=adopted)
            else:
                message = header = header or protocol.pack_header(Kind.STEPS, stream=stream.name, epoch=ep.epoch,
                                                                  steps=ep.steps)
            outcome = transmit(rank.identity, [message])
            if outcome is Outcome.SENT:
                rank.told[ep.epoch] = ep.steps
                rank.told_adopted[ep.epoch] = adopted
            elif outcome is Outcome.GONE:
                gone.append(rank.identity)
        for identity in gone:
            self.gone(identity, "disconnected")

    def may_take(self, ep: EpochState, rank: RankState, batch: HeldBatch) -> int:
        """How many of ``batch``'s batches may go to ``rank`` now: all of them, unless ``ep`` is being evened out;
        then what the rank is short of the share (0: none; and none of a piece of a pack it holds a piece of)."""
        if ep.share is None:
            return batch.count
        if batch.id in rank.inflight:
            return 0
        have = rank.given.get(ep.epoch, 0) - ep.dropped.get(rank.rank, 0)
        return max(ep.share - have, 0)

    # ---- the epoch's end ----------------------------------------------------------------------------------

    def evened(self, stream: StreamState, ep: EpochState, transmit: Transmit) -> bool:
        """Whether the closed, fully sent epoch ``ep`` may end: every rank has the share. Until then, start the
        evening out (RELEASE to the ranks with more) or wait for it (their RETURN, the pieces to the ranks short).
        An epoch waits while a lost rank holds its batches, or a rank number of the group is not connected."""
        if len(stream.ranks) < stream.expected_ranks:
            return False
        if any(b.id[0] == ep.epoch for o in stream.orphans.values() for b in o.rank.inflight.values()):
            return False
        if not ep.owed and not ep.returns_due:
            counts = self.counts(stream, ep)
            ep.share = share = sum(counts) // len(counts)
            if all(c == share for c in counts):
                return True
            left_over = sum(counts) - share * len(counts)
            if self._remainder(stream) != "drop":
                left_over = 0             # returned, then shared out by share_remainder: nothing dropped
            for number, count in enumerate(counts):
                if count > share:
                    drop = min(count - share, left_over)
                    left_over -= drop
                    ep.dropped[number] = ep.dropped.get(number, 0) + drop
                    ep.owed[number] = (drop, count - share - drop)
            log.info("stream %r epoch %d: evening out to %d steps a rank; %d ranks return batches", stream.name,
                     ep.epoch, share, sum(1 for _, back in ep.owed.values() if back))
        by_number = {r.rank: r for r in stream.ranks.values()}
        for number, (drop, back) in list(ep.owed.items()):
            rank = by_number[number]
            header = protocol.pack_header(Kind.RELEASE, stream=stream.name, epoch=ep.epoch, keep=ep.share, drop=drop)
            outcome = transmit(rank.identity, [header])
            if outcome is Outcome.GONE:
                self.gone(rank.identity, "disconnected")       # the evening starts over
                return False
            if outcome is not Outcome.SENT:
                return False              # its queue is full: the rest of the RELEASEs go on a later pass
            del ep.owed[number]
            if back:
                ep.returns_due.add(number)
        if ep.returns_due:
            return False
        return all(c == ep.share for c in self.counts(stream, ep))

    def _remainder(self, stream: StreamState) -> str:
        return next((r.remainder for r in stream.ranks.values()), "drop")

    def share_remainder(self, stream: StreamState, ep: EpochState) -> bool:
        """Once every rank has the share of the closed epoch ``ep``, cut what is left in the queue (fewer batches
        than ranks, returned by the ranks that had more) into one piece per rank (``wire.remainder.plan``), and
        grow the share by one: each rank takes one more step, a piece. Whether it cut (the queue is to be sent).
        Never with ``"drop"`` (RELEASE dropped the left-over), nor while a rank is missing or returns batches."""
        if (ep.share is None or ep.cut_done or not ep.queue or not ep.closed or ep.owed or ep.returns_due
                or (ep.recovery is not None and ep.recovery.held)):
            return False
        rest = self._remainder(stream)
        if rest == "drop" or len(stream.ranks) < stream.expected_ranks:
            return False
        counts = self.counts(stream, ep)
        if not counts or any(c != ep.share for c in counts) or sum(b.count for b in ep.queue) >= len(counts):
            return False
        left = [single for batch in ep.queue for single in singles(batch)]
        pieces = remainder.plan([hi - lo for lo, hi in map(batch_rows, left)], len(counts), rest)
        ranges: dict[int, list[RowRange]] = {}
        for piece in pieces:
            ranges.setdefault(piece.batch, []).append(RowRange(piece.lo, piece.hi, piece.repeat))
        ep.queue.clear()
        for index, single in enumerate(left):
            ep.queue.extend(cut_rows(single, ranges[index]))
        ep.cut += len(left) if rest == "split" else 0
        ep.pieces += len(pieces)
        ep.repeated += sum(p.repeat for p in pieces)
        ep.share += 1
        ep.cut_done = True
        log.info("stream %r epoch %d: %d batches left over go out as %d pieces (remainder %r): %d steps a rank",
                 stream.name, ep.epoch, len(left), len(pieces), rest, ep.share)
        return True

    def give_back(self, rank: RankState, h: ReturnHeader) -> int:
        """RETURN: batches (or the unused tail of a pack, from its batch ``first`` on) that ``rank`` gives back to
        even the epoch out. They go to the front of the queue. Returns how many named were not in flight to it.

        Raises:
            ProtocolError: ids that are not whole ``(epoch, part, seq, first)`` quadruples of integers.
        """
        ids = h["ids"]
        if len(ids) % 4 or not all(type(i) is int for i in ids):
            raise ProtocolError(f"RETURN ids must be (epoch, part, seq, first) quadruples of integers, got "
                                f"{len(ids)} values")
        stream = self.books.streams[rank.stream]
        unknown = 0
        back: list[HeldBatch] = []
        values = iter(ids)
        for epoch, part, seq, first in zip(values, values, values, values):
            piece = rank.inflight.get((epoch, part, seq))
            if piece is None or first >= piece.first + piece.count or epoch not in stream.epochs:
                unknown += 1
                continue
            if first <= piece.first:
                rank.take_back(piece)
                back.append(piece)
                continue
            kept, tail = cut(piece, first)
            rank.take_back(piece)
            rank.hold(kept)
            back.append(tail)
        for piece in sorted(back, key=lambda b: (b.id, b.first), reverse=True):
            into = stream.epochs[piece.id[0]]
            piece.sends = 0                           # given to another rank to even out: not a redelivery
            into.requeue(piece)
            into.moved += piece.count
        ep = stream.epochs.get(h["epoch"])
        if ep is not None:
            ep.returns_due.discard(rank.rank)
            extra = (rank.given.get(ep.epoch, 0) - ep.dropped.get(rank.rank, 0) - ep.share
                     if ep.share is not None else 0)
            if extra > 0:
                # It kept more than the share: it had used more (its group changed in the middle of the epoch), or
                # it was leaving the epoch. What it keeps beyond the share counts as dropped, so the evening ends.
                ep.dropped[rank.rank] = ep.dropped.get(rank.rank, 0) + extra
                log.warning("rank %d of stream %r kept %d batches of epoch %d, %d above the share of %d: its steps "
                            "are not the others' (its group changed in the middle of the epoch, or it left the "
                            "epoch early)", rank.rank, stream.name, h["kept"], ep.epoch, extra, ep.share)
        return unknown
