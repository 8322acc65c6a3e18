"""The broker's rules, without sockets: `Ledger` driven directly with fake frames, identities and callbacks.

Batches are real frames from `codec.encode_batch` (the ledger reads only the header and the frame lengths);
`Wire` (tests/harness/ledger.py) stands in for the daemon's sends and records what went to which rank.
"""

from __future__ import annotations

import logging

import pytest

from sparkbus.broker.ledger import MAX_WINDOW_BYTES, Ledger, Rejected
from sparkbus.broker.state import MAX_WINDOW, EpochState
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import STREAM, Wire, ack, batch_frames, end, feed, hello, join, nbytes, push, window


def dispatched(batches, ranks=(b"a", b"b"), prefetch=1):
    """A ledger with epoch 0 of ``batches`` batches in one partition, dispatched once to independent ``ranks`` that
    each stated a window of ``prefetch`` batches; returns it and the :class:`Wire` it sent on."""
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, batches)
    for name in ranks:
        join(ledger, name, hello(), prefetch=prefetch)
    wire.dispatch()
    return ledger, wire


def held_bytes_in(ledger):
    """Bytes of every batch the ledger holds: queued, in flight at a rank (or at one lost and awaited), or held for
    an atomic commit."""
    total = 0
    for stream in ledger.streams.values():
        for ep in stream.epochs.values():
            total += sum(b.nbytes for b in ep.queue)
            total += sum(b.nbytes for p in ep.parts.values() for held in p.held.values() for b in held)
        total += sum(b.nbytes for o in stream.orphans.values() for b in o.rank.inflight.values())
    total += sum(b.nbytes for r in ledger.ranks.values() for b in r.inflight.values())
    return total


def assert_bytes_accounted(ledger):
    """``buffered``, ``held_bytes`` and each rank's ``inflight_bytes`` are the bytes of the batches they stand for."""
    assert ledger.buffered == held_bytes_in(ledger)
    assert ledger.held_bytes == sum(b.nbytes for s in ledger.streams.values() for e in s.epochs.values()
                                    for p in e.parts.values() for h in p.held.values() for b in h)
    ranks = list(ledger.ranks.values()) + [o.rank for s in ledger.streams.values() for o in s.orphans.values()]
    for rank in ranks:
        assert rank.inflight_bytes == sum(b.nbytes for b in rank.inflight.values()), f"rank {rank.rank}"


# ---- opening and closing epochs ------------------------------------------------------------------------------


def test_opening_an_open_epoch_again_with_the_same_terms_is_accepted_and_with_others_refused():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 3, "stream")
    ledger.open_epoch(STREAM, 0, 3, "stream")       # a driver retrying its request
    assert list(ledger.streams[STREAM].epochs) == [0]
    with pytest.raises(ProtocolError, match="already open with 3 partitions and stream delivery"):
        ledger.open_epoch(STREAM, 0, 4, "stream")
    with pytest.raises(ProtocolError, match="already open"):
        ledger.open_epoch(STREAM, 0, 3, "atomic")


@pytest.mark.parametrize("number, partitions, delivery, stream, message", [
    (-1, 1, "stream", STREAM, "out of range"),
    (0, -1, "stream", STREAM, "out of range"),
    (0, 10_000_001, "stream", STREAM, "out of range"),
    (0, 1, "eventually", STREAM, "is not one of stream, atomic"),
    (0, 1, "stream", "", "1 to 256 characters"),
    (0, 1, "stream", "x" * 257, "1 to 256 characters"),
])
def test_open_refuses_numbers_out_of_range_unknown_delivery_and_bad_stream_names(number, partitions, delivery,
                                                                                 stream, message):
    ledger = Ledger()
    with pytest.raises(ProtocolError, match=message):
        ledger.open_epoch(stream, number, partitions, delivery)
    assert not any(s.epochs for s in ledger.streams.values())


def test_close_is_refused_until_every_partition_committed_and_names_the_missing_ones():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 3, "stream")
    push(ledger, 0, 1, 0)
    end(ledger, 0, 1, 0, 1)
    with pytest.raises(ProtocolError, match=r"1 of 3 partitions committed \(missing \[0, 2\]\)"):
        ledger.close_epoch(STREAM, 0, 3)
    end(ledger, 0, 0, 0, 0)
    end(ledger, 0, 2, 0, 0)
    with pytest.raises(ProtocolError, match="3 of 3 partitions committed"):
        ledger.close_epoch(STREAM, 0, 2)             # the driver's count must match the opened one
    assert ledger.close_epoch(STREAM, 0, 3) == []
    with pytest.raises(ProtocolError, match="is not open"):
        ledger.close_epoch(STREAM, 0, 3)
    with pytest.raises(ProtocolError, match="is not open"):
        ledger.close_epoch(STREAM, 9, 3)


def test_an_epoch_with_no_partitions_opens_closes_and_ends_at_once():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.join_rank(b"r0", hello())
    ledger.open_epoch(STREAM, 0, 0, "stream")
    assert ledger.close_epoch(STREAM, 0, 0) == []
    wire.dispatch()
    assert wire.ends == [(b"r0", 0)]
    assert 0 in ledger.streams[STREAM].finished


def test_a_delivered_epoch_cannot_be_opened_again_and_its_late_batches_are_counted_apart():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.join_rank(b"r0", hello(rank=0, size=2, even=True))
    ledger.join_rank(b"r1", hello(rank=1, size=2, even=True))
    window(ledger, b"r0", 1)
    feed(ledger, 0, 1, 1)
    wire.dispatch()                                  # even ranks: ended once sent, not yet acknowledged
    assert ledger.streams[STREAM].epochs[0].end_sent
    with pytest.raises(ProtocolError, match="already delivered epoch 0"):
        ledger.open_epoch(STREAM, 0, 1, "stream")
    ack(ledger, b"r0", [(0, 0, 0)])                  # acknowledged: retired
    assert 0 in ledger.streams[STREAM].finished
    with pytest.raises(ProtocolError, match="already delivered epoch 0"):
        ledger.open_epoch(STREAM, 0, 1, "stream")
    with pytest.raises(Rejected) as late:
        push(ledger, 0, 0, 0, attempt=1)
    assert late.value.reason == "late_duplicate"


def test_batches_of_an_unknown_epoch_or_out_of_range_numbers_are_rejected_with_their_reason():
    ledger = Ledger()
    with pytest.raises(Rejected) as unknown:
        push(ledger, 0, 0, 0)
    assert unknown.value.reason == "unknown_epoch"
    ledger.open_epoch(STREAM, 0, 2, "stream")
    for part, seq, attempt in [(2, 0, 0), (-1, 0, 0), (0, -1, 0), (0, 0, -1)]:
        with pytest.raises(Rejected) as bad:
            push(ledger, 0, part, seq, attempt)
        assert bad.value.reason == "out_of_range"
    with pytest.raises(Rejected) as other_stream:
        push(ledger, 0, 0, 0, stream="t")
    assert other_stream.value.reason == "unknown_epoch"
    assert ledger.buffered == 0 and not ledger.streams[STREAM].epochs[0].queue


# ---- stream and atomic delivery ------------------------------------------------------------------------------


def test_stream_delivery_queues_each_first_copy_at_once_and_drops_later_copies():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, attempt=0)
    push(ledger, 0, 0, 1, attempt=0)
    ep = ledger.streams[STREAM].epochs[0]
    assert [b.id for b in ep.queue] == [(0, 0, 0), (0, 0, 1)]           # before any commit
    push(ledger, 0, 0, 0, attempt=1)                                     # a retry's copy: dropped
    push(ledger, 0, 0, 1, attempt=1)
    push(ledger, 0, 0, 2, attempt=1)                                     # a seq nobody sent yet: kept
    assert [b.id for b in ep.queue] == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    assert [protocol.unpack_header(b.frames[0])["attempt"] for b in ep.queue] == [0, 0, 1]
    assert ep.duplicates == 2 and ep.batches_in == 3 and ep.rows_in == 6
    assert ledger.buffered == sum(nbytes(0, 0, s) for s in range(3)) and ledger.held_bytes == 0
    assert end(ledger, 0, 0, 1, 3)[0].kind == Kind.PARTITION_COMMITTED
    assert ledger.close_epoch(STREAM, 0, 1) == []


def test_the_same_attempt_sending_a_seq_twice_is_refused_as_replayed():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, attempt=3)
    with pytest.raises(Rejected) as replayed:
        push(ledger, 0, 0, 0, attempt=3)
    assert replayed.value.reason == "replayed"
    ep = ledger.streams[STREAM].epochs[0]
    assert len(ep.queue) == 1 and ep.duplicates == 0
    assert ledger.buffered == nbytes(0, 0, 0)


def test_atomic_delivery_holds_each_attempt_apart_until_one_commits_and_drops_the_others():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "atomic")
    ep = ledger.streams[STREAM].epochs[0]
    push(ledger, 0, 0, 1, attempt=0)
    push(ledger, 0, 0, 0, attempt=0)
    push(ledger, 0, 0, 0, attempt=1)
    both = nbytes(0, 0, 0) * 2 + nbytes(0, 0, 1)
    assert not ep.queue and ledger.buffered == ledger.held_bytes == both
    replies = end(ledger, 0, 0, 0, 2)
    assert [r.kind for r in replies] == [Kind.PARTITION_COMMITTED]
    assert [b.id for b in ep.queue] == [(0, 0, 0), (0, 0, 1)]           # released in seq order
    assert {protocol.unpack_header(b.frames[0])["attempt"] for b in ep.queue} == {0}
    assert ledger.held_bytes == 0 and ledger.buffered == nbytes(0, 0, 0) + nbytes(0, 0, 1)
    push(ledger, 0, 0, 1, attempt=1)                                     # after the commit: a duplicate
    assert ledger.buffered == nbytes(0, 0, 0) + nbytes(0, 0, 1) and ep.duplicates == 1
    assert ep.batches_in == 2


def test_a_later_copy_with_another_checksum_marks_the_partition_diverged_in_stream_delivery():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 2, "stream")
    push(ledger, 0, 1, 0, attempt=0)
    push(ledger, 0, 1, 0, attempt=1, salt=7)         # Spark recomputed partition 1 in another order
    end(ledger, 0, 1, 1, 1)
    end(ledger, 0, 0, 0, 0)
    assert ledger.close_epoch(STREAM, 0, 2) == [1]
    assert len(ledger.streams[STREAM].epochs[0].queue) == 1


def test_a_committing_attempt_with_other_seqs_than_those_forwarded_marks_the_partition_diverged():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 3, "stream")
    for seq in range(3):
        push(ledger, 0, 0, seq, attempt=0)           # the first attempt had three batches, then failed
    push(ledger, 0, 0, 0, attempt=1)
    push(ledger, 0, 0, 1, attempt=1)
    end(ledger, 0, 0, 1, 2)                          # the retry has two: seq 2 was forwarded for nothing
    push(ledger, 0, 1, 0, attempt=0)
    end(ledger, 0, 1, 0, 1)
    push(ledger, 0, 1, 1, attempt=1)                 # a seq the committed attempt never sent, after the commit
    end(ledger, 0, 2, 0, 0)
    assert ledger.close_epoch(STREAM, 0, 3) == [0, 1]
    ep = ledger.streams[STREAM].epochs[0]
    assert (0, 1, 1) not in [b.id for b in ep.queue]


def test_atomic_delivery_reports_divergence_but_forwards_only_the_committed_attempts_batches():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "atomic")
    push(ledger, 0, 0, 0, attempt=0)
    push(ledger, 0, 0, 0, attempt=1, salt=5)
    push(ledger, 0, 0, 1, attempt=1, salt=5)
    end(ledger, 0, 0, 1, 2)
    assert ledger.close_epoch(STREAM, 0, 1) == [0]
    queued = ledger.streams[STREAM].epochs[0].queue
    expected = [batch_frames(0, 0, s, attempt=1, salt=5) for s in (0, 1)]
    assert [[bytes(f) for f in b.frames] for b in queued] == [[bytes(f) for f in e] for e in expected]
    assert ledger.held_bytes == 0


def test_a_partition_end_before_its_batches_is_answered_when_the_last_one_arrives():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "stream")
    assert end(ledger, 0, 0, 4, 2, req=17, identity=b"task") == []
    assert push(ledger, 0, 0, 0, attempt=4) == []
    assert push(ledger, 0, 0, 0, attempt=5) == []    # another attempt's copy does not count for attempt 4
    assert push(ledger, 0, 0, 1, attempt=5) == []
    [reply] = push(ledger, 0, 0, 1, attempt=4)
    assert reply.identity == b"task" and reply.kind == Kind.PARTITION_COMMITTED
    assert reply.fields == {"req": 17, "stream": STREAM, "epoch": 0, "part": 0}
    assert ledger.streams[STREAM].epochs[0].parts[0].committed_attempt == 4


def test_a_partition_end_counting_other_than_the_batches_held_is_answered_with_an_error():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "atomic")
    for seq in range(3):
        push(ledger, 0, 0, seq, attempt=0)
    [error] = end(ledger, 0, 0, 0, 2, req=9, identity=b"t0")
    assert error.kind == Kind.ERROR and error.identity == b"t0" and error.fields["req"] == 9
    assert "holds 3 batches of attempt 0, the task says it sent 2" in error.fields["reason"]
    part = ledger.streams[STREAM].epochs[0].parts[0]
    assert part.committed_attempt is None and not ledger.streams[STREAM].epochs[0].queue
    push(ledger, 0, 0, 0, attempt=1)                 # Spark retries the task
    push(ledger, 0, 0, 1, attempt=1)
    assert end(ledger, 0, 0, 1, 2)[0].kind == Kind.PARTITION_COMMITTED
    assert ledger.held_bytes == 0 and ledger.buffered == nbytes(0, 0, 0) + nbytes(0, 0, 1)


def test_a_committed_partition_is_answered_committed_again_whatever_the_later_attempt_says():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 2, "stream")
    push(ledger, 0, 0, 0, attempt=0)
    end(ledger, 0, 0, 0, 1)
    [again] = end(ledger, 0, 0, 1, 5, req=3, identity=b"speculative")
    assert again.kind == Kind.PARTITION_COMMITTED and again.identity == b"speculative"
    assert ledger.streams[STREAM].epochs[0].parts[0].committed_attempt == 0
    with pytest.raises(ProtocolError, match="outside epoch 0's 2 partitions"):
        end(ledger, 0, 2, 0, 1)
    with pytest.raises(ProtocolError, match="is not open"):
        end(ledger, 1, 0, 0, 1)


def test_a_pending_attempt_is_answered_when_its_batches_come_even_if_another_attempt_committed_first():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 1, "atomic")
    push(ledger, 0, 0, 0, attempt=0)
    assert end(ledger, 0, 0, 0, 2, identity=b"slow") == []
    push(ledger, 0, 0, 0, attempt=1)
    push(ledger, 0, 0, 1, attempt=1)
    assert [r.identity for r in end(ledger, 0, 0, 1, 2, identity=b"fast")] == [b"fast"]
    [late] = push(ledger, 0, 0, 1, attempt=0)
    assert late.identity == b"slow" and late.kind == Kind.PARTITION_COMMITTED
    assert ledger.streams[STREAM].epochs[0].parts[0].committed_attempt == 1
    assert ledger.held_bytes == 0


# ---- ranks: admission, windows, dispatch -------------------------------------------------------------------


def test_rank_admission_refuses_numbers_outside_the_communicator_another_size_and_a_second_rank_r():
    ledger = Ledger()
    with pytest.raises(ProtocolError, match="outside a communicator of size 2"):
        ledger.join_rank(b"a", hello(rank=2, size=2))
    ledger.join_rank(b"a", hello(rank=0, size=2))
    with pytest.raises(ProtocolError, match="consumed by 2 ranks; a rank of a communicator of size 3"):
        ledger.join_rank(b"b", hello(rank=1, size=3))
    with pytest.raises(ProtocolError, match="rank 0 of stream 's' is already connected"):
        ledger.join_rank(b"b", hello(rank=0, size=2))
    assert list(ledger.ranks) == [b"a"] and not ledger.streams[STREAM].complete
    ledger.join_rank(b"b", hello(rank=1, size=2))
    assert ledger.streams[STREAM].complete


def test_independent_consumers_all_join_as_rank_0_of_1():
    ledger = Ledger()
    for identity in (b"a", b"b", b"c"):
        ledger.join_rank(identity, hello(rank=0, size=1))
    assert len(ledger.streams[STREAM].ranks) == 3 and ledger.streams[STREAM].complete


def test_unknown_ranks_and_windows_out_of_range_are_refused_and_a_window_is_absolute():
    ledger = Ledger()
    with pytest.raises(ProtocolError, match="unknown rank"):
        ledger.rank(b"nobody")
    rank = join(ledger, b"a", hello())
    assert (rank.window, rank.window_bytes) == (0, 0)
    for batches, size in [(-1, 0), (MAX_WINDOW + 1, 0), (0, -1), (0, MAX_WINDOW_BYTES + 1)]:
        with pytest.raises(ProtocolError, match="window"):
            window(ledger, rank.identity, batches, size)
        assert (rank.window, rank.window_bytes) == (0, 0)            # a refused window changes nothing
    window(ledger, rank.identity, MAX_WINDOW, MAX_WINDOW_BYTES)
    assert (rank.window, rank.window_bytes) == (MAX_WINDOW, MAX_WINDOW_BYTES)
    window(ledger, rank.identity, 3, 100)
    window(ledger, rank.identity, 3, 100)            # stated again: the same window, not a larger one
    assert (rank.window, rank.window_bytes) == (3, 100)
    ledger.rank_gone(b"nobody", "never joined")      # harmless


def test_a_rank_reports_its_own_figures_on_ack_and_heartbeat_and_they_show_in_its_stats():
    ledger = Ledger()
    rank = join(ledger, b"a", hello(), prefetch=2, prefetch_bytes=1 << 20)
    ledger.report(rank, {"kind": Kind.HEARTBEAT})                  # a rank that says nothing about itself
    assert rank.reported == {}
    ledger.report(rank, {"kind": Kind.ACK, "ids": [], "wait_s": 1.5, "consumed": 7})
    ledger.report(rank, {"kind": Kind.HEARTBEAT, "first_batch_s": 0.25, "consumed": 9, "other": "ignored"})
    assert rank.reported == {"wait_s": 1.5, "first_batch_s": 0.25, "consumed": 9}     # the last said of each
    stats = rank.stats()
    assert {k: stats[k] for k in ("wait_s", "first_batch_s", "consumed", "window", "window_bytes", "inflight",
                                  "inflight_bytes")} == {"wait_s": 1.5, "first_batch_s": 0.25, "consumed": 9,
                                                         "window": 2, "window_bytes": 1 << 20, "inflight": 0,
                                                         "inflight_bytes": 0}


def test_nothing_is_sent_before_every_rank_of_the_communicator_joined():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 2)
    join(ledger, b"r0", hello(rank=0, size=2), prefetch=5)
    wire.dispatch()
    assert wire.sent == [] and wire.ends == []
    ledger.join_rank(b"r1", hello(rank=1, size=2))
    wire.dispatch()
    assert wire.to(b"r0") == [(0, 0, 0), (0, 0, 1)]


def test_batches_go_only_within_the_window_and_an_acknowledgement_frees_room():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 5, close=False)
    rank = join(ledger, b"r0", hello())
    wire.dispatch()
    assert wire.sent == []                           # no window yet
    window(ledger, rank.identity, 2)
    wire.dispatch()
    assert wire.to(b"r0") == [(0, 0, 0), (0, 0, 1)]
    assert set(rank.inflight) == {(0, 0, 0), (0, 0, 1)} and rank.batches == 2
    assert rank.inflight_bytes == rank.bytes == nbytes(0, 0, 0) + nbytes(0, 0, 1)
    ep = ledger.streams[STREAM].epochs[0]
    assert ep.batches_out == 2 and len(ep.queue) == 3
    window(ledger, rank.identity, 2)                 # the same window again: no more room than before
    wire.dispatch()
    assert len(wire.sent) == 2
    assert ack(ledger, b"r0", [(0, 0, 0)]) == 0
    assert rank.acked == 1 and rank.inflight_bytes == nbytes(0, 0, 1) and (rank.window, rank.window_bytes) == (2, 0)
    wire.dispatch()                                  # the acknowledgement freed room for one
    assert wire.to(b"r0")[2:] == [(0, 0, 2)] and set(rank.inflight) == {(0, 0, 1), (0, 0, 2)}
    window(ledger, rank.identity, 1)                 # a smaller window takes nothing back and sends nothing
    ack(ledger, b"r0", [(0, 0, 1)])
    wire.dispatch()
    assert len(wire.sent) == 3                       # one in flight fills a window of one
    ack(ledger, b"r0", [(0, 0, 2)])
    wire.dispatch()
    assert wire.to(b"r0")[3:] == [(0, 0, 3)] and set(rank.inflight) == {(0, 0, 3)}


def test_a_byte_window_admits_the_batches_that_fit_beside_those_in_flight():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 6)
    size = [nbytes(0, 0, s) for s in range(6)]
    rank = join(ledger, b"r", hello(), prefetch_bytes=size[0] + size[1] + size[2] - 1)
    wire.dispatch()
    assert wire.to(b"r") == [(0, 0, 0), (0, 0, 1)]             # a third does not fit by one byte
    assert rank.inflight_bytes == size[0] + size[1]
    ack(ledger, b"r", [(0, 0, 0)])
    wire.dispatch()
    assert wire.to(b"r")[2:] == [(0, 0, 2)] and rank.inflight_bytes == size[1] + size[2]
    window(ledger, b"r", 0, size[1] + size[2] + size[3])         # exactly enough for one more
    wire.dispatch()
    assert wire.to(b"r")[3:] == [(0, 0, 3)] and rank.inflight_bytes == size[1] + size[2] + size[3]
    window(ledger, b"r", 0, 0)                                   # no window at all: nothing more goes
    ack(ledger, b"r", [(0, 0, 1), (0, 0, 2), (0, 0, 3)])
    wire.dispatch()
    assert len(wire.sent) == 4 and rank.inflight_bytes == 0 and not rank.inflight


def test_the_window_admits_by_batches_or_by_bytes_whichever_admits_more():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, rows=100)                  # larger than the byte window
    for seq in range(1, 8):
        push(ledger, 0, 0, seq)
    end(ledger, 0, 0, 0, 8)
    small = nbytes(0, 0, 1)
    rank = join(ledger, b"r", hello(), prefetch=2, prefetch_bytes=3 * small)
    wire.dispatch()
    # by batches: two go, the large one too; by bytes nothing more fits beside the large one
    assert wire.to(b"r") == [(0, 0, 0), (0, 0, 1)]
    ack(ledger, b"r", [(0, 0, 0)])
    wire.dispatch()
    # by bytes: three small ones fit in flight together, more than the window of two batches admits
    assert wire.to(b"r")[2:] == [(0, 0, 2), (0, 0, 3)] and len(rank.inflight) == 3
    assert rank.inflight_bytes == sum(nbytes(0, 0, s) for s in (1, 2, 3)) <= 3 * small


def test_however_small_the_batches_a_byte_window_holds_at_most_max_window_in_flight():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, MAX_WINDOW + 2, close=False)
    rank = join(ledger, b"r", hello(), prefetch=1, prefetch_bytes=MAX_WINDOW_BYTES)
    wire.dispatch()
    assert len(rank.inflight) == len(wire.sent) == MAX_WINDOW
    wire.dispatch()
    assert len(wire.sent) == MAX_WINDOW
    ack(ledger, b"r", [(0, 0, 0)])
    wire.dispatch()
    assert len(rank.inflight) == MAX_WINDOW and wire.sent[-1] == (b"r", (0, 0, MAX_WINDOW))


def test_ranks_with_equal_windows_get_equal_shares_and_a_faster_rank_gets_more():
    ledger, wire = dispatched(12, (b"a", b"b", b"c"), prefetch=2)
    assert [len(wire.to(n)) for n in (b"a", b"b", b"c")] == [2, 2, 2]
    ack(ledger, b"a", wire.to(b"a"))                 # a trains faster: it has room again sooner
    wire.dispatch()
    assert [len(wire.to(n)) for n in (b"a", b"b", b"c")] == [4, 2, 2]
    for name in (b"a", b"b", b"c"):
        ack(ledger, name, [min(ledger.rank(name).inflight)])
    wire.dispatch()
    assert [len(wire.to(n)) for n in (b"a", b"b", b"c")] == [5, 3, 3]
    assert len({i for _, i in wire.sent}) == len(wire.sent) == 11


def test_rotation_starts_with_another_rank_at_each_dispatch():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    for name in (b"a", b"b"):
        join(ledger, name, hello(), prefetch=4)
    for seq in range(4):                             # one batch per dispatch, both ranks with room
        push(ledger, 0, 0, seq)
        wire.dispatch()
    assert [who for who, _ in wire.sent] in ([b"a", b"b"] * 2, [b"b", b"a"] * 2)


def test_a_refused_send_keeps_the_batch_first_in_the_queue_and_the_window_free():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 2)
    rank = join(ledger, b"r0", hello())
    window(ledger, rank.identity, 2)
    wire.refuse.add(b"r0")
    wire.dispatch()
    ep = ledger.streams[STREAM].epochs[0]
    assert wire.sent == [] and [b.id for b in ep.queue] == [(0, 0, 0), (0, 0, 1)]
    assert not rank.inflight and rank.inflight_bytes == 0 and rank.batches == 0 and rank.bytes == 0
    assert ep.batches_out == 0 and wire.ends == []
    wire.refuse.clear()
    wire.dispatch()
    assert wire.to(b"r0") == [(0, 0, 0), (0, 0, 1)]


def test_a_rank_found_gone_while_sending_leaves_its_batches_to_the_others():
    ledger, wire = dispatched(4)
    held_by_a = wire.to(b"a")
    wire.gone.add(b"a")
    window(ledger, b"a", 2)                          # room for one more: the send finds the rank gone
    window(ledger, b"b", 6)
    wire.dispatch()
    assert b"a" not in ledger.ranks
    assert sorted(wire.to(b"b")) == [(0, 0, s) for s in range(4)] and held_by_a[0] in wire.to(b"b")
    ack(ledger, b"b", wire.to(b"b"))
    wire.dispatch()
    assert wire.ends == [(b"b", 0)] and ledger.buffered == 0


def test_batches_of_the_next_epoch_go_out_only_after_the_end_of_the_previous_one():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 1, 1, 2)                            # epoch 1 is ready first
    feed(ledger, 0, 1, 1, close=False)
    rank = join(ledger, b"r0", hello())
    window(ledger, rank.identity, 10)
    wire.dispatch()
    assert wire.sent == [(b"r0", (0, 0, 0))] and wire.ends == []
    ledger.close_epoch(STREAM, 0, 1)
    wire.dispatch()
    assert wire.ends == [] and len(wire.sent) == 1   # independent ranks: epoch 0 waits for its acknowledgement
    ack(ledger, b"r0", [(0, 0, 0)])
    wire.dispatch()
    assert wire.ends == [(b"r0", 0)]
    assert [i for _, i in wire.sent] == [(0, 0, 0), (1, 0, 0), (1, 0, 1)]
    assert set(rank.inflight) == {(1, 0, 0), (1, 0, 1)} and rank.acked == 1 and rank.batches == 3
    assert rank.inflight_bytes == nbytes(1, 0, 0) + nbytes(1, 0, 1) and rank.has_room(1 << 30)   # 2 of 10


# ---- the end of an epoch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("closed, queued, unacked, even, delivered", [
    (False, 0, 0, False, False),
    (False, 0, 0, True, False),
    (True, 1, 0, True, False),
    (True, 1, 0, False, False),
    (True, 0, 1, False, False),       # independent ranks: every batch sent must be acknowledged
    (True, 0, 1, True, True),         # even ranks: everything sent is enough
    (True, 0, 0, False, True),
    (True, 0, 0, True, True),
])
def test_epoch_state_delivered_is_closed_and_sent_and_for_independent_ranks_acknowledged(
        closed, queued, unacked, even, delivered):
    ep = EpochState(0, 1, closed=closed, batches_out=3, in_flight=unacked, acked=3 - unacked)
    ep.queue.extend(object() for _ in range(queued))
    assert ep.delivered(even) is delivered


def test_independent_ranks_are_told_the_epoch_ended_only_once_every_batch_is_acknowledged():
    ledger, wire = dispatched(2)
    assert wire.ends == []
    ack(ledger, b"a", wire.to(b"a"))
    wire.dispatch()
    assert wire.ends == []
    ack(ledger, b"b", wire.to(b"b"))
    wire.dispatch()
    assert sorted(wire.ends) == [(b"a", 0), (b"b", 0)]
    assert 0 in ledger.streams[STREAM].finished and not ledger.streams[STREAM].epochs


def test_even_ranks_are_told_the_epoch_ended_once_everything_was_sent():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 2)
    for r in range(2):
        join(ledger, bytes([r]), hello(rank=r, size=2, even=True), prefetch=1)
    wire.dispatch()
    assert sorted(wire.ends) == [(b"\0", 0), (b"\1", 0)]
    ep = ledger.streams[STREAM].epochs[0]
    assert ep.end_sent and 0 not in ledger.streams[STREAM].finished     # not retired: in flight still
    ack(ledger, b"\0", wire.to(b"\0"))
    assert 0 in ledger.streams[STREAM].epochs
    ack(ledger, b"\1", wire.to(b"\1"))
    assert 0 in ledger.streams[STREAM].finished and ledger.buffered == 0


# ---- acknowledgements, ranks leaving, retiring -------------------------------------------------------------


def test_acknowledgements_of_ids_not_in_flight_to_that_rank_are_counted_and_ignored():
    ledger, wire = dispatched(2)
    [mine], [theirs] = wire.to(b"a"), wire.to(b"b")
    # flat triples: another rank's batch, a seq never sent, an epoch never opened, then mine twice (an id that
    # is not an integer refuses the whole ACK instead: see the tests of refused acknowledgements)
    bogus = [*theirs, 0, 0, 99, 9, 0, 0, *mine, *mine]
    assert ledger.acknowledge(ledger.rank(b"a"), bogus) == 4
    assert ledger.rank(b"a").acked == 1 and ledger.streams[STREAM].epochs[0].acked == 1
    assert not ledger.rank(b"a").inflight and ledger.rank(b"a").inflight_bytes == 0
    assert theirs in ledger.rank(b"b").inflight and ledger.rank(b"b").inflight_bytes == nbytes(*theirs)
    assert ledger.acknowledge(ledger.rank(b"a"), []) == 0
    assert_bytes_accounted(ledger)


@pytest.mark.parametrize("ids", [
    [0, 0],                                          # not whole triples
    [0, 0, 0, 0],
    [[0, 0, 0]],                                     # the nested form of protocol version 2
    [[0, 0, 0], [0, 0, 1], [0, 0, 2]],
    [0, 0, [1]],                                     # unhashable
    [{"epoch": 0}, 0, 0],
])
def test_an_ack_whose_ids_are_not_flat_triples_is_refused_and_changes_nothing(ids):
    ledger, _ = dispatched(2, (b"a",), prefetch=2)
    rank = ledger.rank(b"a")
    before = (set(rank.inflight), rank.inflight_bytes, rank.acked, ledger.buffered)
    with pytest.raises(ProtocolError, match="ACK ids must be"):
        ledger.acknowledge(rank, ids)
    assert (set(rank.inflight), rank.inflight_bytes, rank.acked, ledger.buffered) == before
    assert ledger.streams[STREAM].epochs[0].acked == 0


def test_a_rank_gone_puts_its_unacknowledged_batches_at_the_front_of_the_queue_in_order():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 6)
    for name in (b"a", b"b"):
        ledger.join_rank(name, hello())
    window(ledger, b"a", 3)
    wire.dispatch()
    ack(ledger, b"a", wire.to(b"a")[:1])
    ep = ledger.streams[STREAM].epochs[0]
    assert ep.batches_out == 3
    ledger.rank_gone(b"a", "said goodbye")
    assert [b.id for b in ep.queue] == [(0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5)]
    assert ep.batches_out == 1 and ep.acked == 1 and b"a" not in ledger.streams[STREAM].ranks
    assert ledger.streams[STREAM].complete                                 # b is still there
    window(ledger, b"b", 1)
    wire.dispatch()
    assert wire.to(b"b") == [(0, 0, 1)]


def test_when_every_rank_is_gone_a_job_of_another_size_may_join():
    ledger = Ledger()
    for r in range(2):
        ledger.join_rank(bytes([r]), hello(rank=r, size=2))
    for r in range(2):
        ledger.rank_gone(bytes([r]), "disconnected")
    stream = ledger.streams[STREAM]
    assert not stream.complete and stream.expected_ranks == 0
    ledger.join_rank(b"x", hello(rank=0, size=3))
    assert stream.expected_ranks == 3 and not stream.complete


def test_a_rank_saying_hello_again_is_a_new_rank_and_its_batches_are_requeued():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 2)
    join(ledger, b"a", hello(), prefetch=1)
    wire.dispatch()
    rank = join(ledger, b"a", hello())
    assert (rank.window, rank.window_bytes) == (0, 0) and not rank.inflight and rank.inflight_bytes == 0
    assert [b.id for b in ledger.streams[STREAM].epochs[0].queue] == [(0, 0, 0), (0, 0, 1)]


def test_when_every_even_rank_is_gone_an_ended_epoch_with_unacknowledged_batches_is_delivered_again():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 1, 3)
    feed(ledger, 1, 1, 1)
    for r in range(2):
        join(ledger, bytes([r]), hello(rank=r, size=2, even=True), prefetch=2)
    wire.dispatch()
    stream = ledger.streams[STREAM]
    assert (b"\0", 0) in wire.ends and stream.epochs[0].end_sent and stream.epochs[1].end_sent
    ack(ledger, b"\0", [i for i in wire.to(b"\0") if i[0] == 0])
    unacked = sorted(set(ledger.rank(b"\0").inflight) | set(ledger.rank(b"\1").inflight))
    assert {i[0] for i in unacked} == {0, 1} and len(unacked) == 3   # the job dies holding both epochs' batches
    ledger.rank_gone(b"\0", "disconnected")
    assert stream.epochs[0].end_sent and stream.epochs[1].end_sent    # rank 1 is still there: the epochs stay ended
    ledger.rank_gone(b"\1", "disconnected")           # the whole job died
    assert not stream.epochs[0].end_sent and not stream.epochs[1].end_sent
    left = {e: [i for i in unacked if i[0] == e] for e in (0, 1)}
    assert {e: [b.id for b in stream.epochs[e].queue] for e in (0, 1)} == left

    wire2 = Wire(ledger)                              # the restarted job: one independent consumer
    join(ledger, b"new", hello(), prefetch=10)
    wire2.dispatch()
    assert wire2.to(b"new") == left[0] and wire2.ends == []     # the remainder of epoch 0 first
    ack(ledger, b"new", left[0])
    wire2.dispatch()
    assert wire2.ends == [(b"new", 0)] and wire2.to(b"new")[len(left[0]):] == left[1]
    ack(ledger, b"new", left[1])
    wire2.dispatch()
    assert wire2.ends == [(b"new", 0), (b"new", 1)]
    assert set(stream.finished.figures) == {0, 1} and ledger.buffered == 0


def test_an_epoch_is_retired_with_its_figures_once_ended_and_acknowledged():
    ledger = Ledger()
    wire = Wire(ledger)
    feed(ledger, 0, 2, 2)
    push(ledger, 0, 0, 0, attempt=1)                 # a late duplicate while the epoch is still open
    rank = join(ledger, b"r", hello())
    window(ledger, rank.identity, 4)
    wire.dispatch()
    ack(ledger, b"r", wire.to(b"r")[:3])
    wire.dispatch()
    assert 0 in ledger.streams[STREAM].epochs
    ack(ledger, b"r", wire.to(b"r")[3:])
    wire.dispatch()
    stats = ledger.streams[STREAM].finished.figures[0]
    assert stats["batches_in"] == stats["batches_out"] == stats["acked"] == 4
    assert stats["duplicates"] == 1 and stats["ended"] and stats["committed"] == 2 and stats["rows_in"] == 8
    assert rank.acked == 4 and not rank.inflight and ledger.buffered == 0


def test_buffered_bytes_follow_every_batch_held_and_come_back_to_zero():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.open_epoch(STREAM, 0, 2, "atomic")
    ledger.open_epoch(STREAM, 1, 1, "stream")
    steps = [
        lambda: push(ledger, 0, 0, 0, attempt=0),
        lambda: push(ledger, 0, 0, 0, attempt=1),
        lambda: push(ledger, 0, 0, 1, attempt=1),
        lambda: push(ledger, 1, 0, 0),
        lambda: push(ledger, 1, 0, 1, splits=[1, 2]),
        lambda: push(ledger, 1, 0, 0, attempt=1),
        lambda: end(ledger, 0, 0, 1, 2),
        lambda: push(ledger, 0, 1, 0, attempt=2, rows=50),
        lambda: push(ledger, 0, 1, 1, attempt=2, splits=[3, 1, 1]),
        lambda: end(ledger, 0, 1, 2, 2),
        lambda: ledger.close_epoch(STREAM, 0, 2),
        lambda: join(ledger, b"a", hello(), prefetch=2),
        lambda: join(ledger, b"b", hello(), prefetch_bytes=nbytes(0, 0, 0)),
        wire.dispatch,
        lambda: ledger.rank_gone(b"a", "disconnected"),
        lambda: window(ledger, b"b", 6),
        wire.dispatch,
        lambda: ack(ledger, b"b", wire.to(b"b")),
        wire.dispatch,
        lambda: end(ledger, 1, 0, 0, 2),
        lambda: ledger.close_epoch(STREAM, 1, 1),
        wire.dispatch,
        lambda: ack(ledger, b"b", [i for i in wire.to(b"b") if i[0] == 1]),
        wire.dispatch,
    ]
    for step in steps:
        step()
        assert_bytes_accounted(ledger)
    assert ledger.buffered == ledger.held_bytes == 0
    finished = ledger.streams[STREAM].finished.figures
    assert set(finished) == {0, 1}
    assert [finished[e]["batches_in"] for e in (0, 1)] == [2 + 1 + 3, 1 + 2]        # packs count their batches
    assert ledger.rank(b"b").acked == 9 and ledger.rank(b"b").inflight_bytes == 0


# ---- packs of small batches ---------------------------------------------------------------------------------
# A pack is one message (one id, one checksum, one PARTITION_END count, one duplicate, one place in a window of
# batches), and its batches in the epoch's and rank's figures: batches_in, batches_out, acked, redelivered.


def test_a_pack_counts_its_batches_in_the_figures_and_one_message_where_messages_count():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, splits=[1, 2, 1])          # a pack of three small batches, four rows
    push(ledger, 0, 0, 1)                            # a batch alone
    push(ledger, 0, 0, 0, attempt=1, splits=[1, 2, 1])      # a retry's copy of the pack
    ep = ledger.streams[STREAM].epochs[0]
    assert [(b.id, b.count, b.rows) for b in ep.queue] == [((0, 0, 0), 3, 4), ((0, 0, 1), 1, 2)]
    assert ep.batches_in == 4 and ep.rows_in == 6 and ep.duplicates == 1
    assert ep.bytes_in == nbytes(0, 0, 0, splits=[1, 2, 1]) + nbytes(0, 0, 1)
    assert end(ledger, 0, 0, 0, 2)[0].kind == Kind.PARTITION_COMMITTED     # the task counts messages
    assert ledger.close_epoch(STREAM, 0, 1) == []
    rank = join(ledger, b"r", hello(), prefetch=1)
    wire.dispatch()
    assert wire.to(b"r") == [(0, 0, 0)]              # the pack alone fills a window of one batch
    assert ep.batches_out == 3 and ep.bytes_out == nbytes(0, 0, 0, splits=[1, 2, 1])
    assert rank.batches == 3 and len(rank.inflight) == 1
    assert rank.inflight_bytes == nbytes(0, 0, 0, splits=[1, 2, 1])
    ack(ledger, b"r", [(0, 0, 0)])
    assert ep.acked == 3 and rank.acked == 3 and rank.inflight_bytes == 0
    wire.dispatch()
    ack(ledger, b"r", [(0, 0, 1)])
    wire.dispatch()
    assert wire.ends == [(b"r", 0)]
    stats = ledger.streams[STREAM].finished.figures[0]
    assert stats["batches_in"] == stats["batches_out"] == stats["acked"] == 4
    assert stats["duplicates"] == 1 and stats["redelivered"] == 0 and stats["rows_in"] == 6
    assert rank.batches == rank.acked == 4 and ledger.buffered == 0


def test_an_atomic_partition_end_counts_a_pack_as_one_message():
    ledger = Ledger()
    ledger.open_epoch(STREAM, 0, 2, "atomic")
    push(ledger, 0, 0, 0, splits=[2, 2])
    push(ledger, 0, 0, 1)
    [error] = end(ledger, 0, 0, 0, 1, identity=b"short")
    assert error.kind == Kind.ERROR and "holds 2 batches of attempt 0, the task says it sent 1" in \
        error.fields["reason"]
    assert end(ledger, 0, 0, 0, 3) == []              # counting the pack's batches: it waits for a third message
    push(ledger, 0, 1, 0, splits=[1, 1])
    assert end(ledger, 0, 1, 0, 1)[0].kind == Kind.PARTITION_COMMITTED
    ep = ledger.streams[STREAM].epochs[0]
    assert [(b.id, b.count) for b in ep.queue] == [((0, 1, 0), 2)] and ep.batches_in == 2
    assert ledger.held_bytes == nbytes(0, 0, 0, splits=[2, 2]) + nbytes(0, 0, 1)


def test_a_pack_sent_again_counts_its_batches_as_redelivered():
    ledger = Ledger()
    wire = Wire(ledger)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, splits=[1, 1, 1])
    push(ledger, 0, 0, 1)
    end(ledger, 0, 0, 0, 2)
    ledger.close_epoch(STREAM, 0, 1)
    join(ledger, b"a", hello(), prefetch=1)
    b = join(ledger, b"b", hello())
    wire.dispatch()
    ep = ledger.streams[STREAM].epochs[0]
    assert wire.to(b"a") == [(0, 0, 0)] and ep.batches_out == 3
    ledger.rank_gone(b"a", "disconnected")           # no session: requeued at once
    assert ep.batches_out == 0 and [(x.id, x.count) for x in ep.queue] == [((0, 0, 0), 3), ((0, 0, 1), 1)]
    window(ledger, b"b", 2)
    wire.dispatch()
    assert wire.to(b"b") == [(0, 0, 0), (0, 0, 1)]
    assert ep.redelivered == 3 and ep.batches_out == 4 and b.batches == 4
    ack(ledger, b"b", wire.to(b"b"))
    wire.dispatch()
    stats = ledger.streams[STREAM].finished.figures[0]
    assert stats["batches_out"] == stats["acked"] == 4 and stats["redelivered"] == 3


# ---- rejoining ---------------------------------------------------------------------------------------------
# The rules of rejoining are in test_rejoin.py; these check the window, the byte counts and packs across one.


def test_a_rejoining_rank_keeps_its_batches_in_its_window_and_a_pack_it_consumed_counts_its_batches():
    ledger = Ledger(rejoin_grace=10.0)
    wire = Wire(ledger)
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, splits=[1, 1])
    for seq in (1, 2, 3):
        push(ledger, 0, 0, seq)
    end(ledger, 0, 0, 0, 4)
    ledger.close_epoch(STREAM, 0, 1)
    h = dict(hello(), session="job")
    join(ledger, b"a", h, prefetch=3)
    wire.dispatch()
    assert wire.to(b"a") == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    ledger.rank_gone(b"a", "disconnected")           # a cut link: what it holds waits for it
    assert_bytes_accounted(ledger)
    # it consumed the pack (its ACK was lost) and holds the other two
    assert ledger.join_rank(b"a2", dict(h, resume=True), held=[(0, 0, 1), (0, 0, 2)], consumed=[(0, 0, 0)]) == []
    rank, ep = ledger.rank(b"a2"), ledger.streams[STREAM].epochs[0]
    assert set(rank.inflight) == {(0, 0, 1), (0, 0, 2)} and rank.inflight_bytes == nbytes(0, 0, 1) + nbytes(0, 0, 2)
    assert ep.acked == rank.acked == 2 and ep.batches_out == 4 and ep.given_twice == 0 and ep.redelivered == 0
    assert_bytes_accounted(ledger)
    window(ledger, b"a2", 2)                         # what it holds fills a window of two
    wire.dispatch()
    assert wire.to(b"a2") == []
    window(ledger, b"a2", 3)
    wire.dispatch()
    assert wire.to(b"a2") == [(0, 0, 3)]
    ack(ledger, b"a2", [(0, 0, 1), (0, 0, 2), (0, 0, 3)])
    wire.dispatch()
    assert wire.ends == [(b"a2", 0)] and ledger.buffered == 0
    stats = ledger.streams[STREAM].finished.figures[0]
    assert stats["batches_out"] == stats["acked"] == 5 and stats["given_twice"] == 0


def lost_past_its_grace(ledger, wire, splits=None):
    """Rank ``a`` (session "lost") is sent (0, 0, 0), its link breaks and stays down beyond --rejoin-grace: the
    batch goes to rank ``x`` (session "other"), which holds it unacknowledged. Returns the HELLO ``a`` said."""
    ledger.open_epoch(STREAM, 0, 1, "stream")
    push(ledger, 0, 0, 0, splits=splits)
    push(ledger, 0, 0, 1)
    end(ledger, 0, 0, 0, 2)
    ledger.close_epoch(STREAM, 0, 1)
    lost = dict(hello(), session="lost")
    join(ledger, b"a", lost, prefetch=1)
    join(ledger, b"x", dict(hello(), session="other"), prefetch=1)
    wire.refuse.add(b"x")
    wire.dispatch()
    assert wire.to(b"a") == [(0, 0, 0)]
    ledger.rank_gone(b"a", "disconnected")           # a cut link: the batch waits for the rank to come back
    ledger.expire_orphans(float("inf"))              # it did not come back within the grace
    wire.refuse.clear()
    wire.dispatch()
    assert wire.to(b"x") == [(0, 0, 0)]              # x trains it now
    return lost


@pytest.mark.parametrize("had", ["held", "consumed"])
def test_a_rank_rejoining_after_its_grace_with_batches_given_to_another_rank_is_accepted_loudly(caplog, had):
    """A late rejoin is a real network event, not bad input: the rank is accepted (not aborted), the batch both
    ranks have is counted in ``given_twice`` and a warning says so; nothing else changes."""
    ledger = Ledger(rejoin_grace=10.0)
    wire = Wire(ledger)
    lost = lost_past_its_grace(ledger, wire)
    stream, ep = ledger.streams[STREAM], ledger.streams[STREAM].epochs[0]
    before = {k: v for k, v in ep.stats().items() if k != "given_twice"}
    buffered, x = ledger.buffered, ledger.rank(b"x")
    assert ep.given_twice == 0 and ep.redelivered == 1

    # The link heals: the rank, alive all along, says HELLO with what it holds (or consumed meanwhile).
    ids = {"held": [(0, 0, 0)], "consumed": []} if had == "held" else {"held": [], "consumed": [(0, 0, 0)]}
    with caplog.at_level(logging.WARNING, logger="sparkbus.broker"):
        assert ledger.join_rank(b"a2", dict(lost, resume=True), **ids) == []
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "came back to find 1 batches" in message and "longer than --rejoin-grace" in message
    assert ep.given_twice == 1
    assert {k: v for k, v in ep.stats().items() if k != "given_twice"} == before
    assert ledger.buffered == buffered and stream.rejoins == 1
    rank = ledger.rank(b"a2")
    assert not rank.inflight and rank.inflight_bytes == 0 and rank.acked == 0
    assert set(x.inflight) == {(0, 0, 0)} and x.inflight_bytes == nbytes(0, 0, 0)
    assert_bytes_accounted(ledger)

    # The rank goes on: it gets the rest of the epoch; its acknowledgement of the batch x has is unknown.
    window(ledger, b"a2", 1)
    wire.dispatch()
    assert wire.to(b"a2") == [(0, 0, 1)]
    assert ack(ledger, b"a2", [(0, 0, 0), (0, 0, 1)]) == 1
    assert (0, 0, 0) in x.inflight and ep.acked == 1
    ack(ledger, b"x", [(0, 0, 0)])
    wire.dispatch()
    assert sorted(wire.ends) == [(b"a2", 0), (b"x", 0)] and ledger.buffered == 0
    stats = stream.finished.figures[0]
    assert stats["given_twice"] == 1 and stats["batches_out"] == stats["acked"] == stats["batches_in"] == 2


# ---- refused acknowledgements, and what given_twice counts ------------------------------------------------------


def test_an_ack_refused_for_a_bad_id_after_good_ones_changes_nothing():
    ledger, _ = dispatched(2, (b"a",), prefetch=2)
    rank = ledger.rank(b"a")
    with pytest.raises(ProtocolError, match="ACK ids must be"):
        ledger.acknowledge(rank, [0, 0, 0, [1], 0, 0])
    assert set(rank.inflight) == {(0, 0, 0), (0, 0, 1)}
    assert_bytes_accounted(ledger)


def test_ids_of_bools_or_floats_acknowledge_nothing():
    ledger, _ = dispatched(2, (b"a",), prefetch=2)
    rank = ledger.rank(b"a")
    try:
        ledger.acknowledge(rank, [0, 0, True, 0, 0, 0.0])
    except ProtocolError:
        pass
    assert set(rank.inflight) == {(0, 0, 0), (0, 0, 1)}


def test_a_pack_given_twice_counts_its_batches():
    ledger = Ledger(rejoin_grace=10.0)
    wire = Wire(ledger)
    lost = lost_past_its_grace(ledger, wire, splits=[1, 1, 1])
    ep = ledger.streams[STREAM].epochs[0]
    assert ep.redelivered == 3
    ledger.join_rank(b"a2", dict(lost, resume=True), held=[(0, 0, 0)], consumed=[])
    assert ep.given_twice == 3


# ---- the daemon does I/O only: sends report outcomes, the ledger acts after its pass ---------------------------


def test_a_send_that_finds_a_rank_gone_changes_nothing_until_the_pass_is_over():
    """``transmit`` only says what became of a message; the ranks and the queue stay as they are while a pass of
    dispatch iterates over them, and the gone rank's batches reach the others in the same dispatch."""
    ledger, wire = dispatched(6, (b"a", b"b", b"c"), prefetch=1)
    wire.gone.add(b"b")
    for name in (b"a", b"b", b"c"):
        window(ledger, name, 3)
    calls = []

    def transmit(identity, frames):
        calls.append((identity, set(ledger.ranks)))
        return wire.transmit(identity, frames)

    ledger.dispatch(ledger.streams[STREAM], transmit)
    after_gone = calls[[who for who, _ in calls].index(b"b") + 1:]
    assert after_gone[0][1] == {b"a", b"b", b"c"}     # the pass went on with b still known ...
    assert calls[-1][1] == {b"a", b"c"}               # ... and the next pass sent its batch to another
    assert b"b" not in ledger.ranks
    assert sorted(wire.to(b"a") + wire.to(b"c")) == [(0, 0, s) for s in range(6)]
    assert_bytes_accounted(ledger)


def test_the_feed_gate_pauses_at_the_buffer_bound_and_warns_of_an_atomic_stall(caplog):
    ledger = Ledger(max_buffer=nbytes(0, 0, 0))
    ledger.open_epoch(STREAM, 0, 1, "atomic")
    assert not ledger.feed_full() and not ledger.update_feed_gate() and not ledger.feed_paused
    push(ledger, 0, 0, 0)                            # held for its commit: nothing can go out
    assert ledger.feed_full() and ledger.update_feed_gate() and ledger.feed_paused
    assert not ledger.update_feed_gate()             # no change
    with caplog.at_level(logging.WARNING, logger="sparkbus.broker"):
        for now in (100.0, 105.0, 111.0):
            ledger.warn_if_atomic_stall(now)
    assert sum("not committed yet" in r.getMessage() for r in caplog.records) == 2     # at most every 10 s
    assert end(ledger, 0, 0, 0, 1)[0].kind == Kind.PARTITION_COMMITTED
    assert ledger.feed_full() and ledger.held_bytes == 0   # committed: it may go out; the buffer is still full
