"""The epoch's remainder (``wire.remainder``, ``broker.grants.share_remainder``): at an epoch's end the batches
left over (fewer than the ranks) are shared out by rows ("split", the default), padded with repeats ("pad") or
dropped ("drop"), and every rank takes the same number of steps.

The ledger is driven directly (as in test_ledger.py) by simulated ranks that behave as ``worker.grants`` does:
they hold what they receive, answer RELEASE by keeping, dropping and returning, and apply a batch's ``cut`` to its
rows. Each test asserts the exact multiset of row values the ranks trained and their steps.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from sparkbus.broker.books import Outcome
from sparkbus.broker.ledger import Ledger
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind
from sparkbus.wire.remainder import Piece, check_remainder, plan

from harness import STREAM, end, hello, join

pytestmark = pytest.mark.timeout(30)


# ---- the plan -------------------------------------------------------------------------------------------------

def test_split_gives_one_piece_a_rank_covering_every_row_once_the_largest_pieces_cut_first():
    pieces = plan([5, 3], 4, "split")
    assert pieces == [Piece(0, 0, 3), Piece(0, 3, 5), Piece(1, 0, 2), Piece(1, 2, 3)]
    assert plan([10], 3, "split") == [Piece(0, 0, 4), Piece(0, 4, 7), Piece(0, 7, 10)]
    for rows, ranks in [([1], 7), ([3, 1, 8], 5), ([100] * 6, 7), ([2], 128), ([64] * 127, 128)]:
        pieces = plan(rows, ranks, "split")
        assert len(pieces) == ranks
        covered = Counter((p.batch, r) for p in pieces for r in range(p.lo, p.hi))
        assert covered == Counter((b, r) for b, n in enumerate(rows) for r in range(n)), "every row once"


def test_with_fewer_rows_than_ranks_some_pieces_hold_no_row():
    pieces = plan([2], 4, "split")
    assert [p.hi - p.lo for p in pieces] == [1, 1, 0, 0]


def test_pad_gives_each_left_over_batch_whole_then_repeats_in_turn_and_drop_gives_nothing():
    assert plan([5, 3], 4, "pad") == [Piece(0, 0, 5), Piece(1, 0, 3), Piece(0, 0, 5, True), Piece(1, 0, 3, True)]
    assert plan([5, 3], 4, "drop") == [] and plan([], 4, "split") == []
    with pytest.raises(ProtocolError, match="fewer than the ranks"):
        plan([1, 1], 2, "split")
    with pytest.raises(ValueError, match="remainder must be one of 'split', 'drop', 'pad', got 'even'"):
        check_remainder("even")


def test_a_cut_is_checked_against_the_rows_of_the_one_batch_it_names():
    frames = codec.encode_batch(STREAM, 0, 0, 0, {"x": np.arange(6)}, splits=[2, 4])
    header = protocol.unpack_header(frames[0])
    assert protocol.row_cut(dict(header, take=[1, 2], cut=[1, 3])) == (1, 3)
    for bad in ({"cut": [0, 1]}, {"take": [1, 2], "cut": [3, 5]}, {"take": [1, 2], "cut": [2, 1]},
                {"take": [0, 1], "cut": [0, "1"]}):
        with pytest.raises(ProtocolError, match="cut must be"):
            protocol.row_cut(dict(header, **bad))
    assert protocol.unpack_cuts([0, 1, 0, 2, 5, 99]) == [(0, 1, 0, 2, 5, 99)]
    for bad in ([0, 1, 0, 2, 5], [0, 1, 0, 5, 5, 99], [0, "1", 0, 2, 5, 99]):
        with pytest.raises(ProtocolError):
            protocol.unpack_cuts(bad)


# ---- the broker, with simulated ranks ----------------------------------------------------------------------------

class Ranks:
    """Simulated ranks of one granted group, as ``worker.grants``: each takes a step per batch within its grant
    (STEPS), acknowledging a message once its batches are used; answers RELEASE by keeping, dropping and
    returning what it has not used. ``steps[identity]``: the row values of each step it took, in order."""

    def __init__(self, ledger: Ledger, size: int, remainder: str | None):
        self.ledger, self.size = ledger, size
        self.ids = [f"r{n}".encode() for n in range(size)]
        self.unused: dict[bytes, list[tuple[dict, list, int]]] = {i: [] for i in self.ids}   # (header, frames, index)
        self.left: dict[bytes, dict[tuple, int]] = {i: {} for i in self.ids}    # message -> batches not yet used
        self.steps: dict[bytes, list[list[int]]] = {i: [] for i in self.ids}
        self.granted = dict.fromkeys(self.ids, 0)
        self.dropped = dict.fromkeys(self.ids, 0)
        self.dropped_rows: list[int] = []
        self.headers: list[dict] = []
        self.ended: dict[bytes, int] = {}
        self.releases: list[tuple[bytes, dict]] = []
        extra = {} if remainder is None else {"remainder": remainder}
        for n, identity in enumerate(self.ids):
            join(ledger, identity, dict(hello(n, size, even=True, grants=True), **extra), prefetch=1000)

    def transmit(self, identity, frames):
        header = protocol.unpack_header(frames[0])
        if header["kind"] == Kind.BATCH:
            self.headers.append(header)
            first, stop = protocol.taken_range(header)
            self.unused[identity].extend((header, frames, i) for i in range(first, stop))
            self.left[identity][protocol.batch_id(header)] = stop - first
        elif header["kind"] == Kind.STEPS:
            self.granted[identity] = max(self.granted[identity], header["steps"])
        elif header["kind"] == Kind.RELEASE:
            self.releases.append((identity, header))
        elif header["kind"] == Kind.EPOCH_END:
            self.ended[identity] = header["steps"]
        return Outcome.SENT

    def run(self):
        """Dispatch, take steps within the grants, answer RELEASEs, until every rank has taken the epoch's steps."""
        for _ in range(100):
            self.ledger.dispatch(self.ledger.streams[STREAM], self.transmit)
            releases, self.releases = self.releases, []
            for identity, release in releases:
                self._release(identity, release)
            for identity in self.ids:
                self._take(identity, self.ended.get(identity, self.granted[identity]))
            if len(self.ended) == self.size and all(len(self.steps[i]) == self.ended[i] for i in self.ids):
                break
        assert len(self.ended) == self.size, "the epoch did not end"
        assert all(not self.unused[i] for i in self.ids), "a batch beyond the epoch's steps"

    def _take(self, identity, steps):
        ids: list[int] = []
        while len(self.steps[identity]) < steps and self.unused[identity]:
            header, frames, index = self.unused[identity].pop(0)
            self.steps[identity].append(_rows(header, frames, index))
            key = protocol.batch_id(header)
            self.left[identity][key] -= 1
            if not self.left[identity][key]:
                del self.left[identity][key]
                ids.extend(key)
        if ids:
            assert self.ledger.acknowledge(self.ledger.rank(identity), ids) == 0

    def _release(self, identity, release):
        used = len(self.steps[identity])
        keep_more = max(release["keep"] - used, 0)
        items = self.unused[identity]
        kept, dropped, back = items[:keep_more], items[keep_more:keep_more + release["drop"]], \
            items[keep_more + release["drop"]:]
        self.unused[identity] = kept
        self.dropped[identity] += len(dropped)
        self.dropped_rows.extend(v for h, f, i in dropped for v in _rows(h, f, i))
        ids: list[int] = []
        acks: list[int] = []
        firsts: dict[tuple, int] = {}
        for header, _, index in back:
            key = protocol.batch_id(header)
            firsts[key] = min(firsts.get(key, index), index)
        for key, first in firsts.items():
            ids.extend((*key, first))
        for header, _, _ in dropped + back:
            key = protocol.batch_id(header)
            self.left[identity][key] -= 1
            if not self.left[identity][key]:
                del self.left[identity][key]
                if key not in firsts:
                    acks.extend(key)            # a dropped message's last batch: acknowledged
        if acks:
            self.ledger.acknowledge(self.ledger.rank(identity), acks)
        self.ledger.give_back(self.ledger.rank(identity), {"stream": STREAM, "epoch": release["epoch"],
                                                            "ids": ids, "kept": release["keep"]})


def _rows(header, frames, index):
    """The row values of batch ``index`` of a message, its ``cut`` applied."""
    values = codec.decode_batch(header, frames[1:])["x"].tolist()
    splits = header.get("splits") or [header["rows"]]
    start = sum(splits[:index])
    rows = values[start:start + splits[index]]
    cut = protocol.row_cut(header)
    return rows[cut[0]:cut[1]] if cut is not None else rows


def _feed(ledger, partitions, rows_per_batch, splits=None):
    """One epoch: partition p holds batches of ``rows_per_batch[p]`` rows each (a list per partition), or one pack
    with ``splits``; row values are unique. Returns them all."""
    ledger.open_epoch(STREAM, 0, partitions, "stream")
    every = []
    for part in range(partitions):
        sizes = rows_per_batch[part]
        for seq, rows in enumerate(sizes):
            values = np.arange(rows, dtype="<i8") + 10_000 * part + 1000 * seq
            frames = codec.encode_batch(STREAM, 0, part, seq, {"x": values},
                                        splits=splits if splits is not None else None)
            ledger.accept_batch(protocol.unpack_header(frames[0]), frames)
            every.extend(values.tolist())
        end(ledger, 0, part, 0, len(sizes))
    ledger.close_epoch(STREAM, 0, partitions)
    return every


@pytest.mark.parametrize("size", [2, 3, 7])
def test_split_trains_every_row_once_in_equal_steps_the_last_one_smaller(size):
    ledger = Ledger()
    ranks = Ranks(ledger, size, "split")
    sizes = [[5, 4, 3], [6, 2], [7, 1, 1, 2]]              # 9 batches of 1 to 7 rows
    every = _feed(ledger, 3, sizes)
    ranks.run()
    steps = {len(s) for s in ranks.steps.values()}
    assert steps == {9 // size + (1 if 9 % size else 0)} and set(ranks.ended.values()) == steps, "equal steps"
    trained = Counter(v for s in ranks.steps.values() for step in s for v in step)
    assert trained == Counter(every), "every row once"
    figures = ledger.streams[STREAM].finished.figures[0] if 0 in ledger.streams[STREAM].finished else \
        ledger.streams[STREAM].epochs[0].stats()
    assert figures["dropped"] == 0 and figures["pieces"] == (size if 9 % size else 0)
    assert figures["cut"] == 9 % size and figures["repeated"] == 0
    assert sum(ranks.dropped.values()) == 0


@pytest.mark.parametrize("size", [2, 3, 7])
def test_drop_keeps_the_rule_of_before_and_a_rank_without_remainder_drops(size):
    for remainder in ("drop", None):       # None: a HELLO without the field (a version-6 rank) drops
        ledger = Ledger()
        ranks = Ranks(ledger, size, remainder)
        every = _feed(ledger, 3, [[5, 4, 3], [6, 2], [7, 1, 1, 2]])
        ranks.run()
        assert {len(s) for s in ranks.steps.values()} == {9 // size}
        trained = Counter(v for s in ranks.steps.values() for step in s for v in step)
        assert sum(ranks.dropped.values()) == 9 % size
        assert trained + Counter(ranks.dropped_rows) == Counter(every), "every row trained or dropped, once"
        assert len(ranks.dropped_rows) > 0 if 9 % size else not ranks.dropped_rows


@pytest.mark.parametrize("size", [2, 3, 7])
def test_pad_gives_every_rank_a_whole_batch_repeating_some_and_counts_the_repeats(size):
    ledger = Ledger()
    ranks = Ranks(ledger, size, "pad")
    every = _feed(ledger, 3, [[5, 4, 3], [6, 2], [7, 1, 1, 2]])
    ranks.run()
    left = 9 % size
    assert {len(s) for s in ranks.steps.values()} == {9 // size + (1 if left else 0)}
    trained = Counter(v for s in ranks.steps.values() for step in s for v in step)
    assert not Counter(every) - trained, "every row at least once"
    figures = ledger.streams[STREAM].epochs[0].stats() if 0 in ledger.streams[STREAM].epochs else \
        ledger.streams[STREAM].finished.figures[0]
    assert figures["repeated"] == (size - left if left else 0) and figures["dropped"] == 0


def test_a_pack_left_over_is_cut_into_its_batches_then_by_rows():
    ledger = Ledger()
    ranks = Ranks(ledger, 4, "split")
    ledger.open_epoch(STREAM, 0, 1, "stream")
    splits = [3, 3, 3, 3, 3]                           # one message of 5 batches: 4 ranks, one left over
    values = np.arange(15, dtype="<i8")
    frames = codec.encode_batch(STREAM, 0, 0, 0, {"x": values}, splits=splits)
    ledger.accept_batch(protocol.unpack_header(frames[0]), frames)
    end(ledger, 0, 0, 0, 1)
    ledger.close_epoch(STREAM, 0, 1)
    ranks.run()
    assert {len(s) for s in ranks.steps.values()} == {2}
    assert Counter(v for s in ranks.steps.values() for step in s for v in step) == Counter(range(15))
    last = sorted(len(s[-1]) for s in ranks.steps.values())
    assert last == [0, 1, 1, 1], "the batch left over, 3 rows for 4 ranks: one rank's last step has none"


def test_ranks_of_a_group_must_agree_on_the_remainder():
    ledger = Ledger()
    join(ledger, b"a", dict(hello(0, 2, even=True, grants=True), remainder="split"))
    with pytest.raises(ProtocolError, match="remainder='split'; a rank cannot join them with remainder='pad'"):
        ledger.join_rank(b"b", dict(hello(1, 2, even=True, grants=True), remainder="pad"))
    with pytest.raises(ProtocolError, match="remainder must be one of"):
        ledger.join_rank(b"c", dict(hello(1, 2, even=True, grants=True), remainder="evenly"))


def test_a_piece_header_names_its_rows_and_a_repeat_says_so():
    ledger = Ledger()
    ranks = Ranks(ledger, 3, "pad")
    _feed(ledger, 1, [[4, 4, 4, 4]])                   # 4 batches, 3 ranks: one left over, two repeats
    ranks.run()
    repeats = [h for h in ranks.headers if h.get("repeat")]
    assert len(repeats) == 2 and all(h["cut"] == [0, 4] for h in repeats)
    assert sum(1 for h in ranks.headers if "cut" in h) == 3
