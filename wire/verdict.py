"""Why training waits, in a word: the one rule that a rank's epoch figures (``EpochStats.verdict``), the feed's
report (``FeedReport.verdict``) and ``sparkbus status`` apply (docs/OPERATIONS.md, "Why training waits").

A rank's own view (:func:`of_rank`) has three answers: it waited for data (``input-bound``), for slower peers to
keep steps equal (``peer-bound``), or hardly at all (``compute-bound``: its own work dominates). The pipeline's
view (:func:`of_pipeline`) puts every rank's figures beside how long Spark's feeding tasks were held back by full
brokers (backpressure), and names who to look at: the slowest Spark tasks and their executors when the ranks wait
for data, the slowest rank when Spark waits for the ranks, and ``balanced`` when neither side waits for the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

INPUT_BOUND = "input-bound"
PEER_BOUND = "peer-bound"
COMPUTE_BOUND = "compute-bound"
BALANCED = "balanced"
UNKNOWN = "unknown"

WAIT_SHARE = 0.1      # a rank's wait above a tenth of its own step time holds training back
WINDOW_SHARE = 0.5    # most of the ranks' data wait passed while the broker held batches for them: the window
BACKPRESSURE = 0.25   # Spark's tasks held back by full brokers more than a quarter of their time: ranks are behind


def of_rank(data_wait: float, peer_wait: float, step: float) -> str:
    """A rank's verdict from the seconds its loop waited for data (after its first batch), for peers, and spent
    on its own batches: ``peer-bound`` when it waited more for slower peers than for data (and above a tenth of
    its own time), ``input-bound`` when its data wait is above a tenth of its own time, else ``compute-bound``."""
    threshold = WAIT_SHARE * step
    if peer_wait > max(data_wait, threshold):
        return PEER_BOUND
    return INPUT_BOUND if data_wait > threshold else COMPUTE_BOUND


class RankWaits(NamedTuple):
    """One rank's seconds over some interval: waiting for data (after its first batch), waiting for peers, and its
    loop's own time with its batches; and, of the data wait, the part that passed while the broker held batches
    queued for its stream (the window round trip: the batches were there), when the feed watched for it."""

    rank: int
    data_wait: float
    peer_wait: float
    step: float
    window_wait: float = 0.0


class SlowTask(NamedTuple):
    """A feeding Spark task: its partition, the executor's host, and its seconds."""

    partition: int
    host: str
    seconds: float


class Verdict(NamedTuple):
    """Why training waited over an epoch, and who to look at. ``str()`` of it is the one line the examples and the
    demo print at the end of an epoch."""

    kind: str                           # input-bound, compute-bound, balanced, or unknown (no rank's figures)
    data_wait_share: float              # the ranks' data wait over their own step time, all ranks together
    backpressure: float | None          # the share of Spark's task time held back by full brokers (None: unknown)
    slowest_rank: int | None = None     # the rank with the most step time (compute-bound), or None
    slowest_tasks: tuple[SlowTask, ...] = ()   # the slowest feeding tasks (input-bound)
    window: bool = False                # input-bound on the window round trip: the broker held batches meanwhile

    def __str__(self) -> str:
        held = "" if self.backpressure is None else f", Spark held back {self.backpressure:.0%}"
        figures = f"ranks waited {self.data_wait_share:.0%} of their step time for data{held}"
        if self.kind == INPUT_BOUND and self.window:
            return (f"input-bound on the window round trip: {figures} while the broker held batches for them "
                    f"(raise BatchStream's prefetch or prefetch_bytes)")
        if self.kind == INPUT_BOUND:
            tasks = ", ".join(f"partition {t.partition} on {t.host} ({t.seconds:.1f} s)" for t in self.slowest_tasks)
            return f"input-bound: {figures}; slowest Spark tasks: {tasks or 'not reported'}"
        if self.kind == COMPUTE_BOUND:
            slowest = "" if self.slowest_rank is None else f"; slowest rank: {self.slowest_rank}"
            return f"compute-bound: {figures}{slowest}"
        if self.kind == BALANCED:
            return f"balanced: {figures}"
        return f"unknown: no rank's figures{held}"


def of_pipeline(ranks: Sequence[RankWaits], backpressure: float | None = None,
                slowest_tasks: Sequence[tuple[int, str, float]] = (), queued_share: float | None = None) -> Verdict:
    """The pipeline's verdict over an interval from every rank's figures and, when the feed knows it, Spark's
    backpressure:

    * ``input-bound`` when the ranks together waited for data more than a tenth of their step time (the slowest
      feeding tasks named), *on the window round trip* (``window``) when most of that wait passed while the broker
      held batches for the stream (``queued_share``, the share of the ranks' data wait during which it did, above
      a half): the batches were there, the ranks' windows too small to keep them coming;
    * ``compute-bound`` when Spark was held back more than a quarter of its tasks' time (the ranks are behind), or,
      backpressure unknown (``sparkbus status``), when the ranks hardly waited: the slowest rank named, the one
      with the most step time (the others wait for it, peer-bound);
    * ``balanced`` when neither waited for the other;
    * ``unknown`` with no rank's figures.
    """
    tasks = tuple(SlowTask(*t) for t in slowest_tasks)
    if not ranks:
        return Verdict(UNKNOWN, 0.0, backpressure, None, tasks)
    step, waited = sum(r.step for r in ranks), sum(r.data_wait for r in ranks)
    # ranks that waited for data and told no step time yet waited all the time they took (a share of 1)
    share = waited / step if step > 0 else float(waited > 0)
    slowest = max(ranks, key=lambda r: r.step).rank
    if share > WAIT_SHARE:
        window = queued_share is not None and queued_share > WINDOW_SHARE
        return Verdict(INPUT_BOUND, share, backpressure, None, tasks, window)
    if backpressure is None or backpressure > BACKPRESSURE:
        return Verdict(COMPUTE_BOUND, share, backpressure, slowest, tasks)
    return Verdict(BALANCED, share, backpressure, None, tasks)


def rank_waits(stream: Mapping[str, Any]) -> list[RankWaits]:
    """From one stream's figures in a ``STATS_REPLY`` (docs/PROTOCOL.md), each rank's seconds as it reports them
    (since it joined): its data wait after its first batch (the wait before it, Spark's start-up, apart), its
    wait for peers and its loop's own time. Ranks that have reported nothing yet are left out."""
    waits = []
    for r in stream.get("ranks", ()):
        if "step_s" not in r:
            continue
        wait, peer = float(r.get("wait_s", 0.0)), float(r.get("peer_wait_s", 0.0))
        first = float(r.get("first_batch_s", wait - peer))     # no first batch yet: all of it start-up
        waits.append(RankWaits(int(r["rank"]), max(wait - peer - first, 0.0), peer, float(r["step_s"])))
    return waits



def of_stream(figures: Sequence[Mapping[str, Any]]) -> Verdict:
    """Why a stream's training waits from its figures in one or more brokers' ``STATS_REPLY`` (:func:`latest`).
    One reading: batches queued now stand for the window round trip; backpressure is unknown to a broker
    (``sparkbus status``, the Prometheus gauge)."""
    ranks, held = latest(figures)
    return of_pipeline([ranks[r] for r in sorted(ranks)], queued_share=1.0 if held else 0.0)


def latest(figures: Sequence[Mapping[str, Any]]) -> tuple[dict[int, RankWaits], int]:
    """From one stream's figures in one or more brokers' ``STATS_REPLY``: each rank's seconds (each rank reports
    the same to every broker, each as it last heard: the one with the most step time, then the most wait, is kept),
    and the messages the brokers hold queued for its ranks."""
    ranks: dict[int, RankWaits] = {}
    held = 0
    for stream in figures:
        held += queued(stream)
        for w in rank_waits(stream):
            kept = ranks.get(w.rank)
            if kept is None or (w.step, w.data_wait + w.peer_wait) > (kept.step, kept.data_wait + kept.peer_wait):
                ranks[w.rank] = w
    return ranks, held


def queued(stream: Mapping[str, Any]) -> int:
    """From one stream's figures in a ``STATS_REPLY``, the messages the broker holds queued for its ranks (every
    epoch's)."""
    return sum(int(e.get("queued", 0)) for e in stream.get("epochs", {}).values())


__all__ = ["BALANCED", "COMPUTE_BOUND", "INPUT_BOUND", "PEER_BOUND", "UNKNOWN", "RankWaits", "SlowTask", "Verdict",
           "latest", "of_pipeline", "of_rank", "of_stream", "queued", "rank_waits"]
