"""The rank's side of recovery from lineage and of an exact resume (docs/design/RECOVERY.md, "The rank" and "Exact
resume"), against stand-in brokers over inproc: a restart without journal seen in a rejoin's WELCOME, LOST, a
broker silent while another answers, STEPS.adopted, state_dict() and resume=, and the shuffle buffer's refusal."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import zmq

from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.protocol import ErrorCode, Kind, pack_header, unpack_header
from sparkbus.worker import BatchStream, shuffled

from harness import FakeBroker, recv_header, send, wait_for

pytestmark = pytest.mark.timeout(30)


class Broker(FakeBroker):
    """A stand-in broker of a given incarnation that keeps, in order, everything the rank sends it."""

    def __init__(self, context, address, incarnation):
        super().__init__(context, address)
        self.address, self.incarnation = address, incarnation

    def answer(self, hello, incarnation=None, journal=False):
        self.send([pack_header(Kind.WELCOME, req=hello["req"], broker="fake",
                               incarnation=incarnation or self.incarnation, journal=journal, free=0)])

    def welcome(self):
        """Answer the first HELLO; keep what follows up to the CREDIT (a resuming rank's RECLAIM first)."""
        self.hello = self.message(Kind.HELLO)[0]
        self.answer(self.hello)
        self.after_welcome = []
        while True:
            header, frames = self.message()
            self.after_welcome.append((header, frames))
            if header["kind"] == Kind.CREDIT:
                return

    def message(self, kind=None, timeout=5.0):
        """The next message from the rank (of ``kind``; heartbeats skipped), with its frames after the header."""
        while True:
            assert self.sock.poll(timeout * 1000), f"no {kind.name if kind else 'message'} from the rank"
            identity, raw, *frames = self.sock.recv_multipart()
            self.identity = identity
            header = unpack_header(raw)
            if header["kind"] != Kind.HEARTBEAT and kind in (None, header["kind"]):
                return header, frames

    def reclaim(self, timeout=5.0):
        """The rank's next RECLAIM: ``(epoch, lost, entries)``."""
        header, (frame,) = self.message(Kind.RECLAIM, timeout)
        return header["epoch"], header["lost"], protocol.unpack_used(frame, header["entries"])

    def batch(self, part, seq, ids, splits=None, take=None, epoch=0):
        """Send a batch (a pack with ``splits``; a piece of it with ``take``) whose column ``id`` holds ``ids``;
        returns its checksum."""
        frames = codec.encode_batch("s", epoch, part, seq, {"id": np.array(ids, dtype=np.int64)}, splits=splits)
        header = unpack_header(frames[0])
        if take is not None:
            fields = {k: v for k, v in header.items() if k != "kind"}
            frames[0] = pack_header(Kind.BATCH, **fields, take=list(take))
        self.send(frames)
        return header["checksum"]

    def say(self, kind, **fields):
        self.send([pack_header(kind, **fields)])


def join(context, brokers, **options):
    """A BatchStream on ``brokers`` (their HELLOs answered from threads: the constructor waits for WELCOMEs)."""
    threads = [threading.Thread(target=b.welcome) for b in brokers]
    for thread in threads:
        thread.start()
    try:
        return BatchStream([b.address for b in brokers], stream="s", timeout=options.pop("timeout", 10),
                           context=context, **options)
    finally:
        for thread in threads:
            thread.join(10)


class Loop(threading.Thread):
    """A training loop over one epoch in a thread, so that the test can play the broker meanwhile."""

    def __init__(self, stream, steps=None):
        super().__init__(daemon=True)
        self.stream, self.steps, self.ids, self.error = stream, steps, [], None
        self.taken = threading.Semaphore(0)

    def run(self):
        try:
            for batch in self.stream.epoch():
                self.ids.extend(batch["id"].tolist())
                self.taken.release()
        except BaseException as error:       # handed to the test
            self.error = error

    def wait(self, steps):
        for _ in range(steps):
            assert self.taken.acquire(timeout=10), f"the loop took {len(self.ids)} steps, not {steps}"

    def finish(self):
        self.join(10)
        assert not self.is_alive(), "the epoch did not end"
        if self.error is not None:
            raise self.error
        return self.ids


def test_a_restart_without_journal_drops_what_was_held_and_reclaims_what_was_used_from_both_brokers(context):
    """A granted rank used batch 0 and two batches of a pack of four; A restarts without journal. The rank drops the
    pack's two unused batches, tells A and B what it used (the pack in part), and counts the 3 batches A adopts."""
    a = Broker(context, "inproc://recovery-restart-a", "a1")
    b = Broker(context, "inproc://recovery-restart-b", "b1")
    stream = join(context, [a, b], rank=0, size=2)
    with stream:
        c0 = a.batch(0, 0, [0])
        cp = a.batch(0, 1, [10, 11, 12, 13], splits=[1, 1, 1, 1])
        a.say(Kind.STEPS, stream="s", epoch=0, steps=3)
        a.send([pack_header(Kind.ERROR, req=0, reason="unknown rank", code=ErrorCode.UNKNOWN_RANK)])
        loop = Loop(stream)
        loop.start()
        loop.wait(3)
        hello, _ = a.message(Kind.HELLO)
        assert (hello["resume"], hello["incarnation"], hello["got"]) == (True, "a1", 5)
        a.answer(hello, incarnation="a2")                       # restarted, no journal: a loss of "a1"
        used = [(0, 0, 0, 1, c0), (0, 1, 0, 2, cp)]
        assert a.reclaim() == (0, "a1", used)
        assert b.reclaim() == (0, "a1", used)
        # A took its partitions over: it matched the 3 used batches (adopted) and sends the rest of the pack.
        a.batch(0, 1, [10, 11, 112, 113], splits=[1, 1, 1, 1], take=(2, 4))   # the new copy, told apart here
        a.say(Kind.STEPS, stream="s", epoch=0, steps=5, adopted=3)
        a.say(Kind.EPOCH_END, stream="s", epoch=0, batches=2, steps=5)
        b.say(Kind.EPOCH_END, stream="s", epoch=0, batches=0, steps=0)
        assert loop.finish() == [0, 10, 11, 112, 113], "each batch once: the old copies of 12 and 13 were dropped"
        ep = stream.stats.epochs[-1]
        assert (ep.batches, ep.dropped_batches) == (5, 0)


def test_lost_from_another_broker_closes_the_lost_one_and_is_answered_again_with_the_same_reclaim(context):
    a = Broker(context, "inproc://recovery-lost-a", "a1")
    b = Broker(context, "inproc://recovery-lost-b", "b1")
    stream = join(context, [a, b])
    with stream:
        c0 = a.batch(0, 0, [0])
        loop = Loop(stream)
        loop.start()
        loop.wait(1)
        b.say(Kind.LOST, stream="s", epoch=0, lost="a1")        # A is gone for good; B took it over
        assert b.reclaim() == (0, "a1", [(0, 0, 0, 1, c0)])
        b.batch(1, 0, [100])
        b.say(Kind.EPOCH_END, stream="s", epoch=0, batches=1)
        assert loop.finish() == [0, 100], "A's end is no longer waited for"
        assert [broker.address for broker in stream._brokers] == [b.address]
        b.say(Kind.LOST, stream="s", epoch=0, lost="a1")        # it had not heard the RECLAIM: the same again
        b.say(Kind.EPOCH_END, stream="s", epoch=1, batches=0)
        assert list(stream.epoch()) == []
        assert b.reclaim() == (0, "a1", [(0, 0, 0, 1, c0)])
        b.say(Kind.LOST, stream="s", epoch=1, lost="zz")        # an incarnation it never knew: nothing of it
        b.say(Kind.EPOCH_END, stream="s", epoch=2, batches=0)
        assert list(stream.epoch()) == []
        assert b.reclaim() == (1, "zz", [])


def test_a_silent_broker_among_two_is_dropped_and_the_epoch_ends_with_the_other(context):
    a = Broker(context, "inproc://recovery-silent-a", "a1")
    b = Broker(context, "inproc://recovery-silent-b", "b1")
    stream = join(context, [a, b], timeout=1.0, heartbeat=0.1)
    with stream:
        c0 = a.batch(0, 0, [0])
        b.batch(1, 0, [100])
        b.say(Kind.EPOCH_END, stream="s", epoch=0, batches=1)
        loop = Loop(stream)
        loop.start()
        while loop.is_alive():                                  # B answers; A says nothing more
            b.say(Kind.HEARTBEAT)
            loop.join(0.1)
        assert sorted(loop.finish()) == [0, 100]
        assert [broker.address for broker in stream._brokers] == [b.address]
        assert b.reclaim() == (0, "a1", [(0, 0, 0, 1, c0)])
        # the loop waited for A until its silence ended the epoch (about the 1 s timeout): data-wait too
        assert stream.stats.epochs[-1].wait_seconds >= 0.5


def test_the_only_broker_silent_is_a_broker_error_that_says_what_to_do(context):
    a = Broker(context, "inproc://recovery-silent-one", "a1")
    stream = join(context, [a], timeout=0.5, heartbeat=0.1)
    with stream:
        with pytest.raises(BrokerError, match=r"the broker at inproc://recovery-silent-one has been silent for \d+ s "
                           r"\(timeout 0\.5 s\): it is gone or unreachable, and what it held of the epoch with it: "
                           r"restart the brokers and feed the epoch again, or run the brokers with --journal"):
            list(stream.epoch())


def test_adopted_batches_count_as_taken_in_the_grant_the_end_and_the_release(context):
    """The rank used 3 batches of A, lost for good; B adopted them: of B's 5 steps, it takes 2 and keeps 5."""
    a = Broker(context, "inproc://recovery-adopted-a", "a1")
    b = Broker(context, "inproc://recovery-adopted-b", "b1")
    stream = join(context, [a, b], rank=0, size=2)
    with stream:
        used = [(0, 0, 0, 3, a.batch(0, 0, [0, 1, 2], splits=[1, 1, 1]))]
        a.say(Kind.STEPS, stream="s", epoch=0, steps=3)
        loop = Loop(stream)
        loop.start()
        loop.wait(3)
        b.say(Kind.LOST, stream="s", epoch=0, lost="a1")
        assert b.reclaim() == (0, "a1", used)
        for seq in range(3):
            b.batch(0, 10 + seq, [10 + seq])
        b.say(Kind.STEPS, stream="s", epoch=0, steps=5, adopted=3)
        b.say(Kind.RELEASE, stream="s", epoch=0, keep=5, drop=0)
        back, _ = b.message(Kind.RETURN)
        assert (back["ids"], back["kept"]) == ([0, 0, 12, 0], 5)
        b.say(Kind.EPOCH_END, stream="s", epoch=0, batches=5, steps=5)
        assert loop.finish() == [0, 1, 2, 10, 11]


def test_state_dict_mid_epoch_names_what_was_used_and_at_a_boundary_the_next_epoch(context):
    a = Broker(context, "inproc://recovery-state", "a1")
    stream = join(context, [a])
    with stream:
        c0 = a.batch(0, 0, [0])
        cp = a.batch(0, 1, [10, 11, 12], splits=[1, 1, 1])
        a.batch(0, 2, [20])
        a.say(Kind.EPOCH_END, stream="s", epoch=0, batches=5)
        states = []
        for step, _ in enumerate(stream.epoch()):
            if step == 2:
                states.append(stream.state_dict())
        assert states == [{"format": 2, "stream": "s", "rank": 0, "size": 1, "epoch": 0, "steps": 3,
                           "used": [[0, 0, 0, 1, c0], [0, 1, 0, 2, cp]], "cuts": []}]
        assert json.loads(json.dumps(states[0])) == states[0]
        assert stream.state_dict() == {"format": 2, "stream": "s", "rank": 0, "size": 1, "epoch": 1, "steps": 0,
                                       "used": [], "cuts": []}


def test_a_resumed_rank_reclaims_its_position_before_its_credit_and_yields_the_rest(context, caplog):
    c0, cp = (unpack_header(codec.encode_batch("s", 0, 0, seq, {"id": np.array(ids, dtype=np.int64)},
                                               splits=splits)[0])["checksum"]
              for seq, ids, splits in ((0, [0], None), (1, [10, 11, 12], [1, 1, 1])))
    state = {"format": 1, "stream": "s", "rank": 0, "size": 1, "epoch": 0, "steps": 3,
             "used": [[0, 0, 0, 1, c0], [0, 1, 0, 2, cp]]}
    a = Broker(context, "inproc://recovery-resume", "a2")
    with caplog.at_level("INFO", logger="sparkbus.worker"):
        stream = join(context, [a], resume=json.loads(json.dumps(state)))
    assert "rank 0 of stream 's' resumes from its state (resume=) at epoch 0, step 3" in caplog.text
    with stream:
        (reclaim, frames), (credit, _) = a.after_welcome
        assert (reclaim["kind"], reclaim["epoch"], reclaim["lost"]) == (Kind.RECLAIM, 0, "")
        assert credit["kind"] == Kind.CREDIT, "the RECLAIM goes before the first CREDIT"
        assert protocol.unpack_used(frames[0], reclaim["entries"]) == [(0, 0, 0, 1, c0), (0, 1, 0, 2, cp)]
        assert stream.state_dict() == dict(state, format=2, cuts=[]), \
            "before its epoch begins, the state is the one resumed (a format-1 state of sparkbus 0.2, in format 2)"
        a.batch(0, 1, [10, 11, 12], splits=[1, 1, 1], take=(2, 3))
        c2 = a.batch(0, 2, [20])
        a.say(Kind.EPOCH_END, stream="s", epoch=0, batches=2)
        seen, states = [], []
        for batch in stream.epoch():
            seen.extend(batch["id"].tolist())
            states.append(stream.state_dict())
        assert seen == [12, 20]
        assert states[-1] == {"format": 2, "stream": "s", "rank": 0, "size": 1, "epoch": 0, "steps": 5,
                              "used": [[0, 0, 0, 1, c0], [0, 1, 0, 3, cp], [0, 2, 0, 1, c2]], "cuts": []}
        ep = stream.stats.epochs[-1]
        assert (ep.batches, ep.resumed_batches, stream.stats.resumed_batches) == (2, 3, 3)


def test_a_resume_state_of_another_rank_is_refused(context):
    state = {"format": 1, "stream": "s", "rank": 1, "size": 2, "epoch": 0, "steps": 0, "used": []}
    with pytest.raises(ValueError, match=r"resume= has the state of rank 1, but this BatchStream is rank 0: pass "
                       r"each rank its own state_dict\(\)"):
        BatchStream("inproc://recovery-nobody", stream="s", rank=0, size=2, context=context, resume=state)


def test_state_dict_is_refused_while_a_shuffle_buffer_of_the_stream_holds_rows(context):
    a = Broker(context, "inproc://recovery-shuffle", "a1")
    stream = join(context, [a])
    with stream:
        for seq in range(3):
            a.batch(0, seq, [seq])
        a.say(Kind.EPOCH_END, stream="s", epoch=0, batches=3)
        refused = []
        for _ in shuffled(stream.epoch(), 2, seed=0, stream=stream):
            try:
                stream.state_dict()
                refused.append("")
            except ValueError as error:
                refused.append(str(error))
        message = ("a shuffle buffer of stream 's' holds rows of 1 batches that the model has not trained: a state "
                   "mid-epoch would not be exact; take it between epochs, or shuffle with a buffer of one batch")
        assert refused == [message, message, ""], "the last batch is out of the buffer, and the epoch is over"
        assert stream.state_dict() == {"format": 2, "stream": "s", "rank": 0, "size": 1, "epoch": 1, "steps": 0,
                                       "used": [], "cuts": []}


# ---- against the real broker, in process ----------------------------------------------------------------------

def _driver(sockets, broker):
    """A driver's control requests and feed of partitions (4 batches each; ids 100 * part + 10 * seq + row)."""
    control = sockets(zmq.DEALER, broker.config.control)
    push = sockets(zmq.PUSH, broker.config.feed)

    def request(kind, **fields):
        send(control, kind, req=7, **fields)
        return recv_header(control)[0]

    def feed(part, attempt=0, splits=None):
        for seq in range(4):
            ids = np.arange(4) + 100 * part + 10 * seq
            push.send_multipart(codec.encode_batch("s", 0, part, seq, {"id": ids}, attempt=attempt, splits=splits))
        reply = request(Kind.PARTITION_END, stream="s", epoch=0, part=part, attempt=attempt, batches=4, rows=16)
        assert reply["kind"] == Kind.PARTITION_COMMITTED, reply

    return request, feed


def _ids(*parts):
    return sorted(100 * part + 10 * seq + row for part in parts for seq in range(4) for row in range(4))


def test_a_rank_resumed_from_a_checkpoint_trains_the_rest_of_the_epoch_from_the_real_broker(start_broker_thread,
                                                                                          sockets, context):
    broker = start_broker_thread(heartbeat=0.5)
    request, feed = _driver(sockets, broker)
    assert request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=1, delivery="stream")["kind"] == Kind.OK
    feed(0, splits=[1, 1, 2])
    assert request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=1)["kind"] == Kind.OK
    before = []
    with BatchStream(broker.config.ranks, stream="s", context=context, prefetch=1, timeout=10) as first:
        for batch in first.epoch():
            before.extend(batch["id"].tolist())
            if len(before) == 6:             # the checkpoint: pack 0 whole, pack 1's second batch in hand
                state = first.state_dict()
            if len(before) == 12:            # the job dies three batches later
                break
    assert ([e[:4] for e in state["used"]], state["steps"]) == ([[0, 0, 0, 3], [0, 1, 0, 2]], 5)
    with BatchStream(broker.config.ranks, stream="s", context=context, prefetch=1, timeout=10,
                     resume=state) as second:
        assert request(Kind.EPOCH_RECOVER, stream="s", epoch=0, partitions=1, delivery="stream", carries=[0, 1],
                       recovered=[0, 1], lost=[""], reset=True)["kind"] == Kind.OK
        feed(0, attempt=1, splits=[1, 1, 2])
        assert request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=1)["kind"] == Kind.OK
        after = [n for batch in second.epoch() for n in batch["id"].tolist()]
        assert (second.stats.epochs[-1].resumed_batches, second.stats.epochs[-1].batches) == (5, 7)
    assert before[:6] == [0, 1, 2, 3, 10, 11] and sorted(before[:6] + after) == _ids(0), \
        "relative to the checkpoint, each row once: the three batches trained after it are trained again"


def test_a_broker_lost_for_good_is_taken_over_and_every_row_is_trained_once(start_broker_thread, sockets, context):
    """Two real brokers; the driver gives A's partition to B (EPOCH_RECOVER), B tells the rank (LOST), the rank
    closes A, says what it used of A (RECLAIM), and B delivers only the rest."""
    a, b = start_broker_thread(heartbeat=0.5), start_broker_thread(heartbeat=0.5)
    (request_a, feed_a), (request_b, feed_b) = _driver(sockets, a), _driver(sockets, b)
    for request in (request_a, request_b):
        assert request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=2, delivery="stream")["kind"] == Kind.OK
    feed_a(0, splits=[1, 1, 2])
    feed_b(1)
    seen = []
    with BatchStream([a.config.ranks, b.config.ranks], stream="s", context=context, prefetch=1, timeout=10) as rank:
        for batch in rank.epoch():
            seen.extend(batch["id"].tolist())
            if len(seen) == 12:
                assert request_b(Kind.EPOCH_RECOVER, stream="s", epoch=0, partitions=2, delivery="stream",
                                 carries=[0, 2], recovered=[0, 1], lost=[a.incarnation], reset=False)["kind"] == Kind.OK
                feed_b(0, attempt=1, splits=[1, 1, 2])
                assert request_b(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=2)["kind"] == Kind.OK
        assert [broker.address for broker in rank._brokers] == [b.config.ranks]
    assert sorted(seen) == _ids(0, 1)


def test_a_batch_pooled_from_another_rank_is_recorded_as_the_batch_of_its_message_it_was():
    """At an MPI epoch's end batches move between ranks re-encoded: the one that trains it records it under the
    message's index and checksum as it first arrived, as RECLAIM and state_dict need."""
    from sparkbus.worker.rebalance import pack_batch, unpack_batch

    frames = codec.encode_batch("s", 0, 3, 7, {"id": np.arange(6)}, splits=[2, 4])
    arrived = unpack_header(frames[0])
    header, columns = unpack_batch(pack_batch(dict(arrived, rows=4, index=1), {"id": np.arange(2, 6)}))
    assert (header["part"], header["seq"], header["index"], header["checksum"]) == (3, 7, 1, arrived["checksum"])
    assert columns["id"].tolist() == [2, 3, 4, 5]


def test_a_rank_refuses_a_broker_of_version_5_saying_which_versions_met(context):
    """A rank speaks its version and the one before (6); a version-5 broker (no recovery) is refused with a message,
    not served in 5 as it was while 6 was the newest version."""
    a = Broker(context, "inproc://recovery-v5", "a1")

    def answer_in_5():
        first, _ = a.message(Kind.HELLO)
        assert first["v"] == protocol.VERSION
        a.send([pack_header(Kind.ERROR, v=5, req=0, reason="version", code=ErrorCode.VERSION)])

    answering = threading.Thread(target=answer_in_5)
    answering.start()
    started = time.monotonic()
    with pytest.raises(Exception, match="5"):
        BatchStream(a.address, stream="s", timeout=10, context=context)
    answering.join(10)
    assert time.monotonic() - started < 10


def test_a_broker_lost_after_it_ended_the_epoch_lost_the_next_one_of_which_the_rank_used_nothing(context):
    a = Broker(context, "inproc://recovery-ended-a", "a1")
    b = Broker(context, "inproc://recovery-ended-b", "b1")
    stream = join(context, [a, b])
    with stream:
        a.batch(0, 0, [0])
        a.say(Kind.EPOCH_END, stream="s", epoch=0, batches=1)
        loop = Loop(stream)
        loop.start()
        loop.wait(1)
        wait_for(lambda: stream._brokers[0].ended == 0, 10, "A's end of epoch 0 read")
        b.batch(1, 0, [100])
        loop.wait(1)
        b.say(Kind.LOST, stream="s", epoch=1, lost="a1")
        assert b.reclaim() == (1, "a1", [])
        b.say(Kind.EPOCH_END, stream="s", epoch=0, batches=1)
        assert sorted(loop.finish()) == [0, 100]
        assert [broker.address for broker in stream._brokers] == [b.address]


def test_a_batch_of_a_later_epoch_from_a_broker_that_never_ended_the_rank_s_epoch_is_a_loud_error(context):
    """A broker restarted without journal after its feed() had returned: nobody fed its epoch again, and it goes on
    with the next. Taking those batches into this epoch would mix epochs and leave the steps unequal: an error."""
    a = Broker(context, "inproc://recovery-skipped-epoch", "a1")
    stream = join(context, [a])
    with stream:
        a.batch(0, 0, [0])
        loop = Loop(stream)
        loop.start()
        loop.wait(1)
        a.batch(0, 0, [100], epoch=1)              # epoch 1, and epoch 0 never ended
        loop.join(10)
        assert not loop.is_alive() and isinstance(loop.error, BrokerError), loop.error
        assert "sent a batch of epoch 1 while this rank is in epoch 0, which that broker never ended" in \
            str(loop.error) and "--journal" in str(loop.error)
        assert loop.ids == [0]


def test_rows_of_a_batch_are_a_view_counted_as_a_cut_saved_in_the_state_and_reclaimed_on_resume(context):
    """A piece of an epoch's remainder (``cut``): the rank yields those rows only, counts the step in
    ``cut_batches``, names the rows in its state (format 2, ``cuts``), and a rank resumed from that state sends
    them in its RECLAIM's ``cuts``."""
    a = Broker(context, "inproc://recovery-cut", "c1")
    stream = join(context, [a])
    with stream:
        frames = codec.encode_batch("s", 0, 0, 0, {"id": np.arange(10, dtype=np.int64)})
        header = unpack_header(frames[0])
        frames[0] = pack_header(Kind.BATCH, **{k: v for k, v in header.items() if k != "kind"}, cut=[3, 7])
        a.send(frames)
        a.say(Kind.EPOCH_END, stream="s", epoch=0, batches=1)
        seen, states = [], []
        for batch in stream.epoch():
            seen.append(batch["id"])
            states.append(stream.state_dict())
        assert [ids.tolist() for ids in seen] == [[3, 4, 5, 6]]
        assert not seen[0].flags.owndata, "a view of the received frame, not a copy"
        ep = stream.stats.epochs[-1]
        assert (ep.batches, ep.rows, ep.cut_batches, ep.dropped_batches) == (1, 4, 1, 0)
        assert states == [{"format": 2, "stream": "s", "rank": 0, "size": 1, "epoch": 0, "steps": 1, "used": [],
                           "cuts": [[0, 0, 0, 3, 7, header["checksum"]]]}]
    b = Broker(context, "inproc://recovery-cut-resume", "c2")
    resumed = join(context, [b], resume=json.loads(json.dumps(states[0])))
    with resumed:
        (reclaim, frames), (credit, _) = b.after_welcome
        assert (reclaim["kind"], reclaim["entries"], credit["kind"]) == (Kind.RECLAIM, 0, Kind.CREDIT)
        assert reclaim["cuts"] == [0, 0, 0, 3, 7, header["checksum"]]
        assert resumed.state_dict()["cuts"] == [[0, 0, 0, 3, 7, header["checksum"]]]
    with pytest.raises(ValueError, match="malformed cut"):
        BatchStream("inproc://nowhere", context=context, stream="s",
                    resume=dict(states[0], cuts=[[0, 0, 0, 7, 3, 1]]))


def test_every_ranks_state_resumes_a_group_of_another_size_and_a_bad_list_is_refused(context):
    """``resume=[...]``: the states of ranks 0..N-1 of one checkpoint, merged (what they had used together), for a
    rank of a group of any size; it says which epoch it resumes in its HELLO (``resumes``)."""
    states = [{"format": 2, "stream": "s", "rank": r, "size": 2, "epoch": 3, "steps": 4,
               "used": [[r, 0, 0, 2, 11 + r]], "cuts": [[5, 0, 0, 0, 3, 7]] if r else []} for r in range(2)]
    a = Broker(context, "inproc://resume-all", "r1")
    stream = join(context, [a], resume=json.loads(json.dumps(states)), rank=2, size=3)
    with stream:
        assert a.hello["resumes"] == 3 and a.hello["size"] == 3
        (reclaim, frames), _ = a.after_welcome
        assert protocol.unpack_used(frames[0], reclaim["entries"]) == [(0, 0, 0, 2, 11), (1, 0, 0, 2, 12)]
        assert reclaim["cuts"] == [5, 0, 0, 0, 3, 7]
        merged = stream.state_dict()
        assert (merged["rank"], merged["size"], merged["epoch"], merged["steps"]) == (2, 3, 3, 4)
    for bad, message in [([states[0]], "ranks 0..N-1"), ([states[0], dict(states[1], epoch=4)], "at one epoch"),
                         ([], "not an empty list"), ([states[0], states[0]], "ranks 0..N-1")]:
        with pytest.raises(ValueError, match=message):
            BatchStream("inproc://nowhere", context=context, stream="s", rank=0, size=3, resume=bad)
    with pytest.raises(ValueError, match="every rank's as a list"):
        BatchStream("inproc://nowhere", context=context, stream="s", rank=0, size=3, resume=states[0])
