"""Coordinated buckets across ranks (``feed(bucket_bounds=)``): the feeder's batches of one bucket each, the
``BATCH.bucket`` field on the wire, and the broker's rule (``broker.buckets``) that gives every rank one batch of
the same bucket for each step."""

from __future__ import annotations

from collections import deque

import msgpack
import numpy as np
import pyarrow as pa
import pytest

from sparkbus.broker.books import Books, Outcome
from sparkbus.broker.buckets import BucketGroups, find_group, take_out
from sparkbus.broker.ledger import Ledger
from sparkbus.broker.state import EpochState, HeldBatch, RankState, StreamState
from sparkbus.feeder.columns import partition_messages, row_lengths
from sparkbus.feeder.options import FeedOptions
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import STREAM, Wire, end, hello, join

pytestmark = pytest.mark.timeout(30)

BOUNDS = (16, 64)


def bucket_of(length: int, bounds=BOUNDS) -> int:
    return sum(length > b for b in bounds)


def documents(n: int, seed: int = 1) -> pa.RecordBatch:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 200, n)
    tokens = pa.array([list(range(k)) for k in lengths], pa.list_(pa.int32()))
    return pa.RecordBatch.from_arrays([pa.array(np.arange(n)), tokens], ["id", "tokens"])


def messages(data: pa.RecordBatch, **kw):
    options = dict(batch_size=16, max_bytes=1 << 24, pack_bytes=1 << 20, ragged=["tokens"], bucket_by="tokens",
                   bucket_window=4, seed=(0, 3), bucket_bounds=BOUNDS)
    options.update(kw)
    return list(partition_messages([data.slice(0, 300), data.slice(300)], **options))


def ids_of(columns) -> np.ndarray:
    """The ``id`` column of a message (its one values frame)."""
    return np.frombuffer(columns["id"].buffers[-1], dtype=np.int64)[:columns["id"].rows]


# ---- the feeder -----------------------------------------------------------------------------------------------

def test_each_batch_holds_one_buckets_rows_and_says_which_in_its_header():
    data = documents(1_000)
    lengths = row_lengths(data.column("tokens"))
    seen, short, below = [], 0, []
    for columns, splits in messages(data):
        assert splits is None, "a coordinated batch travels alone, never in a pack"
        header = protocol.unpack_header(codec.encode_batch("s", 0, 0, 0, columns)[0])
        bucket, batch_ids = header["bucket"], ids_of(columns)
        assert header["rows"] == len(batch_ids)
        buckets = {bucket_of(int(k)) for k in lengths[batch_ids]}
        assert max(buckets) == bucket, "no row longer than its bucket's bound"
        if len(buckets) > 1:
            below.append(bucket)
        seen.extend(batch_ids.tolist())
        short += len(batch_ids) < 16
    assert sorted(seen) == list(range(1_000)), "every row once"
    assert short <= 2, "a bucket's short end joins the next bucket's rows (not the last bucket's): two at most"
    assert len(below) == len(set(below)), "rows of a bucket below: in the one batch that took a short end"


def test_the_batches_are_a_function_of_the_partition_alone():
    data = documents(500, seed=2)
    first = [(c.bucket, ids_of(c).tolist()) for c, _ in messages(data)]
    again = [(c.bucket, ids_of(c).tolist()) for c, _ in messages(data)]
    assert first == again


def test_token_budgets_hold_within_a_bucket():
    data = documents(800, seed=3)
    for columns, _ in messages(data, batch_size=1_000, batch_tokens=512, tokens_by="tokens"):
        tokens = columns["tokens"]
        offsets = np.frombuffer(tokens.buffers[0], np.int32)
        assert offsets[-1] - offsets[0] <= 512 or len(offsets) == 2     # a longer row alone


def test_without_bounds_nothing_changes():
    data = documents(300)
    plain = messages(data, bucket_bounds=None)
    assert not any(hasattr(c, "bucket") for c, _ in plain)
    header = msgpack.unpackb(codec.encode_batch("s", 0, 0, 0, dict(plain[0][0]))[0])
    assert "bucket" not in header


@pytest.mark.parametrize("kw, says", [
    (dict(bucket_bounds=(64, 128)), "bucket_by"),
    (dict(bucket_by="tokens", bucket_bounds=()), "1 to 63"),
    (dict(bucket_by="tokens", bucket_bounds=tuple(range(1, 65))), "1 to 63"),
    (dict(bucket_by="tokens", bucket_bounds=(128, 64)), "rising"),
    (dict(bucket_by="tokens", bucket_bounds=(64, 64)), "rising"),
    (dict(bucket_by="tokens", bucket_bounds=(-1, 64)), "rising"),
    (dict(bucket_by="tokens", bucket_bounds=(True, 64)), "rising"),
    (dict(bucket_by="tokens", bucket_bounds=(1.5, 64)), "rising"),
    (dict(bucket_by="tokens", bucket_bounds="64"), "sequence"),
])
def test_bounds_are_checked_once_in_the_options(kw, says):
    with pytest.raises(ValueError, match=says):
        FeedOptions(address="tcp://127.0.0.1:5555", **kw)


def test_the_options_hand_the_bounds_to_the_tasks():
    options = FeedOptions(address="tcp://127.0.0.1:5555", bucket_by="tokens", bucket_bounds=[64, 128])
    assert options.bucket_bounds == (64, 128) and options.cutting()["bucket_bounds"] == (64, 128)


# ---- the wire -------------------------------------------------------------------------------------------------

def test_a_bucket_is_an_int_of_0_to_63_on_a_batch_alone():
    frames = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(4)}, bucket=63)
    header = protocol.unpack_header(frames[0])
    protocol.check_batch_frames(header, [len(f) for f in frames[1:]])
    for bad in (-1, protocol.MAX_BUCKETS, 1 << 40):
        frames = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(4)}, bucket=bad)
        with pytest.raises(ProtocolError, match="bucket"):
            protocol.check_batch_frames(protocol.unpack_header(frames[0]), [len(f) for f in frames[1:]])
    for bad in (True, "1", 1.0, None):
        frames = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(4)})
        header = msgpack.unpackb(frames[0])
        header["bucket"] = bad
        with pytest.raises(ProtocolError, match="bucket"):
            protocol.unpack_header(msgpack.packb(header))
    frames = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(4)}, splits=[2, 2], bucket=1)
    with pytest.raises(ProtocolError, match="pack"):
        protocol.check_batch_frames(protocol.unpack_header(frames[0]), [len(f) for f in frames[1:]])


def test_an_older_rank_gets_the_batch_without_its_bucket():
    frames = codec.encode_batch("s", 0, 0, 0, {"x": np.arange(4)}, bucket=2)
    older = protocol.unpack_header(protocol.reencode(frames[0], protocol.VERSION - 1))
    assert "bucket" not in older and older["v"] == protocol.VERSION - 1


# ---- the broker's rule ----------------------------------------------------------------------------------------

def held(seq: int, bucket: int | None, nbytes: int = 100) -> HeldBatch:
    return HeldBatch((0, 0, seq), [f"b{seq}".encode()], nbytes, 4, bucket=bucket)


class Ranks:
    """Two (or more) ranks of one stream, a transmit that records what each got, and the rule."""

    def __init__(self, n: int = 2, window: int = 4, buckets: list[int | None] | None = None, closed=False,
                 max_buffer: int | None = None):
        self.books = Books(max_buffer)
        self.stream = StreamState("s", expected_ranks=n, complete=True)
        self.books.streams["s"] = self.stream
        self.ep = EpochState(0, 1, closed=closed)
        self.stream.epochs[0] = self.ep
        for r in range(n):
            rank = RankState(f"r{r}".encode(), "s", r, n, window=window, window_stated=True)
            self.stream.ranks[rank.identity] = self.books.ranks[rank.identity] = rank
        for seq, bucket in enumerate(buckets or []):
            self.ep.queue.append(held(seq, bucket))
            self.books.keep(100)
        self.rule = BucketGroups(self.books)
        self.got: dict[bytes, list[HeldBatch]] = {r: [] for r in self.stream.ranks}
        self.full: set[bytes] = set()
        self.gone: set[bytes] = set()
        self.by_frames = {id(b.frames): b for b in self.ep.queue}

    def transmit(self, identity, frames):
        if identity in self.gone:
            return Outcome.GONE
        if identity in self.full:
            return Outcome.FULL
        self.got[identity].append(self.by_frames[id(frames)])
        return Outcome.SENT

    def send(self):
        return self.rule.send(self.stream, self.ep, self.transmit)

    def buckets(self, r: int) -> list[int | None]:
        return [b.bucket for b in self.got[f"r{r}".encode()]]

    def consume(self, r: int) -> None:
        rank = self.stream.ranks[f"r{r}".encode()]
        for batch in list(rank.inflight.values()):
            del rank.inflight[batch.id]


def test_find_group_reads_no_further_than_a_full_bucket():
    queue = deque(held(i, b) for i, b in enumerate([0, 1, 2, 1, 0, 2, 2]))
    assert find_group(queue, 2) == [1, 3]
    assert find_group(queue, 3) == [2, 5, 6]
    assert find_group(queue, 4) is None
    assert find_group(deque([held(0, None), held(1, 4), held(2, None), held(3, 4)]), 2) == [1, 3]
    take_out(queue, [2, 5, 6])
    assert [b.bucket for b in queue] == [0, 1, 1, 0]


def test_each_rank_gets_one_batch_of_the_same_bucket_for_each_step():
    ranks = Ranks(buckets=[0, 1, 2, 0, 2, 1, 1, 0, 0, 2])
    assert ranks.send() == []
    assert ranks.buckets(0) == ranks.buckets(1) == [0, 2, 1, 0]
    assert [b.bucket for b in ranks.ep.queue] == [1, 2], "what no group holds waits while the epoch is open"
    assert ranks.ep.batches_out == 8 and len(ranks.stream.ranks[b"r0"].inflight) == 4


def test_a_group_waits_for_room_in_every_window():
    ranks = Ranks(window=1, buckets=[0, 0, 1, 1])
    ranks.send()
    assert ranks.buckets(0) == ranks.buckets(1) == [0]
    ranks.consume(0)
    assert ranks.send() == [] and ranks.buckets(0) == [0], "rank 1's window is still full"
    ranks.consume(1)
    ranks.send()
    assert ranks.buckets(0) == ranks.buckets(1) == [0, 1]


def test_a_member_a_rank_did_not_take_is_owed_to_it_before_anything_else():
    ranks = Ranks(buckets=[0, 0, 1, 1, 2, 2])
    ranks.full.add(b"r1")
    ranks.send()
    assert ranks.buckets(0) == [0] and ranks.buckets(1) == []
    assert ranks.send() == [] and ranks.buckets(0) == [0], "no group forms while a member is owed"
    ranks.full.clear()
    ranks.send()
    assert ranks.buckets(1)[0] == 0, "the owed member first"
    ranks.send()
    assert ranks.buckets(0) == ranks.buckets(1) == [0, 1, 2]
    assert not ranks.ep.queue and not ranks.rule.owed


def test_an_owed_member_taken_from_the_queue_meanwhile_is_forgotten():
    ranks = Ranks(buckets=[0, 0, 1, 1])
    ranks.full.add(b"r1")
    ranks.send()
    ranks.ep.queue.clear()                      # e.g. a resume reset the epoch
    ranks.ep.queue.extend([held(7, 1), held(8, 1)])
    ranks.by_frames.update({id(b.frames): b for b in ranks.ep.queue})
    ranks.full.clear()
    assert ranks.send() == [] and not ranks.rule.owed and ranks.buckets(1) == []
    ranks.send()
    assert ranks.buckets(0) == [0, 1] and ranks.buckets(1) == [1]


def test_a_rank_found_gone_gives_its_member_back_to_the_queue():
    ranks = Ranks(buckets=[0, 0, 1])
    ranks.gone.add(b"r1")
    assert ranks.send() == [b"r1"]
    assert ranks.buckets(0) == [0] and sorted(b.bucket for b in ranks.ep.queue) == [0, 1]


def test_a_closed_epoch_sends_what_no_bucket_can_fill_the_normal_way_sorted_by_bucket():
    ranks = Ranks(buckets=[2, 0, 1, 2, 0, 3], closed=True)
    assert ranks.send() is None
    assert ranks.buckets(0) == ranks.buckets(1) == [2, 0]
    assert [b.bucket for b in ranks.ep.queue] == [1, 3], "the tail, sorted: neighbours share the last steps"


def test_an_epoch_without_buckets_or_being_evened_out_goes_the_normal_way():
    assert Ranks(buckets=[None, None, None]).send() is None
    ranks = Ranks(buckets=[0, 0])
    ranks.ep.share = 3
    assert ranks.send() is None and ranks.buckets(0) == []


def test_independent_consumers_take_batches_as_they_come():
    ranks = Ranks(buckets=[0, 1, 0, 1])
    ranks.stream.expected_ranks = 1             # each rank 0 of 1
    assert ranks.send() is None


def test_a_full_buffer_with_no_group_lets_the_queue_go_the_normal_way():
    ranks = Ranks(buckets=[0, 1, 2], max_buffer=300)
    assert ranks.books.feed_full()
    assert ranks.send() is None
    roomy = Ranks(buckets=[0, 1, 2], max_buffer=10_000)
    assert roomy.send() == []


# ---- the broker, as the daemon drives it (a ledger, real batch frames) -------------------------------------

def push_bucketed(ledger, part, seq, bucket, journalled=False):
    frames = codec.encode_batch(STREAM, 0, part, seq, {"x": np.arange(2) + 10 * seq}, bucket=bucket)
    return ledger.accept_batch(protocol.unpack_header(frames[0]), frames, frames[0] if journalled else None)


def feed_bucketed(ledger, buckets, journalled=False):
    ledger.open_epoch(STREAM, 0, 1, "stream")
    for seq, bucket in enumerate(buckets):
        push_bucketed(ledger, 0, seq, bucket, journalled)
    end(ledger, 0, 0, 0, len(buckets))
    assert ledger.close_epoch(STREAM, 0, 1) == []


def buckets_to(wire, identity):
    return [h.get("bucket") for h in wire.of_kind(identity, Kind.BATCH)]


def test_the_broker_groups_by_the_header_and_evens_the_tail_out_as_any_epoch():
    ledger = Ledger()
    wire = Wire(ledger)
    join(ledger, b"a", hello(0, 2, even=True, grants=True), prefetch=8)
    join(ledger, b"b", hello(1, 2, even=True, grants=True), prefetch=8)
    feed_bucketed(ledger, [0, 1, 2, 0, 1, 2, 2, 0, 1])
    assert [b.bucket for b in ledger.streams[STREAM].epochs[0].queue][:3] == [0, 1, 2]
    wire.dispatch()
    assert buckets_to(wire, b"a")[:3] == buckets_to(wire, b"b")[:3] == [0, 1, 2]
    # the tail (one batch of each bucket) went the normal way, sorted; the left-over one is dropped (remainder drop)
    assert sorted(buckets_to(wire, b"a")[3:] + buckets_to(wire, b"b")[3:]) == [0, 1, 2]
    [release] = wire.of_kind(b"a" if len(wire.to(b"a")) == 5 else b"b", Kind.RELEASE)
    assert (release["keep"], release["drop"]) == (4, 1)


def test_a_restarted_broker_groups_the_batches_it_replays(tmp_path, journals, restart):
    live = Ledger(journals(tmp_path))
    feed_bucketed(live, [2, 0, 2, 0], journalled=True)
    replayed = restart(tmp_path)
    assert [b.bucket for b in replayed.streams[STREAM].epochs[0].queue] == [2, 0, 2, 0]


