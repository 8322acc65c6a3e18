"""A feed that survives losing a broker: the watch, and the loop that re-feeds.

docs/design/RECOVERY.md ("The driver") is the contract. In short:

- :class:`BrokerWatch` runs beside a feed's Spark job: a thread with its own control sockets says HELLO to every
  broker every second. A broker whose incarnation changed without a journal, or that has been silent for the
  feed's ``timeout``, is **lost**, and the watch cancels the job (:class:`JobCancel`).
- The driver then asks each live broker what it has of the epoch (``EPOCH_QUERY``), and
  :func:`feeder.routes.plan_recovery` fixes a route for every partition no live broker committed: where it was
  seen, else the takeover broker of the lost one (the restarted broker itself, else the first live broker).
- ``EPOCH_RECOVER`` tells each live broker what it carries now; the recovery job re-feeds those partitions only
  (classic: ``SparkContext.runJob``; Spark Connect: every partition, the others send nothing). A loss during it
  goes round again, a bounded number of times (:class:`EpochFeed`).
- ``EPOCH_CLOSE`` on every live broker with the partitions it committed.

A resume from a checkpoint (issue 18 §3) is the same path, after an ``EPOCH_RECOVER(reset=True)`` that drops the
epoch's state at every broker and names the loss ``""`` (:meth:`EpochFeed.run` with ``resume``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sparkbus.broker.client import ControlClient
from sparkbus.feeder.commits import Committer, ReportChannel
from sparkbus.feeder.routes import (
    BrokerEpoch,
    Partitions,
    Plan,
    Routes,
    plan_recovery,
    read_query,
    recover_fields,
    resume_plan,
    spread_plan,
)
from sparkbus.feeder.task import PartitionReport
from sparkbus.wire.errors import BrokerError, FeedError
from sparkbus.wire.protocol import ErrorCode, Kind

log = logging.getLogger("sparkbus.feeder")

WATCH_INTERVAL = 1.0        # seconds between the watch's HELLOs to each broker
RESUMED = ""                # the loss a resume from a checkpoint names (docs/design/RECOVERY.md "Names")
# Brokers that cannot recover (an older broker) answer EPOCH_QUERY/EPOCH_RECOVER with one of these
CANNOT_RECOVER = (ErrorCode.UNEXPECTED_KIND, ErrorCode.MALFORMED, ErrorCode.VERSION)


class Loss(NamedTuple):
    """A broker that lost the feed's state: its index in the feed's list, the incarnation lost, and whether it
    is gone (silent past the timeout) rather than restarted."""

    broker: int
    incarnation: str
    gone: bool


class BrokerWatch:
    """Which of a feed's brokers are live, and which incarnations were lost, told by HELLOs.

    :meth:`start` runs a thread that says HELLO to every broker every ``interval`` with its own sockets (ZeroMQ
    sockets are not thread-safe) and calls ``on_loss`` (any thread may call it) after it saw a new loss;
    :meth:`sweep` does the same once, in the calling thread, with the caller's clients, waiting for a silent broker
    until its ``timeout`` is up: what the driver does after a job ended, to know for certain.

    Args:
        controls: the brokers' control addresses, in the feed's order.
        welcomes: each broker's WELCOME when the feed began (their incarnations are the ones known).
        stream: the feed's stream (its HELLOs name it).
        timeout: seconds of silence after which a broker is gone.
    """

    def __init__(self, controls: Sequence[str], welcomes: Sequence[Mapping[str, Any]], stream: str,
                 timeout: float, key: str | None = None, broker_key: str | None = None,
                 interval: float = WATCH_INTERVAL) -> None:
        self.controls = list(controls)
        self.stream = stream
        self.timeout = timeout
        self.interval = interval
        self._keys = (key, broker_key)
        now = time.monotonic()
        self._known = [str(w.get("incarnation", "")) for w in welcomes]
        self._heard = [now] * len(self.controls)
        self._gone: set[int] = set()
        self.losses: list[Loss] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_loss: Callable[[], None] | None = None

    # ---- what the watch knows -----------------------------------------------------------------------------

    def live(self) -> list[int]:
        """The brokers not gone, in the feed's order (a restarted one is live)."""
        with self._lock:
            return [i for i in range(len(self.controls)) if i not in self._gone]

    def lost_incarnations(self) -> list[str]:
        """Every incarnation lost so far in this feed, in the order they were lost."""
        with self._lock:
            return [loss.incarnation for loss in self.losses]

    def lost_brokers(self) -> list[int]:
        """The brokers that lost the feed's state at least once (restarted or gone), in the feed's order."""
        with self._lock:
            return sorted({loss.broker for loss in self.losses})

    def observe(self, index: int, welcome: Mapping[str, Any] | None, now: float | None = None) -> Loss | None:
        """Take in one broker's answer to a HELLO (or an EPOCH_QUERY), or its silence (None).

        Returns:
            The new :class:`Loss`, if this answer (or silence) is one.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            if index in self._gone:
                return None
            if welcome is None:
                if now - self._heard[index] < self.timeout:
                    return None
                self._gone.add(index)
                loss = Loss(index, self._known[index], True)
            else:
                self._heard[index] = now
                incarnation = str(welcome.get("incarnation", ""))
                before = self._known[index]
                if incarnation == before:
                    return None
                self._known[index] = incarnation
                if welcome.get("journal"):
                    log.info("the broker at %s restarted from its journal", self.controls[index])
                    return None     # it replayed what it had: not a loss (as before recovery existed)
                loss = Loss(index, before, False)
            self.losses.append(loss)
        log.warning("the broker at %s %s: its partitions of stream %r are fed again from Spark",
                    self.controls[index], "is silent past the feed's timeout" if loss.gone else
                    "restarted without a journal", self.stream)
        return loss

    # ---- asking -------------------------------------------------------------------------------------------

    def sweep(self, clients: Sequence[ControlClient]) -> list[Loss]:
        """HELLO every live broker once with ``clients`` (the caller's, one per broker), waiting for a silent one
        until its timeout is up. Returns the new losses."""
        found = []
        for index in self.live():
            with self._lock:
                wait = max(0.2, self._heard[index] + self.timeout - time.monotonic())
            loss = self._ask(clients[index], index, wait, final=True)
            if loss is not None:
                found.append(loss)
        return found

    def _ask(self, client: ControlClient, index: int, wait: float, final: bool = False) -> Loss | None:
        try:
            welcome = client.hello("feeder", self.stream, timeout=wait)
        except BrokerError as exc:
            if exc.code is not None:      # it answered, with a refusal: it is there
                with self._lock:
                    self._heard[index] = time.monotonic()
                return None
            welcome = None
        now = None
        if final and welcome is None:     # a sweep waited for the rest of the broker's timeout: silent past it
            with self._lock:
                now = max(time.monotonic(), self._heard[index] + self.timeout)
        return self.observe(index, welcome, now)

    def adopt(self, losses: Sequence[Loss]) -> None:
        """Losses found before this watch began (by another watch of the same brokers): a gone broker stays gone."""
        with self._lock:
            self.losses.extend(losses)
            self._gone.update(loss.broker for loss in losses if loss.gone)

    def start(self, on_loss: Callable[[], None] | None = None) -> BrokerWatch:
        """Start the thread (once); ``on_loss`` is called (from it) after each new loss."""
        self.on_loss = on_loss
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparkbus-broker-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 5.0)

    def _run(self) -> None:
        key, broker_key = self._keys
        clients = [ControlClient(c, self.interval, key=key, broker_key=broker_key) for c in self.controls]
        try:
            while not self._stop.wait(self.interval):
                for index in self.live():
                    if self._stop.is_set():
                        break
                    loss = self._ask(clients[index], index, self.interval)
                    callback = self.on_loss
                    if loss is not None and callback is not None:
                        try:
                            callback()
                        except Exception:        # a cancel that failed: the sweep after the job still finds it
                            log.exception("cancelling the feed's Spark job failed")
        finally:
            for client in clients:
                client.close()

    def __enter__(self) -> BrokerWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def all_lost_error(stream: str, epoch: int, controls: Sequence[str], losses: Sequence[Loss],
                   timeout: float) -> BrokerError:
    """The loud failure when no broker is left to feed the epoch to (every one lost, or the only one gone)."""
    gone = [controls[loss.broker] for loss in losses if loss.gone]
    what = (f"the broker at {gone[0]} has not answered for {timeout:g} s and it is the stream's only broker"
            if len(controls) == 1 and gone else
            f"every broker of the feed is lost ({', '.join(dict.fromkeys(controls[loss.broker] for loss in losses))})")
    return BrokerError(f"stream {stream!r} epoch {epoch} cannot be fed: {what}, so no broker is left to feed its "
                       f"partitions to again. If a broker still runs (only this driver's link to it failed), feed the "
                       f"same epoch again once it answers: it keeps what it holds. If the brokers are gone, restart "
                       f"them and feed the data again as a new epoch (or a new stream), or run the brokers with "
                       f"--journal to survive restarts")


# ---- cancelling a feed's Spark job from the watch's thread -----------------------------------------------------

class JobCancel:
    """Tags the Spark jobs this thread starts while in the ``with`` block, so that :meth:`cancel` (from any
    thread) stops them and interrupts their tasks.

    Classic session: a job tag (``SparkContext.addJobTag``, which leaves a job group the caller set alone) and
    ``setInterruptOnCancel(True)``; both are thread-local, as PySpark pins a JVM thread to each Python thread, so
    they are set in the thread that runs the job. Spark Connect: ``SparkSession.addTag`` / ``interruptTag``.

    Args:
        session: a classic session's ``SparkContext``, or the Spark Connect ``SparkSession``.
        connect: which of the two it is.
    """

    def __init__(self, session: Any, connect: bool) -> None:
        import secrets

        self.tag = f"sparkbus-feed-{secrets.token_hex(6)}"
        self._session = session
        self._connect = connect
        self._interrupt: Any = None

    def __enter__(self) -> JobCancel:
        if self._connect:
            self._session.addTag(self.tag)
        else:
            sc = self._session
            self._interrupt = sc.getLocalProperty("spark.job.interruptOnCancel")
            sc.addJobTag(self.tag)
            sc.setInterruptOnCancel(True)
        return self

    def cancel(self) -> None:
        log.info("cancelling the feed's Spark job (tag %s): a broker was lost", self.tag)
        if self._connect:
            self._session.interruptTag(self.tag)
        else:
            self._session.cancelJobsWithTag(self.tag)

    def __exit__(self, *exc: object) -> None:
        if self._connect:
            self._session.removeTag(self.tag)
        else:
            sc = self._session
            sc.removeJobTag(self.tag)
            sc.setLocalProperty("spark.job.interruptOnCancel", self._interrupt)


# ---- one epoch, fed under the watch ----------------------------------------------------------------------------

class FeedJob(NamedTuple):
    """A feed's Spark job as the recovery needs it: the partition count if Spark knows it before the job,
    the first job, and the recovery job over fixed routes (either returns the tasks' report rows), and where the
    reports of successful tasks come from while a job runs (``feeder.commits``; None: only from its rows)."""

    partitions: int | None
    collect: Callable[[], list]
    rerun: Callable[[Routes], list]
    reports: ReportChannel | None = None


class Outcome(NamedTuple):
    """What an epoch's feed ended with: the partition count, the report of each partition's committing job,
    the partitions committed at each broker, the diverged partitions, the rows the brokers took to check the
    reports against (None when the reports of some committed partitions are not known: their job was cancelled
    before it returned them), and the batches, rows and bytes the live brokers took of the epoch."""

    partitions: int
    reports: list[PartitionReport]
    shares: tuple[int, ...]
    diverged: set[int]
    held: int | None
    taken: tuple[int, int, int] = (0, 0, 0)


class EpochFeed:
    """One epoch of a feed, run under a :class:`BrokerWatch` and recovered from losses (module notes).

    The epoch is open at every broker already (``EPOCH_OPEN``), except for a resume (:meth:`run` with
    ``resume=True``), whose ``EPOCH_RECOVER(reset=True)`` opens it.
    """

    def __init__(self, clients: Sequence[ControlClient], welcomes: Sequence[Mapping[str, Any]], stream: str,
                 epoch: int, delivery: str, timeout: float, cancel: JobCancel, key: str | None = None,
                 broker_key: str | None = None, interval: float = WATCH_INTERVAL, losses: Sequence[Loss] = (),
                 on_recovery: Callable[[list[Loss]], None] | None = None, committer: Committer | None = None) -> None:
        self.clients = list(clients)
        self.controls = [c.address for c in clients]
        self.stream, self.epoch, self.delivery, self.timeout = stream, epoch, delivery, timeout
        self.cancel = cancel
        self.watch = BrokerWatch(self.controls, welcomes, stream, timeout, key, broker_key, interval)
        self.watch.adopt(losses)
        self.on_recovery = on_recovery
        self.committer = committer         # None: the epoch's tasks commit (an epoch opened without commit="driver")
        self.partitions: int | None = None
        self.reports: dict[int, PartitionReport] = {}
        self.recovered: dict[int, Partitions] = {}
        self.closed: set[int] = set()
        self.resumed = False
        self.max_rounds = len(self.clients) + 2

    def run(self, job: FeedJob, resume: bool = False, fed: bool = False, around: bool = False) -> Outcome:
        """Run the job (or, for a resume, re-feed every partition after a reset), recover from losses, close.
        ``fed``: the epoch was fed and closed before, and the brokers given to the constructor as ``losses`` lost
        it since: only the recovery runs. ``around``: a new epoch, open at the live brokers only, while those
        ``losses`` name brokers gone for good: its partitions are routed over the live ones (:func:`spread_plan`).

        Raises:
            BrokerError: no broker left (:func:`all_lost_error`), or one that cannot recover (an older broker).
            FeedError: still losing brokers after ``len(brokers) + 2`` recovery rounds.
            Exception: the job's own failure (no broker lost), as Spark raised it.
        """
        self.partitions = job.partitions
        known = len(self.watch.losses) if around else 0     # around: the gone brokers, nothing to recover from
        self.watch.start(on_loss=self.cancel.cancel)
        try:
            try:
                if resume:
                    self._reset(job)
                elif around:
                    self._around(job)
                elif not fed:
                    self._take(job.collect(), whole=True)
                failure: Exception | None = None
            except Exception as exc:
                failure = exc
                self._commit(strict=False)    # what Spark declared successful before the job failed or was cancelled
            if not self.watch.sweep(self.clients) and len(self.watch.losses) == known:
                if failure is not None:
                    raise failure
            recovering = len(self.watch.losses) > known
            return self._settle(job, recovering=recovering, queried=recovering or resume or around)
        finally:
            self.watch.stop()

    # ---- the steps ----------------------------------------------------------------------------------------

    def _lost(self) -> list[str]:
        return ([RESUMED] if self.resumed else []) + self.watch.lost_incarnations()

    def _reset(self, job: FeedJob) -> None:
        brokers = len(self.clients)
        if self.partitions is None:
            if brokers > 1:
                raise ValueError("a resume on Spark Connect with several brokers needs the partition count: feed "
                                 "an epoch_order() DataFrame through feed_epochs(..., partitions=...)")
            plan = Plan(Routes({}, 0, 0), {0: Partitions(tail=0)}, {0: Partitions(tail=0)}, {})
        else:
            plan = resume_plan(brokers, self.partitions)
        self.resumed = True
        for i in range(brokers):
            self._request(i, Kind.EPOCH_RECOVER, **recover_fields(plan, i, self.stream, self.epoch,
                                                                  self.partitions, self.delivery, [RESUMED],
                                                                  reset=True))
        self.recovered = dict(plan.recovered)
        self._take(job.rerun(plan.routes))

    def _around(self, job: FeedJob) -> None:
        live = self.watch.live()
        if not live:
            raise all_lost_error(self.stream, self.epoch, self.controls, self.watch.losses, self.timeout)
        plan = spread_plan(live, self.partitions)
        log.warning("stream %r epoch %d: fed through %d of %d brokers (the others are gone)", self.stream, self.epoch,
                    len(live), len(self.clients))
        for i in live:
            self._request(i, Kind.EPOCH_RECOVER, **recover_fields(plan, i, self.stream, self.epoch, self.partitions,
                                                                  self.delivery, []))
        self._take(job.rerun(plan.routes), whole=self.partitions is None)

    def _settle(self, job: FeedJob, recovering: bool, queried: bool) -> Outcome:
        """Recovery rounds while ``recovering``, then the close: from the brokers' EPOCH_QUERY if ``queried``
        (after a recovery or a resume), else from the job's reports (as before recovery existed)."""
        rounds = 0
        while True:
            if recovering:
                rounds += 1
                if rounds > self.max_rounds:
                    raise FeedError(f"stream {self.stream!r} epoch {self.epoch}: brokers were lost "
                                    f"{len(self.watch.losses)} times while it was fed and recovered; gave up after "
                                    f"{self.max_rounds} rounds of recovery")
                if not self._recover_round(job):
                    continue
            try:
                return self._close(recovering or queried)
            except BrokerError as exc:
                if exc.code in CANNOT_RECOVER:
                    raise
                losses = len(self.watch.losses)
                self.watch.sweep(self.clients)
                if len(self.watch.losses) == losses:
                    raise       # not a loss: the broker refused the close, as it would have before recovery
                recovering = True

    def _recover_round(self, job: FeedJob) -> bool:
        """One round: query, plan, EPOCH_RECOVER, the recovery job. False: a broker was lost during it."""
        if self.on_recovery is not None:
            self.on_recovery(list(self.watch.losses))
        losses = len(self.watch.losses)
        live = self.watch.live()
        if not live:
            raise all_lost_error(self.stream, self.epoch, self.controls, self.watch.losses, self.timeout)
        states = self._query(live)
        if states is None or len(self.watch.losses) > losses:
            return False
        plan = plan_recovery(len(self.clients), self.partitions, live, self.watch.lost_brokers(), states,
                             self.recovered)
        log.info("stream %r epoch %d: re-feeding %d partitions%s after losing %s", self.stream, self.epoch,
                 len(plan.routes.fixed), "" if plan.routes.tail is None else
                 f" and every one from {plan.routes.top} on (the count is not known yet)",
                 ", ".join(self.watch.lost_incarnations()))
        for i in live:
            done = i in self.closed or states[i].closed or states[i].ended
            if done and plan.carries[i].numbers == states[i].committed and plan.carries[i].tail is None:
                continue        # closed already, and given nothing new
            try:
                self._request(i, Kind.EPOCH_RECOVER, **recover_fields(plan, i, self.stream, self.epoch,
                                                                      self.partitions, self.delivery, self._lost()))
                self.closed.discard(i)          # reopened: closed again at the end
            except BrokerError as exc:
                if exc.code is not None:
                    raise
                self.watch.sweep(self.clients)
                return False
        self.recovered.update(plan.recovered)
        if not plan.routes.fixed and plan.routes.tail is None:
            return True
        try:
            rows = job.rerun(plan.routes)
        except Exception as exc:
            self._commit(strict=False)
            self.watch.sweep(self.clients)
            if len(self.watch.losses) > losses:
                return False
            raise exc
        if self.watch.sweep(self.clients) or len(self.watch.losses) > losses:
            return False
        self._take(rows, whole=self.partitions is None)
        return True

    def _query(self, live: Sequence[int]) -> dict[int, BrokerEpoch] | None:
        self._commit(strict=False)
        states = {}
        for i in live:
            try:
                state = read_query(self._request(i, Kind.EPOCH_QUERY, stream=self.stream, epoch=self.epoch))
            except BrokerError as exc:
                if exc.code is not None:
                    raise
                self.watch.sweep(self.clients)
                return None
            if state.incarnation:      # the answer names the incarnation that answered: a restart since is a loss
                self.watch.observe(i, {"incarnation": state.incarnation, "journal": state.journal})
            states[i] = state
        return states

    def _close(self, recovering: bool) -> Outcome:
        live = self.watch.live()
        if not live:
            raise all_lost_error(self.stream, self.epoch, self.controls, self.watch.losses, self.timeout)
        states: dict[int, BrokerEpoch] = {}
        if recovering:
            queried = self._query(live)
            if queried is None:
                raise BrokerError(f"a broker of stream {self.stream!r} went silent while epoch {self.epoch} "
                                  f"was closed")
            states = queried
            committed = {i: states[i].committed for i in live}
        else:
            committed = {i: frozenset(p for p, r in self.reports.items() if r.broker == i) for i in live}
        if self.partitions is None:
            self.partitions = len(self.reports)
        every = frozenset().union(*committed.values())
        missing = sorted(set(range(self.partitions)) - every)
        if recovering and missing:
            raise FeedError(f"stream {self.stream!r} epoch {self.epoch}: after recovering from lost brokers, "
                            f"partitions {missing[:10]} are committed at no live broker")
        taken = [taken_figures(self.clients[i], self.stream, self.epoch) for i in live]
        diverged: set[int] = set()
        for i in live:
            if i in self.closed or (recovering and (states[i].closed or states[i].ended)):
                continue        # closed already, and given nothing new since (EPOCH_RECOVER reopens)
            closed = self._request(i, Kind.EPOCH_CLOSE, stream=self.stream, epoch=self.epoch,
                                   partitions=self.partitions, expected=len(committed[i]))
            self.closed.add(i)
            diverged.update(closed.get("diverged", ()))
        known = all(p in self.reports for p in every)
        shares = tuple(len(committed.get(i, ())) for i in range(len(self.clients)))
        reports = [self.reports[p] for p in sorted(every) if p in self.reports] if recovering else \
            [self.reports[p] for p in sorted(self.reports)]
        totals = (sum(t[0] for t in taken), sum(t[1] for t in taken), sum(t[2] for t in taken))
        return Outcome(self.partitions, reports, shares, diverged, totals[1] if known else None, totals)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _take(self, rows: list, whole: bool = False) -> None:
        """The tasks' reports: those that streamed (``batches >= 0``) replace what a partition had before."""
        reports = [PartitionReport(*r) for r in rows]
        if whole and self.partitions is None:
            self.partitions = len(reports)      # Spark Connect: a report per task, whether it streamed or not
        for report in reports:
            if report.batches >= 0:
                self.reports[report.partition] = report
        if self.committer is not None:
            self.committer.add(reports)
        self._commit()

    def _commit(self, strict: bool = True) -> None:
        """Every partition Spark declared successful so far, committed at the live broker that streamed it. Not
        ``strict``: a broker that does not take them is left to the sweep that follows (a loss, recovered)."""
        if self.committer is None:
            return
        try:
            self.committer.flush(self.watch.live())
        except BrokerError as exc:
            if strict:
                raise
            log.warning("%s; the brokers are asked what they have", exc)

    def _request(self, index: int, kind: Kind, **fields: Any) -> dict[str, Any]:
        if kind == Kind.EPOCH_RECOVER and self.committer is not None:
            fields["commit"] = "driver"      # an epoch it opens (a resume's) is committed as EPOCH_OPEN's are
        try:
            return self.clients[index].request(kind, **fields)
        except BrokerError as exc:
            if exc.code in CANNOT_RECOVER and kind in (Kind.EPOCH_QUERY, Kind.EPOCH_RECOVER):
                raise self._cannot_recover(index, exc) from exc
            raise

    def _cannot_recover(self, index: int, cause: BrokerError) -> BrokerError:
        return BrokerError(f"the broker at {self.controls[index]} cannot recover stream {self.stream!r} epoch "
                           f"{self.epoch} ({cause}): a broker restarted while the epoch was being fed, and it runs "
                           f"without --journal: the batches it held are lost. Feed the epoch again (a new epoch "
                           f"number or stream), or run the broker with --journal to survive restarts, or upgrade "
                           f"the brokers to recover from Spark", code=cause.code)


def taken_figures(client: ControlClient, stream: str, epoch: int) -> tuple[int, int, int]:
    """Batches, rows and payload bytes of the epoch the broker has taken (first copies; in atomic delivery,
    committed attempts')."""
    figures = client.request(Kind.STATS_REQUEST)["stats"]["streams"].get(stream, {}).get("epochs", {})
    epoch_figures = figures.get(str(epoch), {})
    return epoch_figures.get("batches_in", 0), epoch_figures.get("rows_in", 0), epoch_figures.get("bytes_in", 0)
