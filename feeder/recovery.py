"""The recovery loop: one epoch fed under the watch, re-fed from Spark after a lost broker, then closed.

docs/design/RECOVERY.md ("The driver") is the contract. In short:

- The watch (:mod:`feeder.watch`) runs beside the epoch's Spark job and cancels it (:mod:`feeder.cancel`) when a
  broker is lost: restarted without ``--journal``, or silent for the feed's ``timeout``.
- The driver then asks each live broker what it has of the epoch (``EPOCH_QUERY``), and
  :func:`feeder.routes.plan_recovery` fixes a route for every partition no live broker committed: where it was
  seen, else the takeover broker of the lost one (the restarted broker itself, else the first live broker).
- ``EPOCH_RECOVER`` tells each live broker what it carries now; the recovery job re-feeds those partitions only
  (classic: ``SparkContext.runJob``; Spark Connect: every partition, the others send nothing). A loss during it
  goes round again, a bounded number of times.
- ``EPOCH_CLOSE`` on every live broker with the partitions it committed.

:class:`EpochFeed` has one entry point per way an epoch is fed: :meth:`EpochFeed.run` (its first job),
:meth:`EpochFeed.resume` (a resume from a checkpoint: ``EPOCH_RECOVER(reset=True)`` drops the epoch's state at every
broker and names the loss ``""``, then every partition is fed again), :meth:`EpochFeed.feed_around` (a new epoch
at the live brokers only, others being gone for good) and :meth:`EpochFeed.recover_fed` (an epoch fed before,
lost since: only the recovery). All four then recover and close the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sparkbus.broker.client import ControlClient
from sparkbus.feeder.cancel import JobCancel
from sparkbus.feeder.commits import Committer
from sparkbus.feeder.jobs import FeedJob
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
from sparkbus.feeder.watch import WATCH_INTERVAL, BrokerWatch, Loss
from sparkbus.wire.errors import BrokerError, FeedError
from sparkbus.wire.protocol import ErrorCode, Kind

log = logging.getLogger("sparkbus.feeder")

RESUMED = ""                # the loss a resume from a checkpoint names (docs/design/RECOVERY.md "Names")
# Brokers that cannot recover (an older broker) answer EPOCH_QUERY/EPOCH_RECOVER with one of these
CANNOT_RECOVER = (ErrorCode.UNEXPECTED_KIND, ErrorCode.MALFORMED, ErrorCode.VERSION)


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


class Taken(NamedTuple):
    """What a broker has taken of an epoch (:func:`taken_figures`), or the live brokers together."""

    batches: int = 0
    rows: int = 0
    nbytes: int = 0      # payload bytes


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
    taken: Taken = Taken()


class EpochFeed:
    """One epoch of a feed, run under a :class:`feeder.watch.BrokerWatch` and recovered from losses (module notes).

    One entry point per way the epoch is fed (each once per object): :meth:`run`, :meth:`resume`,
    :meth:`feed_around`, :meth:`recover_fed`. The epoch is open at every live broker already (``EPOCH_OPEN``),
    except for a resume, whose ``EPOCH_RECOVER(reset=True)`` opens it, and for :meth:`feed_around`, whose
    ``EPOCH_RECOVER`` at the live brokers does.

    Args:
        losses: losses found before this feed (by ``feed_epochs``' watch): for :meth:`recover_fed`, those to
            recover from; for :meth:`feed_around`, the brokers gone for good.
    """

    def __init__(self, clients: Sequence[ControlClient], welcomes: Sequence[Mapping[str, Any]], stream: str,
                 epoch: int, delivery: str, timeout: float, cancel: JobCancel, key: str | None = None,
                 broker_key: str | None = None, interval: float = WATCH_INTERVAL, losses: Sequence[Loss] = (),
                 on_recovery: Callable[[list[Loss]], None] | None = None, committer: Committer | None = None,
                 before_close: Callable[[], None] | None = None) -> None:
        self.clients = list(clients)
        self.controls = [c.address for c in clients]
        self.stream, self.epoch, self.delivery, self.timeout = stream, epoch, delivery, timeout
        self.cancel = cancel
        self.watch = BrokerWatch(self.controls, welcomes, stream, timeout, key, broker_key, interval)
        self.watch.adopt(losses)
        self.on_recovery = on_recovery
        self.committer = committer         # None: the epoch's tasks commit (an epoch opened without commit="driver")
        self.before_close = before_close   # the feed's last look at the ranks, while none can have left the epoch
        self.partitions: int | None = None
        self.reports: dict[int, PartitionReport] = {}
        self.recovered: dict[int, Partitions] = {}
        self.closed: set[int] = set()
        self.resumed = False
        self.max_rounds = len(self.clients) + 2

    # ---- the entry points: how the epoch is first fed -------------------------------------------------------
    # Raises (each): BrokerError: no broker left (:func:`all_lost_error`), or one that cannot recover (an older
    # broker). FeedError: still losing brokers after ``len(brokers) + 2`` recovery rounds. Exception: the job's own
    # failure (no broker lost), as Spark raised it.

    def run(self, job: FeedJob) -> Outcome:
        """Run the epoch's first job (open at every broker), recover from losses, close: from the job's reports
        if no broker was lost, else from what the brokers say they hold."""
        return self._watched(job, lambda: self._take(job.collect(), whole=True), queried=False)

    def resume(self, job: FeedJob) -> Outcome:
        """A resume from a checkpoint: reset the epoch at every broker, re-feed every partition home (only what no
        rank's checkpoint used is delivered), recover from losses, close."""
        return self._watched(job, lambda: self._reset(job), queried=True)

    def feed_around(self, job: FeedJob) -> Outcome:
        """A new epoch, while the ``losses`` given name brokers gone for good: open it at the live brokers only and
        route its partitions over them (:func:`feeder.routes.spread_plan`), recover from new losses, close."""
        return self._watched(job, lambda: self._around(job), queried=True)

    def recover_fed(self, job: FeedJob) -> Outcome:
        """An epoch fed and closed before, whose brokers lost it since (the ``losses`` given): only the recovery of
        what no live broker committed, then the close."""
        return self._watched(job, None, queried=True, recovering=True)

    def _watched(self, job: FeedJob, first: Callable[[], None] | None, queried: bool,
                 recovering: bool = False) -> Outcome:
        """``first`` under the watch; then recovery rounds if a broker was lost since (or ``recovering``), and the
        close, from the brokers' EPOCH_QUERY if ``queried`` or recovering."""
        self.partitions = job.partitions
        mark = self.watch.mark()        # losses adopted before (brokers gone for good) are not recovered from
        self.watch.start(on_loss=self.cancel.cancel)
        try:
            failure: Exception | None = None
            try:
                if first is not None:
                    first()
            except Exception as exc:
                failure = exc
                self._commit(strict=False)    # what Spark declared successful before the job failed or was cancelled
            self.watch.sweep(self.clients)
            recovering = recovering or self.watch.lost_since(mark)
            if failure is not None and not recovering:
                raise failure
            return self._settle(job, recovering=recovering, queried=recovering or queried)
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
                mark = self.watch.mark()
                self.watch.sweep(self.clients)
                if not self.watch.lost_since(mark):
                    raise       # not a loss: the broker refused the close, as it would have before recovery
                recovering = True

    def _recover_round(self, job: FeedJob) -> bool:
        """One round: query, plan, EPOCH_RECOVER, the recovery job. False: a broker was lost during it (or went
        silent: the sweep decides whether it is gone), and the round goes again."""
        if self.on_recovery is not None:
            self.on_recovery(self.watch.losses)
        mark = self.watch.mark()
        live = self.watch.live()
        if not live:
            raise all_lost_error(self.stream, self.epoch, self.controls, self.watch.losses, self.timeout)
        states = self._query(live)
        if states is None or self.watch.lost_since(mark):
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
        except Exception:
            self._commit(strict=False)
            self.watch.sweep(self.clients)
            if self.watch.lost_since(mark):
                return False
            raise
        self.watch.sweep(self.clients)
        if self.watch.lost_since(mark):
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
        if self.before_close is not None:
            self.before_close()
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
        totals = Taken(sum(t.batches for t in taken), sum(t.rows for t in taken), sum(t.nbytes for t in taken))
        return Outcome(self.partitions, reports, shares, diverged, totals.rows if known else None, totals)

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


def taken_figures(client: ControlClient, stream: str, epoch: int) -> Taken:
    """Batches, rows and payload bytes of the epoch the broker has taken (first copies; in atomic delivery,
    committed attempts')."""
    figures = client.request(Kind.STATS_REQUEST)["stats"]["streams"].get(stream, {}).get("epochs", {})
    epoch_figures = figures.get(str(epoch), {})
    return Taken(epoch_figures.get("batches_in", 0), epoch_figures.get("rows_in", 0), epoch_figures.get("bytes_in", 0))
