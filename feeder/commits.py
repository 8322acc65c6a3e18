"""Spark's word commits a partition: the driver tells each broker which task attempt Spark declared successful.

A feeding task's ``PARTITION_END`` says only that the attempt sent every batch it had. That is not the same as
every batch of the partition: when an executor is lost mid-partition, its Python worker's input ends at an Arrow
message boundary and reads as a whole partition, so the attempt streams a prefix and ends it. Only Spark knows
which attempt succeeded, so ``feed()`` opens its epochs with ``commit="driver"`` and commits each partition from
the driver, as Spark declares its tasks successful (docs/GUARANTEES.md, "Which attempt is committed"):

- **classic session**: each task adds its report to an accumulator (:class:`AccumulatorReports`). Spark merges a
  result task's accumulator updates exactly once, when the task succeeds, and never a failed or killed attempt's;
  PySpark passes them to the driver while the job runs. (The updates travel between Spark's own processes, pickled
  by PySpark, as every accumulator's do; nothing from a broker's socket is ever unpickled.)
- **Spark Connect** (no accumulators): the job's results, streamed to the client as partitions complete
  (``toLocalIterator``; in partition order, so a slow partition holds back the commits of the later ones).

:class:`Committer` sends them, from a thread with its own control sockets, to the broker that streamed each
partition (``PARTITION_COMMIT``), and :meth:`Committer.flush` sends all that Spark declared so far before the
driver asks the brokers what they committed or closes the epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from typing import Any

from sparkbus.broker.client import ControlClient
from sparkbus.feeder.task import PartitionReport
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.protocol import MAX_COMMITS, Kind

log = logging.getLogger("sparkbus.feeder")

COMMIT_INTERVAL = 0.1       # seconds between the committer's looks at the reports


def _report_list() -> Any:
    from pyspark.accumulators import AccumulatorParam

    class ReportList(AccumulatorParam):
        """An accumulator of report tuples, extended in place (the driver reads it while it grows)."""

        def zero(self, value: list) -> list:
            return []

        def addInPlace(self, value1: list, value2: list) -> list:   # noqa: N802 (PySpark's name)
            value1.extend(value2)
            return value1

    return ReportList()


class AccumulatorReports:
    """A classic session's channel: tasks :meth:`add` their report, the driver :meth:`drain` s the new ones.

    Args:
        context: the ``SparkContext`` whose jobs feed.
    """

    def __init__(self, context: Any) -> None:
        self.accumulator = context.accumulator([], _report_list())
        self._read = 0

    def add(self, report: PartitionReport) -> None:
        """In a task: report the partition this attempt streamed (merged at the driver if the task succeeds)."""
        self.accumulator.add([tuple(report)])

    def drain(self) -> list[PartitionReport]:
        """At the driver: the reports merged since the last call (PySpark's accumulator server appends them)."""
        value = self.accumulator._value        # the live list; reading .value from a thread is refused
        new = value[self._read:]
        self._read += len(new)
        return [PartitionReport(*r) for r in new]

    def close(self) -> None:
        """Forget the reports (a late update from a job Spark already ended is dropped with them)."""
        self.accumulator._value = []
        self._read = 0

    def __getstate__(self) -> dict:
        return {"accumulator": self.accumulator, "_read": 0}


class StreamedReports:
    """A Spark Connect channel: the job's result rows as the client receives them (:meth:`put`)."""

    def __init__(self) -> None:
        self._reports: list[PartitionReport] = []
        self._lock = threading.Lock()

    def put(self, report: PartitionReport) -> None:
        with self._lock:
            self._reports.append(report)

    def drain(self) -> list[PartitionReport]:
        with self._lock:
            new, self._reports = self._reports, []
        return new

    def close(self) -> None:
        self.drain()


ReportChannel = AccumulatorReports | StreamedReports


class Committer:
    """Sends ``PARTITION_COMMIT`` for each report of a successful task to the broker that streamed it.

    Args:
        controls: the brokers' control addresses, in the feed's order (a report's ``broker`` indexes it).
        stream, epoch: the epoch being fed.
        timeout: seconds to wait for a broker's answer.
        channel: where the reports of the running job come from (None: only those given to :meth:`add`).
        key, broker_key: CURVE key files (see :class:`broker.client.ControlClient`).
    """

    def __init__(self, controls: list[str], stream: str, epoch: int, timeout: float,
                 channel: ReportChannel | None = None, key: str | None = None, broker_key: str | None = None,
                 interval: float = COMMIT_INTERVAL) -> None:
        self.controls, self.stream, self.epoch, self.timeout = list(controls), stream, epoch, timeout
        self.channel = channel
        self.interval = interval
        self._keys = (key, broker_key)
        self._queue: list[PartitionReport] = []
        self._seen: set[tuple[int, int]] = set()     # (partition, attempt) queued once
        self._sent = 0                               # reports sent (or given up), of those queued
        self._queued = 0
        self._skip: set[int] = set()                 # brokers not to send to (gone: their partitions are re-fed)
        self._lock = threading.Condition()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.missing: set[int] = set()               # partitions a broker did not hold whole when committed

    def start(self) -> Committer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparkbus-committer", daemon=True)
            self._thread.start()
        return self

    def add(self, reports: Iterable[PartitionReport]) -> None:
        """Reports Spark declared successful (any thread); those seen before, and those of tasks that streamed
        nothing for this feed (``batches < 0``, or no attempt: an older task), are skipped."""
        with self._lock:
            for report in reports:
                key = (report.partition, report.attempt)
                if report.batches < 0 or report.attempt < 0 or key in self._seen:
                    continue
                self._seen.add(key)
                self._queue.append(report)
                self._queued += 1
        self._wake.set()

    def flush(self, live: Collection[int] | None = None, timeout: float | None = None) -> None:
        """Send every report Spark declared so far (the channel's too) before returning.

        Args:
            live: the brokers to send to; reports of the others are dropped (their partitions are fed again).
            timeout: seconds to wait (default: the feed's timeout, plus a margin for the sends).
        """
        if live is not None:
            with self._lock:
                self._skip = set(range(len(self.controls))) - set(live)
        self._drain_channel()
        with self._lock:
            target = self._queued
        self._wake.set()
        if self._thread is None:
            self.start()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout) + 5.0
        with self._lock:
            while self._sent < target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BrokerError(f"the commits of stream {self.stream!r} epoch {self.epoch} did not reach "
                                      f"the brokers within {self.timeout:g} s")
                self._lock.wait(min(remaining, 0.5))

    def _drain_channel(self) -> None:
        if self.channel is not None:
            new = self.channel.drain()
            if new:
                self.add(new)

    def _run(self) -> None:
        key, broker_key = self._keys
        clients: dict[int, ControlClient] = {}
        try:
            while not self._stop.is_set():
                self._wake.wait(self.interval)
                self._wake.clear()
                self._drain_channel()
                with self._lock:
                    batch, self._queue = self._queue, []
                    skip = set(self._skip)
                if not batch:
                    continue
                retry = self._send(batch, skip, clients, key, broker_key)
                with self._lock:
                    self._queue[:0] = retry
                    self._sent += len(batch) - len(retry)
                    self._lock.notify_all()
                if retry:
                    self._stop.wait(0.2)
        finally:
            for client in clients.values():
                client.close()

    def _send(self, batch: list[PartitionReport], skip: set[int], clients: dict[int, ControlClient],
              key: str | None, broker_key: str | None) -> list[PartitionReport]:
        """Send ``batch`` grouped by broker; returns the reports to try again (a broker that did not answer)."""
        retry: list[PartitionReport] = []
        by_broker: dict[int, list[PartitionReport]] = {}
        for report in batch:
            if report.broker in skip or not 0 <= report.broker < len(self.controls):
                continue
            by_broker.setdefault(report.broker, []).append(report)
        for index, reports in by_broker.items():
            client = clients.get(index)
            if client is None:
                client = clients[index] = ControlClient(self.controls[index], self.timeout, key=key,
                                                        broker_key=broker_key)
            for start in range(0, len(reports), MAX_COMMITS):
                chunk = reports[start:start + MAX_COMMITS]
                parts = [v for r in chunk for v in (r.partition, r.attempt, r.messages)]
                try:
                    reply = client.request(Kind.PARTITION_COMMIT, timeout=min(self.timeout, 5.0),
                                           stream=self.stream, epoch=self.epoch, parts=parts)
                except BrokerError as exc:
                    if exc.code is not None:        # refused (the epoch is gone there: a lost broker, recovered)
                        log.info("the broker at %s refused the commits of %d partitions of stream %r epoch %d: %s",
                                 self.controls[index], len(chunk), self.stream, self.epoch, exc)
                        continue
                    log.info("no answer from the broker at %s to a commit; trying again", self.controls[index])
                    retry.extend(reports[start:])
                    clients.pop(index).close()
                    break
                missing = reply.get("missing", [])
                if missing:
                    with self._lock:
                        self.missing.update(missing)
        return retry

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.timeout + 5.0)
        if self.channel is not None:
            self.channel.close()

    def __enter__(self) -> Committer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
