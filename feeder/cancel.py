"""Cancelling a feed's Spark job from another thread: the watch's, when it finds a broker lost (:mod:`feeder.watch`).

The job is tagged in the thread that runs it (PySpark pins a JVM thread to each Python thread, and tags are
thread-local); any thread may then cancel it by its tag, interrupting its tasks.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

log = logging.getLogger("sparkbus.feeder")


class JobCancel:
    """Tags the Spark jobs this thread starts while in the ``with`` block, so that :meth:`cancel` (from any
    thread) stops them and interrupts their tasks.

    Classic session: a job tag (``SparkContext.addJobTag``, which leaves a job group the caller set alone) and
    ``setInterruptOnCancel(True)``; both are thread-local, as PySpark pins a JVM thread to each Python thread, so
    they are set in the thread that runs the job. Spark Connect: ``SparkSession.addTag`` / ``interruptTag``.

    Args:
        session: a classic session's ``SparkContext``, or the Spark Connect ``SparkSession``.
        connect: which of the two it is.
        tag: the tag (default: a new one).
    """

    def __init__(self, session: Any, connect: bool, tag: str | None = None) -> None:
        self.tag = tag or f"sparkbus-feed-{secrets.token_hex(6)}"
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

    def cancel(self, why: str | None = "a broker was lost") -> None:
        """Cancel the tagged jobs, interrupting their tasks; logged with ``why`` unless it is None."""
        if why is not None:
            log.info("cancelling the feed's Spark job (tag %s): %s", self.tag, why)
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

