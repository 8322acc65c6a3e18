"""Spark's word commits a partition (docs/PROTOCOL.md, "Which attempt is committed"): an attempt whose input was
cut short ends first and is only *complete*; the retry's later batches are still taken; the driver's
PARTITION_COMMIT of the attempt Spark declared successful commits it. A real broker in a thread, over inproc://."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from sparkbus.broker.ledger import Ledger
from sparkbus.broker.state import HeldBatch
from sparkbus.wire import codec
from sparkbus.wire.protocol import ErrorCode, Kind

from harness import recv_header, send, wait_for

pytestmark = pytest.mark.timeout(30)

CUT, RETRY = (7 << 32) | 11, (7 << 32) | 12      # two attempt ids of one run (feeder.task.attempt_id)


@pytest.fixture
def bus(start_broker_thread, sockets):
    broker = start_broker_thread(max_buffer=1 << 24)

    class Bus:
        push = sockets(zmq.PUSH, broker.config.feed)
        control = sockets(zmq.DEALER, broker.config.control)

        def request(self, kind, **fields):
            send(self.control, kind, req=9, **fields)
            return recv_header(self.control)[0]

        def batch(self, seq, attempt, part=0, rows=10):
            self.push.send_multipart(codec.encode_batch("s", 0, part, seq, {
                "id": np.arange(rows) + 100 * part + rows * seq}, attempt=attempt))

        def rank(self):
            sock = sockets(zmq.DEALER, broker.config.ranks)
            send(sock, Kind.HELLO, req=1, role="rank", stream="s", rank=0, size=1, even=False, session="r0",
                 resume=False, ended=-1)
            assert recv_header(sock)[0]["kind"] == Kind.WELCOME
            send(sock, Kind.CREDIT, window=64, window_bytes=0)
            return sock

        def epoch(self):
            return broker.stats()["streams"]["s"]["epochs"]["0"]

    bus = Bus()
    bus.broker = broker
    return bus


def ids_until_end(sock) -> list[int]:
    """Every id the rank receives until EPOCH_END, each batch acknowledged."""
    got: list[int] = []
    while True:
        header, frames = recv_header(sock)
        if header["kind"] == Kind.EPOCH_END:
            return sorted(got)
        assert header["kind"] == Kind.BATCH
        got.extend(codec.decode_batch(header, frames)["id"].tolist())
        send(sock, Kind.ACK, ids=[header["epoch"], header["part"], header["seq"]])


@pytest.mark.parametrize("delivery", ["stream", "atomic"])
def test_an_attempt_cut_short_ends_first_and_the_attempt_spark_declared_successful_is_committed(bus, delivery):
    assert bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery=delivery,
                       commit="driver")["kind"] == Kind.OK
    rank = bus.rank()
    for seq in range(2):                       # the lost executor's attempt: its input ended after 2 of 5 batches
        bus.batch(seq, CUT)
    ended = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=CUT, batches=2, rows=20)
    assert (ended["kind"], ended["attempt"]) == (Kind.PARTITION_RECEIVED, CUT)
    assert bus.epoch()["committed"] == 0            # complete, not committed
    for seq in range(5):                       # Spark's retry on another executor: the whole partition
        bus.batch(seq, RETRY)
    ended = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=RETRY, batches=5, rows=50)
    assert ended["kind"] == Kind.PARTITION_RECEIVED
    committed = bus.request(Kind.PARTITION_COMMIT, stream="s", epoch=0, parts=[0, RETRY, 5])
    assert (committed["kind"], committed["missing"]) == (Kind.OK, [])
    closed = bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=1)
    assert (closed["kind"], closed["diverged"]) == (Kind.OK, [])
    assert ids_until_end(rank) == list(range(50))
    epoch = bus.epoch()
    assert (epoch["committed"], epoch["rows_in"], epoch["superseded"], epoch["commit"]) == (1, 50, 1, "driver")
    assert epoch["duplicates"] == (2 if delivery == "stream" else 0)     # atomic: each attempt's held apart


def test_a_commit_naming_batches_the_broker_does_not_hold_is_missing_and_the_epoch_cannot_close(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=2, delivery="stream", commit="driver")
    for seq in range(3):
        bus.batch(seq, RETRY)
    wait_for(lambda: bus.epoch()["batches_in"] == 3, 10, "the broker to hold the 3 batches")
    assert bus.request(Kind.PARTITION_COMMIT, stream="s", epoch=0, parts=[0, RETRY, 4, 1, RETRY, 1])["missing"] == \
        [0, 1]
    assert bus.request(Kind.PARTITION_COMMIT, stream="s", epoch=0, parts=[0, RETRY, 3])["missing"] == []
    refused = bus.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=2)
    assert (refused["kind"], refused["code"]) == (Kind.ERROR, ErrorCode.REFUSED)
    assert "1 of 2 partitions committed (missing [1])" in refused["reason"]


@pytest.mark.parametrize("parts", [[0, 1], [0, 1, "2"], [0, -1, 2], [5, 1, 1], list(range(3 * 1025))])
def test_a_malformed_commit_is_refused_and_commits_nothing(bus, parts):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="stream", commit="driver")
    bus.batch(0, RETRY)
    refused = bus.request(Kind.PARTITION_COMMIT, stream="s", epoch=0, parts=parts)
    assert (refused["kind"], refused["code"]) == (Kind.ERROR, ErrorCode.REFUSED)
    assert bus.epoch()["committed"] == 0


def test_an_epoch_opened_without_commit_is_committed_by_its_tasks_end_as_before(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="stream")
    for seq in range(2):
        bus.batch(seq, CUT)
    ended = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=CUT, batches=2, rows=20)
    assert ended["kind"] == Kind.PARTITION_COMMITTED
    assert (bus.epoch()["committed"], bus.epoch()["commit"]) == (1, "end")


def test_an_unknown_commit_mode_is_refused(bus):
    refused = bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="stream", commit="first")
    assert (refused["kind"], refused["code"]) == (Kind.ERROR, ErrorCode.REFUSED)
    assert "commit 'first' is not one of end, driver" in refused["reason"]


def test_a_losing_copy_that_completes_after_the_commit_is_superseded_and_answered(bus):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="atomic", commit="driver")
    for seq in range(2):
        bus.batch(seq, RETRY)
    assert bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=RETRY, batches=2,
                       rows=20)["kind"] == Kind.PARTITION_RECEIVED
    assert bus.request(Kind.PARTITION_COMMIT, stream="s", epoch=0, parts=[0, RETRY, 2])["missing"] == []
    for seq in range(2):                       # a speculative copy, still running when Spark chose the other
        bus.batch(seq, CUT)
    # answered at once: the partition is committed, its batches are duplicates whenever they come
    assert bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=CUT, batches=2,
                       rows=20)["kind"] == Kind.PARTITION_RECEIVED
    wait_for(lambda: bus.epoch()["duplicates"] == 2, 10, "the copy's batches to be dropped")
    epoch = bus.epoch()
    assert (epoch["superseded"], epoch["batches_in"], epoch["committed"]) == (1, 2, 1)


def test_a_commit_after_a_restart_from_the_journal_commits_the_replayed_batches(tmp_path):
    """The task's batches were journalled as they came; the broker restarted before the driver's commit."""
    from sparkbus.broker.journal import Journal
    from sparkbus.wire.protocol import unpack_header

    def batch(seq: int, attempt: int) -> tuple[dict, list]:
        frames = codec.encode_batch("s", 0, 0, seq, {"id": np.arange(10) + 10 * seq}, attempt=attempt)
        return unpack_header(frames[0]), frames

    first = Ledger(Journal(tmp_path))
    first.open_epoch("s", 0, 1, "atomic", commit="driver")
    for seq in range(3):
        header, frames = batch(seq, RETRY)
        first.accept_batch(header, frames, bytes(frames[0]))
    first.journal.close()

    again = Ledger(Journal(tmp_path))
    again.replay()
    ep = again.streams["s"].epochs[0]
    assert (ep.commit, len(ep.committed), len(ep.queue)) == ("driver", 0, 0)      # held, not committed
    assert again.commit_partitions("s", 0, [0, RETRY, 3]) == []
    assert [b.id for b in ep.queue] == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    assert all(isinstance(b, HeldBatch) for b in ep.queue)
    again.journal.close()
    third = Ledger(Journal(tmp_path))       # and the commit itself was journalled
    third.replay()
    assert third.streams["s"].epochs[0].committed == {0}
    third.journal.close()


@pytest.mark.parametrize("commit", ["end", "driver"])
def test_a_partition_end_refused_for_its_count_is_counted_as_refused(bus, commit):
    bus.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="stream", commit=commit)
    for seq in range(2):
        bus.batch(seq, RETRY)
    wait_for(lambda: bus.epoch()["batches_in"] == 2, 10, "the broker to hold the 2 batches")
    refused = bus.request(Kind.PARTITION_END, stream="s", epoch=0, part=0, attempt=RETRY, batches=1, rows=10)
    assert (refused["kind"], refused["code"]) == (Kind.ERROR, ErrorCode.REFUSED)
    assert "holds 2 batches of attempt" in refused["reason"]
    assert bus.broker.stats()["broker"]["rejected"]["control"]["refused"] == 1
