"""The driver's side of a recovery from Spark's lineage (docs/design/RECOVERY.md, "The driver"): the routes of
the re-fed partitions, EPOCH_RECOVER's fields, the watch, and the loop against fake brokers (ROUTER sockets in
threads answering as the design says). No Spark: the jobs are fakes too."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from sparkbus.broker.client import ControlClient
from sparkbus.feeder.epochs import feed_epochs, resumed_epoch
from sparkbus.feeder.jobs import FeedJob
from sparkbus.feeder.recovery import EpochFeed, all_lost_error
from sparkbus.feeder.routes import (
    BrokerEpoch,
    Partitions,
    Routes,
    plan_recovery,
    recover_fields,
    resume_plan,
    spread_plan,
    takeover_brokers,
)
from sparkbus.feeder.watch import BrokerWatch, Loss
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.protocol import Kind, pack_header, pack_ranges, unpack_header

pytestmark = pytest.mark.timeout(30)


def epoch_at(committed=(), seen=(), closed=False) -> BrokerEpoch:
    return BrokerEpoch(known=True, closed=closed, partitions=8, committed=frozenset(committed),
                       seen=frozenset(seen) | frozenset(committed))


# ---- routes ---------------------------------------------------------------------------------------------------

def test_a_partition_seen_at_a_live_broker_goes_back_there():
    states = {0: epoch_at(committed={0}, seen={2}), 1: epoch_at()}
    plan = plan_recovery(3, 6, live=[0, 1], lost=[2], states=states)
    assert plan.routes.fixed[2] == 0
    assert 2 not in plan.recovered[0]          # its own partition, not a lost broker's


def test_the_partitions_of_a_broker_gone_go_to_one_takeover_the_first_live_broker():
    states = {0: epoch_at(committed={0, 2}), 2: epoch_at(committed={4})}
    plan = plan_recovery(3, 6, live=[0, 2], lost=[1], states=states)
    assert plan.takeover == {1: 0}
    assert plan.routes == Routes({1: 0, 3: 0, 5: 0}, 6)
    assert plan.carries == {0: Partitions(frozenset({0, 1, 2, 3, 5})), 2: Partitions(frozenset({4}))}
    assert plan.recovered == {0: Partitions(frozenset({1, 3, 5})), 2: Partitions(frozenset())}


def test_a_restarted_broker_is_its_own_takeover():
    states = {0: epoch_at(committed={0, 2}), 1: BrokerEpoch()}      # 1 restarted: it knows nothing
    plan = plan_recovery(2, 4, live=[0, 1], lost=[1], states=states)
    assert plan.takeover == {1: 1}
    assert plan.routes == Routes({1: 1, 3: 1}, 4)
    assert plan.recovered[1] == Partitions(frozenset({1, 3}))


def test_committed_partitions_are_not_fed_again_and_unstarted_ones_go_to_the_first_losts_takeover():
    # 0 and 1 live; 2 gone. Partition 3's home (0) is live, and no broker saw it: the takeover of broker 2 takes it
    states = {0: epoch_at(committed={0}), 1: epoch_at(committed={1})}
    plan = plan_recovery(3, 4, live=[0, 1], lost=[2], states=states)
    assert plan.routes.fixed == {2: 0, 3: 0}
    assert plan.routes.partitions() == [2, 3]


def test_the_takeover_passes_over_a_broker_whose_epoch_is_closed():
    assert takeover_brokers([2], [0, 1], closed=[0]) == {2: 1}
    assert takeover_brokers([2], [0, 1], closed=[0, 1]) == {2: 0}
    assert takeover_brokers([0, 2], [0, 1]) == {0: 0, 2: 0}      # the restarted one is live: the first


def test_what_was_recovered_before_stays_recovered_at_its_broker():
    states = {0: epoch_at(committed={0}, seen={1, 3}), 1: BrokerEpoch()}
    before = {0: Partitions(frozenset({1, 3}))}
    plan = plan_recovery(2, 4, live=[0, 1], lost=[1], states=states, recovered_before=before)
    assert plan.routes.fixed == {1: 0, 2: 1, 3: 0}
    assert plan.recovered == {0: Partitions(frozenset({1, 3})), 1: Partitions(frozenset({2}))}


def test_an_unknown_partition_count_gives_the_rest_to_the_first_losts_takeover():
    states = {0: epoch_at(committed={0, 2}, seen={4})}
    plan = plan_recovery(2, None, live=[0], lost=[1], states=states)
    assert plan.routes == Routes({1: 0, 3: 0, 4: 0}, 5, 0)
    assert [plan.routes.route(p) for p in (0, 1, 2, 4, 5, 999)] == [None, 0, None, 0, 0, 0]
    fields = recover_fields(plan, 0, "s", 3, None, "stream", ["inc-1"])
    assert fields["carries"] == [0, 10_000_000]
    assert fields["recovered"] == [1, 2, 3, 4, 5, 10_000_000]


def test_epoch_recover_carries_ranges_the_lost_incarnations_and_no_reset():
    states = {0: epoch_at(committed={0, 2}), 1: BrokerEpoch()}
    plan = plan_recovery(2, 4, live=[0, 1], lost=[1], states=states)
    assert recover_fields(plan, 0, "train", 7, 4, "atomic", ["x1"]) == dict(
        stream="train", epoch=7, partitions=4, delivery="atomic", carries=[0, 1, 2, 3], recovered=[], lost=["x1"],
        reset=False)
    assert recover_fields(plan, 1, "train", 7, 4, "atomic", ["x1"]) == dict(
        stream="train", epoch=7, partitions=4, delivery="atomic", carries=[1, 2, 3, 4], recovered=[1, 2, 3, 4],
        lost=["x1"], reset=False)


def test_a_resume_routes_every_partition_home_and_recovers_all_of_them_after_a_reset():
    plan = resume_plan(2, 5)
    assert plan.routes == Routes({0: 0, 1: 1, 2: 0, 3: 1, 4: 0}, 5)
    assert recover_fields(plan, 0, "train", 2, 5, "stream", [""], reset=True) == dict(
        stream="train", epoch=2, partitions=5, delivery="stream", carries=[0, 1, 2, 3, 4, 5],
        recovered=[0, 1, 2, 3, 4, 5], lost=[""], reset=True)
    assert recover_fields(plan, 1, "train", 2, 5, "stream", [""], reset=True)["carries"] == [1, 2, 3, 4]


def test_a_new_epoch_without_a_gone_broker_is_routed_over_the_live_ones_and_recovers_nothing():
    plan = spread_plan([0, 2], 5)                   # broker 1 of 3 is gone for good
    assert plan.routes == Routes({0: 0, 1: 2, 2: 0, 3: 2, 4: 0}, 5)
    assert recover_fields(plan, 2, "train", 4, 5, "stream", []) == dict(
        stream="train", epoch=4, partitions=5, delivery="stream", carries=[1, 2, 3, 4], recovered=[], lost=[],
        reset=False)
    unknown = spread_plan([1], None)                # Spark Connect, the count not known yet: all to one broker
    assert unknown.routes.route(0) == 1 and unknown.routes.route(10_000) == 1
    assert recover_fields(unknown, 1, "train", 4, None, "stream", [])["carries"] == [0, 10_000_000]


def test_the_error_when_no_broker_is_left_says_what_to_do():
    one = all_lost_error("train", 3, ["tcp://a:5557"], [Loss(0, "i0", True)], 5.0)
    assert str(one) == ("stream 'train' epoch 3 cannot be fed: the broker at tcp://a:5557 has not answered for 5 s "
                        "and it is the stream's only broker, so no broker is left to feed its partitions to again. "
                        "If a broker still runs (only this driver's link to it failed), feed the same epoch again once "
                        "it answers: it keeps what it holds. If the brokers are gone, restart them and feed the data "
                        "again as a new epoch (or a new stream), or run the brokers with --journal to survive "
                        "restarts")
    every = all_lost_error("train", 3, ["tcp://a:5557", "tcp://b:5557"], [Loss(0, "i0", True), Loss(1, "i1", True)],
                           5.0)
    assert "every broker of the feed is lost (tcp://a:5557, tcp://b:5557)" in str(every)
    assert "run the brokers with --journal" in str(every)


# ---- fake brokers ---------------------------------------------------------------------------------------------

class FakeBroker:
    """A control socket that answers as a v6 broker would, from the state the test gives it."""

    def __init__(self, incarnation: str, partitions: int = 4):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.incarnation, self.journal, self.partitions = incarnation, False, partitions
        self.known, self.closed, self.ended = True, False, False
        self.committed: set[int] = set()
        self.rows_in = 0
        self.mute = False
        self.answered = 0.0
        self.requests: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def restart(self, incarnation: str, journal: bool = False) -> None:
        self.incarnation, self.journal = incarnation, journal
        if not journal:
            self.known, self.committed, self.rows_in = False, set(), 0

    def kinds(self) -> list[Kind]:
        return [r["kind"] for r in self.requests if r["kind"] != Kind.HELLO]

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, frame = self.sock.recv_multipart()
            header = unpack_header(frame)
            if self.mute:
                continue
            self.requests.append(header)
            self.answered = time.monotonic()        # before the last answer left: the watch heard it later
            self.sock.send_multipart([ident, self._answer(header)])

    def _answer(self, h: dict) -> bytes:
        kind = h["kind"]
        if kind == Kind.HELLO:
            return pack_header(Kind.WELCOME, req=h["req"], broker="fake", incarnation=self.incarnation,
                               journal=self.journal, free=1 << 30)
        if kind == Kind.EPOCH_QUERY:
            return pack_header(Kind.OK, req=h["req"], known=self.known, closed=self.closed, ended=self.ended,
                               delivered=False, partitions=self.partitions, committed=pack_ranges(self.committed),
                               seen=pack_ranges(self.committed), incarnation=self.incarnation, journal=self.journal)
        if kind == Kind.EPOCH_RECOVER:
            self.known = True
        if kind == Kind.EPOCH_CLOSE:
            self.closed = True
        if kind == Kind.STATS_REQUEST:
            stats = {"streams": {"s": {"epochs": {"0": {"rows_in": self.rows_in}}}}}
            return pack_header(Kind.STATS_REPLY, req=h["req"], stats=stats)
        return pack_header(Kind.OK, req=h["req"], diverged=[])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def fakes():
    made: list[FakeBroker] = []
    clients: list[ControlClient] = []

    def make(*incarnations: str) -> tuple[list[FakeBroker], list[ControlClient]]:
        brokers = [FakeBroker(i) for i in incarnations]
        made.extend(brokers)
        clients.extend(ControlClient(b.address, 2.0) for b in brokers)
        return brokers, clients[-len(brokers):]

    yield make
    for client in clients:
        client.close()
    for broker in made:
        broker.close()


def welcomes(clients):
    return [c.hello("feeder", "s") for c in clients]


def wait_until(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---- the watch ------------------------------------------------------------------------------------------------

def test_the_watch_finds_a_broker_restarted_without_journal_and_cancels(fakes):
    (one, two), clients = fakes("a0", "b0")
    cancelled = threading.Event()
    with BrokerWatch([one.address, two.address], welcomes(clients), "s", timeout=5.0, interval=0.05) as watch:
        watch.start(on_loss=cancelled.set)
        two.restart("b1")
        assert cancelled.wait(10)
        assert watch.losses == [Loss(1, "b0", False)]
        assert watch.live() == [0, 1]
        assert watch.lost_incarnations() == ["b0"]


def test_a_restart_with_a_journal_is_not_a_loss(fakes):
    (one,), clients = fakes("a0")
    watch = BrokerWatch([one.address], welcomes(clients), "s", timeout=5.0, interval=0.05)
    one.restart("a1", journal=True)
    assert watch.sweep(clients) == []
    assert watch.losses == []
    one.restart("a2")
    assert watch.sweep(clients) == [Loss(0, "a1", False)]


def test_the_watch_finds_a_broker_silent_for_the_timeout(fakes):
    (one, two), clients = fakes("a0", "b0")
    cancelled = threading.Event()
    with BrokerWatch([one.address, two.address], welcomes(clients), "s", timeout=0.4, interval=0.05) as watch:
        watch.start(on_loss=cancelled.set)
        one.mute = True
        assert cancelled.wait(10)
        # silent for the timeout: from the broker's last answer (which may have left just before it was muted)
        assert time.monotonic() - one.answered >= 0.4
        assert watch.losses == [Loss(0, "a0", True)]
        assert watch.live() == [1]


def test_silence_shorter_than_the_timeout_is_not_a_loss():
    watch = BrokerWatch(["tcp://127.0.0.1:1"], [{"incarnation": "a"}], "s", timeout=10.0)
    assert watch.observe(0, None) is None
    assert watch.observe(0, None, now=time.monotonic() + 11) == Loss(0, "a", True)
    assert watch.observe(0, {"incarnation": "b"}) is None        # gone stays gone for this feed
    assert watch.live() == []


# ---- the loop -------------------------------------------------------------------------------------------------

class FakeCancel:
    def __init__(self):
        self.event = threading.Event()

    def cancel(self):
        self.event.set()


def test_one_of_two_brokers_restarted_is_recovered_and_closed_with_what_each_committed(fakes):
    (one, two), clients = fakes("a0", "b0")
    cancel = FakeCancel()
    reruns = []

    def collect():
        one.committed, one.rows_in = {0, 2}, 20
        two.committed = {1}
        two.restart("b1")                    # without journal: partition 1's commit there is gone
        assert cancel.event.wait(10)
        raise RuntimeError("job cancelled")

    def rerun(routes):
        reruns.append(routes)
        for part, broker in routes.fixed.items():
            (one, two)[broker].committed.add(part)
            (one, two)[broker].rows_in += 10
        return [(p, 2, 10, 100, 0.1, b) for p, b in routes.fixed.items()]

    feed = EpochFeed(clients, welcomes(clients), "s", 0, "stream", 5.0, cancel, interval=0.05)
    outcome = feed.run(FeedJob(4, collect, rerun))
    assert reruns == [Routes({1: 1, 3: 1}, 4)]
    recovers = [[r for r in b.requests if r["kind"] == Kind.EPOCH_RECOVER] for b in (one, two)]
    assert [(r["carries"], r["recovered"], r["lost"], r["reset"], r["partitions"]) for r in recovers[0]] == [
        ([0, 1, 2, 3], [], ["b0"], False, 4)]
    assert [(r["carries"], r["recovered"], r["lost"], r["reset"]) for r in recovers[1]] == [
        ([1, 2, 3, 4], [1, 2, 3, 4], ["b0"], False)]
    closes = [[(r["partitions"], r["expected"]) for r in b.requests if r["kind"] == Kind.EPOCH_CLOSE]
              for b in (one, two)]
    assert closes == [[(4, 2)], [(4, 2)]]
    assert outcome.shares == (2, 2)
    assert outcome.partitions == 4
    assert outcome.held is None          # the first job was cancelled: partitions 0 and 2 have no report
    assert [r.partition for r in outcome.reports] == [1, 3]


def test_a_feed_without_losses_closes_as_before(fakes):
    (one,), clients = fakes("a0")
    one.rows_in = 30

    def collect():
        one.committed = {0, 1, 2}
        return [(p, 1, 10, 100, 0.1, 0) for p in range(3)]

    feed = EpochFeed(clients, welcomes(clients), "s", 0, "stream", 5.0, FakeCancel(), interval=0.05)
    outcome = feed.run(FeedJob(3, collect, lambda routes: pytest.fail("no recovery")))
    assert one.kinds() == [Kind.STATS_REQUEST, Kind.EPOCH_CLOSE]
    assert (outcome.partitions, outcome.shares, outcome.held) == (3, (3,), 30)


def test_the_only_broker_gone_fails_the_feed_saying_what_to_do(fakes):
    (one,), clients = fakes("a0")
    cancel = FakeCancel()

    def collect():
        one.mute = True
        assert cancel.event.wait(10)
        raise RuntimeError("job cancelled")

    feed = EpochFeed(clients, welcomes(clients), "s", 4, "stream", 0.3, cancel, interval=0.05)
    with pytest.raises(BrokerError, match=r"^stream 's' epoch 4 cannot be fed: the broker at tcp://127\.0\.0\.1:\d+ "
                                          r"has not answered for 0\.3 s and it is the stream's only broker"):
        feed.run(FeedJob(2, collect, lambda routes: pytest.fail("no recovery")))


def test_a_second_loss_during_the_recovery_job_goes_round_again(fakes):
    (one, two, three), clients = fakes("a0", "b0", "c0")
    cancel = FakeCancel()
    reruns = []

    def collect():
        one.committed, two.committed, three.committed = {0}, {1}, {2}
        three.restart("c1")
        assert cancel.event.wait(10)
        raise RuntimeError("job cancelled")

    def rerun(routes):
        reruns.append(routes)
        if len(reruns) == 1:
            cancel.event.clear()
            two.restart("b1")                 # lost while the recovery job runs
            assert cancel.event.wait(10)
            raise RuntimeError("job cancelled")
        for part, broker in routes.fixed.items():
            (one, two, three)[broker].committed.add(part)
        return [(p, 1, 10, 100, 0.1, b) for p, b in routes.fixed.items()]

    feed = EpochFeed(clients, welcomes(clients), "s", 0, "stream", 5.0, cancel, interval=0.05)
    outcome = feed.run(FeedJob(6, collect, rerun))
    assert reruns == [Routes({2: 2, 3: 2, 4: 2, 5: 2}, 6), Routes({1: 1, 2: 2, 3: 1, 4: 1, 5: 2}, 6)]
    last = [r for r in one.requests if r["kind"] == Kind.EPOCH_RECOVER][-1]
    assert last["lost"] == ["c0", "b0"]
    assert outcome.shares == (1, 3, 2)


def test_a_broker_that_cannot_recover_fails_loudly_as_before(fakes):
    (one,), clients = fakes("a0")
    cancel = FakeCancel()
    real = one._answer

    def older(h):                 # a broker without EPOCH_QUERY answers it as an unexpected kind
        if h["kind"] == Kind.EPOCH_QUERY:
            return msgpack.packb({"v": 6, "kind": int(Kind.ERROR), "req": h["req"], "code": 3, "reason": "no"})
        return real(h)

    one._answer = older

    def collect():
        one.restart("a1")
        assert cancel.event.wait(10)
        raise RuntimeError("job cancelled")

    feed = EpochFeed(clients, welcomes(clients), "s", 0, "stream", 5.0, cancel, interval=0.05)
    with pytest.raises(BrokerError, match="runs without --journal: the batches it held are lost"):
        feed.run(FeedJob(2, collect, lambda routes: pytest.fail("no recovery")))


def test_a_resume_resets_every_broker_and_re_feeds_every_partition_home(fakes):
    (one, two), clients = fakes("a0", "b0")

    def rerun(routes):
        for part, broker in routes.fixed.items():
            (one, two)[broker].committed.add(part)
        return [(p, 1, 10, 100, 0.1, b) for p, b in routes.fixed.items()]

    feed = EpochFeed(clients, welcomes(clients), "s", 0, "stream", 5.0, FakeCancel(), interval=0.05)
    outcome = feed.resume(FeedJob(3, lambda: pytest.fail("no first job"), rerun))
    recovers = [[(r["carries"], r["recovered"], r["lost"], r["reset"]) for r in b.requests
                 if r["kind"] == Kind.EPOCH_RECOVER] for b in (one, two)]
    assert recovers == [[([0, 1, 2, 3], [0, 1, 2, 3], [""], True)], [([1, 2], [1, 2], [""], True)]]
    assert outcome.shares == (2, 1)
    assert [r.partition for r in outcome.reports] == [0, 1, 2]


# ---- resume: which epoch ------------------------------------------------------------------------------------------

def test_a_resume_starts_at_the_states_epoch_of_the_same_stream():
    state = {"format": 1, "stream": "train", "rank": 0, "size": 2, "epoch": 3, "steps": 7, "used": []}
    assert resumed_epoch(state, "train") == 3
    assert resumed_epoch(5, "train") == 5
    with pytest.raises(ValueError, match="the resume state is of stream 'train', not 'val'"):
        resumed_epoch(state, "val")
    with pytest.raises(TypeError, match="not bool"):
        resumed_epoch(True, "train")
    with pytest.raises(ValueError, match="negative"):
        resumed_epoch(-1, "train")


def test_feed_epochs_refuses_a_resume_outside_the_epochs_it_feeds():
    with pytest.raises(ValueError, match="resume at epoch 9 is not one of the epochs to feed, 0 to 4"):
        feed_epochs(object(), "tcp://127.0.0.1:1", 5, shuffle=False, resume=9)


# ---- epochs fed before ----------------------------------------------------------------------------------------

def test_epochs_fed_before_are_fed_again_after_a_loss_until_every_broker_delivered_them(fakes, monkeypatch):
    from sparkbus.feeder import epochs

    (one, two), _ = fakes("a0", "b0")
    refed = []
    monkeypatch.setattr(epochs, "feed_watched", lambda data, address, stream, epoch, losses, **kw: refed.append(
        (data, stream, epoch, losses, kw)))
    fed = epochs.FedEpochs([one.address, two.address], "s", {"control": [one.address, two.address],
                                                                     "timeout": 5.0})
    try:
        fed.add(0, "frame 0")
        fed.add(1, "frame 1")
        fed.check()
        assert (refed, sorted(fed.pending)) == ([], [0, 1])
        one.ended = True
        fed.check()
        assert sorted(fed.pending) == [0, 1]            # ended at one broker, not at both
        two.restart("b1")
        wait_until(lambda: fed.watch.losses)
        two.ended = True
        fed.check()
        kw = {"control": [one.address, two.address], "timeout": 5.0}
        lost = [Loss(1, "b0", False)]
        assert refed == [("frame 0", "s", 0, lost, kw), ("frame 1", "s", 1, lost, kw)]
        assert fed.pending == {}
        fed.check()
        fed.recover([Loss(1, "b0", False)])             # the same loss, seen by the next epoch's feed
        assert len(refed) == 2                          # a loss is recovered once
    finally:
        fed.close()
