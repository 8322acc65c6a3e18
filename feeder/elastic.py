"""The feed of an elastic run: ``feed_epochs`` driven by the ranks' starts, as they write them into the run's
checkpoint directory (:mod:`worker.checkpoint`).

torchrun restarts only the ranks; a resumed group needs its epoch fed again (``feed_epochs(..., resume=...)``:
the brokers hold its delivery until that reset). Who re-feeds is this loop, beside Spark: every start of a group
writes one request (rank 0, once every rank joined), and the loop serves the newest:

- a first start: ``feed_epochs`` from the first epoch;
- a resume: the running feed is cancelled (its Spark job, by a job tag), then ``feed_epochs(resume=[every old
  rank's state])`` feeds the resumed epoch again and the later epochs;

and returns once the ranks wrote ``done``. The broker is not asked to do anything new: this is the resume of
docs/TRAINING.md ("Resuming"), started by the ranks instead of by hand (docs/TRAINING.md, "Elastic restarts").
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparkbus.feeder.cancel import JobCancel
from sparkbus.feeder.driver import FeedReport
from sparkbus.feeder.epochs import feed_epochs
from sparkbus.feeder.jobs import is_connect_dataframe
from sparkbus.wire.errors import FeedTimeout
from sparkbus.worker.checkpoint import ResumeRequest, is_done, mark_served, pending_request

log = logging.getLogger("sparkbus.feeder")

CANCEL_WAIT = 60.0      # seconds a cancelled feed may take to stop (its Spark tasks interrupted)


class Superseded(Exception):
    """Raised inside a cancelled feed's thread between two epochs: a newer request replaced it."""


class FeedRun:
    """One ``feed_epochs`` call in a thread of its own, its Spark jobs tagged so that :meth:`cancel` (from the
    loop's thread) interrupts them: tags are thread-local (PySpark pins a JVM thread to each Python thread), so the
    tag is added in the feed's thread."""

    def __init__(self, df: Any, address: Any, epochs: int, stream: str, first_epoch: int,
                 resume: list[dict[str, Any]] | int | None, options: dict[str, Any],
                 on_epoch: Callable[[int, FeedReport], None] | None) -> None:
        self.df, self.address, self.epochs, self.stream = df, address, epochs, stream
        self.first_epoch, self.resume, self.options, self.user_on_epoch = first_epoch, resume, options, on_epoch
        self.tag = f"sparkbus-elastic-{secrets.token_hex(6)}"
        self.connect = is_connect_dataframe(df)
        session = df.sparkSession
        self.job = JobCancel(session if self.connect else session.sparkContext, self.connect, self.tag)
        self.reports: list[FeedReport] = []
        self.error: BaseException | None = None
        self.cancelled = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"sparkbus-elastic-feed-{self.tag}", daemon=True)

    def start(self) -> FeedRun:
        self.thread.start()
        return self

    @property
    def finished(self) -> bool:
        return not self.thread.is_alive()

    def _on_epoch(self, epoch: int, report: FeedReport) -> None:
        if self.cancelled.is_set():
            raise Superseded(f"feed of stream {self.stream!r} superseded after epoch {epoch}")
        self.reports.append(report)
        if self.user_on_epoch is not None:
            self.user_on_epoch(epoch, report)

    def _run(self) -> None:
        sc = None if self.connect else self.df.sparkSession.sparkContext
        with self.job:
            if sc is not None:
                # a job group too, of this run's jobs alone: the status tracker finds them by it (not by a tag)
                sc.setJobGroup(self.tag, f"sparkbus feed_elastic of stream {self.stream!r}", interruptOnCancel=True)
            try:
                feed_epochs(self.df, self.address, self.epochs, stream=self.stream, first_epoch=self.first_epoch,
                            resume=self.resume, on_epoch=self._on_epoch, **self.options)
            except BaseException as exc:        # read by the loop: a cancelled feed's failure is expected
                self.error = exc
            finally:
                if sc is not None:
                    sc.setLocalProperty("spark.jobGroup.id", None)

    def cancel(self, timeout: float = CANCEL_WAIT) -> None:
        """Stop this feed: its running Spark job is cancelled (again every half second, for a job started just
        after), and the next epoch boundary raises :class:`Superseded`. Waits until its thread ended.

        Raises:
            FeedTimeout: the feed did not stop within ``timeout``.
        """
        self.cancelled.set()
        deadline = time.monotonic() + timeout
        why: str | None = "a resumed group replaced it"
        while self.thread.is_alive():
            if time.monotonic() > deadline:
                raise FeedTimeout(f"the feed of stream {self.stream!r} did not stop within {timeout:g} s of its "
                                  f"cancellation")
            self.job.cancel(why)
            why = None                      # logged once
            self.thread.join(0.5)
        if not self.connect:           # the cancelled job's tasks: ended (killed) before the resumed feed starts
            while self.running_tasks() and time.monotonic() < deadline:
                time.sleep(0.2)

    def running_tasks(self) -> int:
        """The tasks of this run's Spark jobs still running (a cancelled job's until they are killed)."""
        tracker = self.df.sparkSession.sparkContext.statusTracker()
        running = 0
        for job in tracker.getJobIdsForGroup(self.tag):
            info = tracker.getJobInfo(job)
            for stage in info.stageIds if info is not None else ():
                stage_info = tracker.getStageInfo(stage)
                running += stage_info.numActiveTasks if stage_info is not None else 0
        return running


def feed_elastic(df: Any, address: str | Sequence[str] | None, checkpoints: str | Path, epochs: int,
                 stream: str = "train", *, first_epoch: int = 0, poll: float = 0.5,
                 idle_timeout: float | None = None,
                 on_epoch: Callable[[int, FeedReport], None] | None = None,
                 **feed_epochs_options: Any) -> list[FeedReport]:
    """Feed ``epochs`` epochs of ``df`` to ``stream`` for ranks that may be restarted (torchrun's elastic agent) or
    resumed on another number of ranks, exactly: every row reaches the model once relative to the checkpoint the
    ranks resume from (docs/TRAINING.md, "Elastic restarts").

    The ranks use :class:`worker.checkpoint.ElasticCheckpoints` on the same ``checkpoints`` directory: each start
    of a group writes a request there, which this loop serves (the newest, ``poll``-ing the directory): a first
    start is fed from ``first_epoch``; a resume cancels the running feed (its Spark job) and calls
    ``feed_epochs(..., resume=<every old rank's state>)``, which feeds the resumed epoch again and then the later
    ones. Returns once the ranks wrote ``done`` (``ElasticCheckpoints.finish()``).

    Args:
        df, address, epochs, stream, first_epoch: as :func:`feeder.feed_epochs` (one stream per loop: run one loop
            per stream, each in a thread, for a validation stream too).
        checkpoints: the run's checkpoint directory, the ranks' (a shared filesystem across hosts). Start every
            run in a new one: requests from an old run would be served.
        poll: seconds between two looks at the directory.
        idle_timeout: seconds to wait, with no feed running, for the ranks' next request or their ``done`` (the
            first start's request included); None waits as long as it takes.
        on_epoch: called with ``(epoch, report)`` after each epoch is fed (again after a resume).
        **feed_epochs_options: passed to :func:`feeder.feed_epochs` (``shuffle_seed`` — pass one: a resume must
            reshuffle as the first feed did —, ``key``, ``partitions``, ``batch_size``, ``timeout``, ...). Not
            ``resume``: the requests say it.
    Returns:
        Every epoch's :class:`FeedReport`, in the order fed (an epoch fed again after a resume appears again; a
        cancelled feed's last epoch does not).
    Raises:
        FeedTimeout: nothing asked for within ``idle_timeout``; a cancelled feed that did not stop.
        ValueError: ``resume`` among the options; a request without this stream.
        BrokerError, FeedError, TypeError: as :func:`feeder.feed_epochs`, from a feed that no request superseded.
    """
    if "resume" in feed_epochs_options:
        raise ValueError("feed_elastic takes no resume=: the ranks' requests in the checkpoint directory say it")
    if feed_epochs_options.get("shuffle", True) and feed_epochs_options.get("shuffle_seed") is None:
        raise ValueError("feed_elastic needs shuffle_seed=: a resumed epoch must be reshuffled as it was first fed")
    directory = Path(checkpoints)
    reports: list[FeedReport] = []
    running: FeedRun | None = None
    idle_since = time.monotonic()
    try:
        while True:
            request = pending_request(directory, stream)
            if request is not None:
                if running is not None:
                    log.warning("stream %r: a group of %d ranks resumes from %s; cancelling the running feed",
                                stream, request.ranks, request.checkpoint or "the beginning")
                    running.cancel()
                    reports.extend(running.reports)
                running = serve(request, df, address, epochs, stream, first_epoch, feed_epochs_options, on_epoch)
                continue
            if is_done(directory):
                if running is not None:
                    running.thread.join(CANCEL_WAIT)
                    if not running.finished:
                        running.cancel()
                log.info("stream %r: the ranks are done", stream)
                break
            if running is not None and running.finished:
                reports.extend(running.reports)
                error, running = running.error, None
                idle_since = time.monotonic()
                if error is not None and pending_request(directory, stream) is None:
                    raise error     # a failure no resume explains
                continue
            if running is None and idle_timeout is not None and time.monotonic() - idle_since > idle_timeout:
                raise FeedTimeout(f"stream {stream!r}: no request from the ranks and no 'done' in {directory} "
                                  f"within {idle_timeout:g} s")
            time.sleep(poll)
    finally:
        if running is not None and not running.finished:
            running.cancel()
    if running is not None:
        reports.extend(running.reports)
    return reports


def serve(request: ResumeRequest, df: Any, address: Any, epochs: int, stream: str, first_epoch: int,
          options: dict[str, Any], on_epoch: Callable[[int, FeedReport], None] | None) -> FeedRun:
    """Start the feed a request asks for, and mark it served."""
    if stream not in request.resumes:
        raise ValueError(f"request {request.path.name} names streams {sorted(request.resumes)}, not {stream!r}: "
                         f"the ranks must call ElasticCheckpoints.resume({stream!r}) before joined()")
    resume = request.resumes[stream]
    mark_served(request, stream)
    if resume is None:
        log.info("stream %r: first start of a group of %d ranks; feeding from epoch %d", stream, request.ranks,
                 first_epoch)
    else:
        log.warning("stream %r: a group of %d ranks resumes from %s; feeding epoch %s again", stream,
                    request.ranks, request.checkpoint or "the beginning",
                    resume if isinstance(resume, int) else resume[0]["epoch"])
    return FeedRun(df, address, epochs, stream, first_epoch, resume, options, on_epoch).start()


__all__ = ["feed_elastic"]
