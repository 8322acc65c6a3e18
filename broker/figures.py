"""The broker's figures (``STATS_REPLY.stats``), defined once: the records the ledger fills in, ``sparkbus status``
prints, the Prometheus exporter renders and docs/PROTOCOL.md ("Statistics") describes.

They travel as msgpack maps and are kept in ``retired.log`` as they are, so they are ``TypedDict``\\ s: plain dicts
on the wire and on disk, typed in the code. A unit test holds docs/PROTOCOL.md's list of fields to these records
and docs/OPERATIONS.md's list of metrics to :data:`EPOCH_METRICS`, :data:`RANK_METRICS` and the exporter.

Figures of epochs retired by an older broker may lack fields added since (``rows_out``): readers use ``.get``.
History is bounded: a stream lists the figures of its last ``--keep-epochs`` delivered epochs (and those in
progress); older ones are summed in its ``earlier`` record (:func:`fold`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypedDict


class EpochFigures(TypedDict):
    """One epoch of one stream (``EpochState.stats``); kept in ``retired.log`` once the epoch is retired."""

    partitions: int
    delivery: str            # "stream" or "atomic"
    committed: int           # partitions committed
    closed: bool             # the driver closed the epoch
    ended: bool              # EPOCH_END went to the ranks
    queued: int              # messages waiting in the broker for a rank
    batches_in: int          # taken from the feed, first copies (a pack counts its batches)
    bytes_in: int
    rows_in: int
    batches_out: int         # given out, less those requeued after their rank died: consumed or in the ranks' hands
    bytes_out: int
    rows_out: int
    batches_handed: int      # handed to ranks, a requeued batch counting once: only ever grows (the metrics')
    bytes_handed: int
    rows_handed: int
    acked: int               # acknowledged by ranks
    duplicates: int          # copies from task retries or speculation, dropped (messages)
    redelivered: int         # sends of a batch that had gone out before
    given_twice: int         # batches a rank came back with after --rejoin-grace, given to another meanwhile
    diverged: list[int]      # partitions whose attempts sent different data
    steps: int               # granted streams: steps granted to every rank so far (0 otherwise)
    dropped: int             # ... batches dropped at the epoch's end to keep the ranks even (< ranks)
    moved: int               # ... batches returned by one rank and given to another at the epoch's end
    cut: int                 # ... batches left over at the epoch's end, shared out by rows (remainder "split")
    pieces: int              # ... the pieces (row ranges, and repeats) they went out as: one a rank
    repeated: int            # ... of those, repeats of a batch another rank had (remainder "pad")
    unassigned: int          # recovering: batches of partitions the broker no longer carries, dropped
    adopted: int             # ... batches the ranks had used of a lost broker (RECLAIM): consumed, never sent
    held: int                # ... messages held until every rank said what it used (not queued yet)
    commit: str              # who commits a partition: "end" (the task's PARTITION_END) or "driver" (Spark's word)
    superseded: int          # task attempts that sent every batch they had, not committed (Spark chose another)


class _RankFiguresBase(TypedDict):
    rank: int
    size: int
    even: bool
    window: int              # batches that may be in flight to it ...
    window_bytes: int        # ... or bytes of them, whichever admits more
    inflight: int
    inflight_bytes: int
    batches: int             # sent to this connection
    bytes: int
    acked: int
    idle_s: float            # since its last message


class RankFigures(_RankFiguresBase, total=False):
    """One rank's connection (``RankState.stats``), with the figures the rank reports about itself once it has."""

    wait_s: float            # its training loop's time waiting for data
    first_batch_s: float     # from its start to its first batch
    consumed: int            # batches its training loop took
    peer_wait_s: float       # of wait_s, waiting for peers (equal steps); the rest is a wait for data
    step_s: float            # its training loop's own time with its batches


# what a rank reports about itself (protocol.OPTIONAL of ACK and HEARTBEAT), in order
REPORTED = tuple(k for k in RankFigures.__annotations__ if k in RankFigures.__optional_keys__)


class OrphanFigures(TypedDict):
    """A lost rank whose batches wait ``--rejoin-grace`` for it."""

    rank: int
    inflight: int
    expires_in_s: float


class EarlierFigures(TypedDict):
    """A stream's delivered epochs whose figures are no longer kept one by one (all but the last ``--keep-epochs``),
    summed: with those in ``epochs``, a stream's totals since the broker started (:func:`fold`)."""

    epochs: int              # how many
    batches_in: int
    bytes_in: int
    rows_in: int
    batches_out: int
    bytes_out: int
    rows_out: int
    batches_handed: int
    bytes_handed: int
    rows_handed: int
    acked: int
    duplicates: int
    redelivered: int
    given_twice: int
    diverged: int            # partitions (EpochFigures lists them)
    dropped: int
    moved: int
    cut: int
    pieces: int
    repeated: int
    unassigned: int
    adopted: int
    superseded: int


SUMMED = tuple(k for k in EarlierFigures.__annotations__ if k != "epochs")   # the EpochFigures that add up


def no_earlier() -> EarlierFigures:
    return {"epochs": 0, **dict.fromkeys(SUMMED, 0)}    # type: ignore[typeddict-item]


# figures added since an older broker, and the figure they equal in its records: what they are read from there
OLDER = {"batches_handed": "batches_out", "bytes_handed": "bytes_out", "rows_handed": "rows_out"}


def fold(into: EarlierFigures, epoch: Mapping[str, Any]) -> None:
    """Add one epoch's figures to ``into`` (figures retired by an older broker may lack some: they count 0, or
    as the figure they equal there, :data:`OLDER`)."""
    totals: dict[str, Any] = into        # type: ignore[assignment]
    totals["epochs"] += 1
    sums = dict(totals)
    for name in SUMMED:
        value = epoch.get(name, epoch.get(OLDER.get(name, name), 0))
        # an ``earlier`` record of an older broker (retired.log) may lack a figure added since: it starts at 0
        before = sums.get(name, sums.get(OLDER.get(name, name), 0))
        totals[name] = before + (len(value) if isinstance(value, list) else int(value))


class StreamFigures(TypedDict):
    expected_ranks: int      # the communicator size its ranks announced
    rejoins: int             # ranks that came back and were reconciled
    delivered: int           # epochs delivered and acknowledged, all of them (those of ``epochs`` and ``earlier``)
    idle_s: float            # since the stream was last in use (0 while it is: see --retire-streams-after)
    earlier: EarlierFigures  # the delivered epochs not in ``epochs``, summed
    epochs: dict[str, EpochFigures]      # the last --keep-epochs delivered and those in progress, by number as a
                                         # string (msgpack and JSON map keys)
    ranks: list[RankFigures]
    orphans: list[OrphanFigures]


class BrokerFigures(TypedDict):
    version: int             # the protocol version
    pid: int
    incarnation: str         # new at each start
    uptime_s: float
    buffered_bytes: int      # batches held: queued, in flight, awaiting an atomic commit
    max_buffer: int
    feed_paused: bool        # the feed socket is not read (backpressure on Spark)
    endpoints: dict[str, str]
    journal: str | None      # the journal directory
    rejected: dict[str, dict[str, int]]   # socket -> reason -> count
    versions: list[int]      # the protocol versions it serves (docs/PROTOCOL.md "Versions")
    older_peers: dict[str, int]           # connections speaking an older version, by version (as a string)
    retired_streams: int     # streams dropped since the start after --retire-streams-after unused


class _FiguresBase(TypedDict):
    broker: BrokerFigures
    streams: dict[str, StreamFigures]


class Figures(_FiguresBase, total=False):
    """``Broker.stats()``: what ``STATS_REPLY`` carries and ``sparkbus status --json`` prints.

    A reply too large for one message comes in pages (``STATS_REPLY`` after ``STATS_REPLY``, the same ``req``), each
    with ``page``: ``[index, count]``; ``broker.client`` puts them together (``broker.status.merge_pages``).
    """

    page: list[int]


# ---- the metrics drawn from them (broker/metrics.py renders these; docs/OPERATIONS.md lists them) ----------------


class Metric(NamedTuple):
    """A Prometheus metric. ``name`` is without ``_total``: a counter family adds it (:attr:`exposed`).

    ``field`` is the record field it renders, if it renders one as it is; the others the exporter derives.
    ``combine`` (rank metrics): how connections with the same stream and rank number combine.
    """

    name: str
    kind: str                # "counter" or "gauge"
    labels: tuple[str, ...]
    help: str
    field: str | None = None
    combine: Callable[[list[float]], float] | None = None

    @property
    def exposed(self) -> str:
        """The name a scrape shows."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


_STREAM = ("stream",)
_RANK = ("stream", "rank")

BROKER_METRICS: list[Metric] = [
    Metric("sparkbus_info", "gauge", ("version", "incarnation"),
           "The broker's protocol version and incarnation (new at each start)."),
    Metric("sparkbus_uptime_seconds", "gauge", (), "Seconds since the broker started.", "uptime_s"),
    Metric("sparkbus_buffered_bytes", "gauge", (), "Bytes of batches held (queued or unacknowledged).",
           "buffered_bytes"),
    Metric("sparkbus_max_buffer_bytes", "gauge", (), "--max-buffer: bytes held before the feed is paused.",
           "max_buffer"),
    Metric("sparkbus_buffer_use_ratio", "gauge", (), "buffered_bytes / max_buffer_bytes."),
    Metric("sparkbus_feed_paused", "gauge", (), "1 while the feed socket is not read (the buffer is full).",
           "feed_paused"),
    Metric("sparkbus_stats_published_timestamp_seconds", "gauge", (),
           "Unix time of the snapshot these figures come from (the broker publishes one per heartbeat)."),
    Metric("sparkbus_streams", "gauge", (), "Streams the broker tracks (at most 4,096)."),
    Metric("sparkbus_retired_streams", "counter", (),
           "Streams dropped after --retire-streams-after unused.", "retired_streams"),
    Metric("sparkbus_older_peers", "gauge", ("version",),
           "Connections speaking an older protocol version than the broker's, by version."),
    Metric("sparkbus_refused_messages", "counter", ("socket", "reason"),
           "Messages and connections refused, by socket and reason."),
]

STREAM_METRICS: list[Metric] = [
    Metric("sparkbus_ranks_joined", "gauge", _STREAM, "Ranks connected to the stream."),
    Metric("sparkbus_ranks_expected", "gauge", _STREAM, "The communicator size the stream's ranks announced.",
           "expected_ranks"),
    Metric("sparkbus_batches_in_flight", "gauge", _STREAM,
           "Batches sent and not acknowledged, including those held for a lost rank."),
    Metric("sparkbus_orphaned_ranks", "gauge", _STREAM, "Lost ranks whose batches wait --rejoin-grace for them."),
    Metric("sparkbus_rejoins", "counter", _STREAM, "Ranks that came back and were reconciled.", "rejoins"),
    Metric("sparkbus_epoch", "gauge", _STREAM,
           "The stream's current epoch: the lowest not ended, else the last one."),
    Metric("sparkbus_epochs_delivered", "counter", _STREAM, "Epochs delivered and acknowledged.", "delivered"),
    Metric("sparkbus_stream_idle_seconds", "gauge", _STREAM, "Seconds since the stream was last in use.",
           "idle_s"),
    Metric("sparkbus_stream_verdict", "gauge", ("stream", "verdict"),
           "Why the stream's training waits, as sparkbus status says it: 1 for input-bound, window-round-trip or "
           "compute-bound, 0 for the other two (docs/OPERATIONS.md); none before its ranks report."),
]

VERDICTS = ("input-bound", "window-round-trip", "compute-bound")     # sparkbus_stream_verdict's label values

# Drawn from the epochs' figures (EpochFigures), one series per stream: a counter is the sum over the stream's epochs
# (the earlier ones' sums included), a gauge the current epoch's figure (see sparkbus_epoch), but for OVER_EPOCHS.
EPOCH_METRICS: list[Metric] = [
    Metric("sparkbus_batches_in", "counter", _STREAM, "Batches taken from the feed socket (first copies).",
           "batches_in"),
    Metric("sparkbus_rows_in", "counter", _STREAM, "Rows in the batches taken from the feed socket.", "rows_in"),
    Metric("sparkbus_bytes_in", "counter", _STREAM, "Payload bytes taken from the feed socket.", "bytes_in"),
    Metric("sparkbus_batches_out", "counter", _STREAM, "Batches handed to ranks (a requeued batch counts once).",
           "batches_handed"),
    Metric("sparkbus_rows_out", "counter", _STREAM, "Rows in the batches handed to ranks.", "rows_handed"),
    Metric("sparkbus_bytes_out", "counter", _STREAM,
           "Payload bytes handed to ranks (a requeued batch counts once).", "bytes_handed"),
    Metric("sparkbus_batches_acked", "counter", _STREAM, "Batches the ranks acknowledged.", "acked"),
    Metric("sparkbus_duplicate_batches", "counter", _STREAM,
           "Copies of batches already held, dropped (Spark task retries and speculative copies).", "duplicates"),
    Metric("sparkbus_redelivered_batches", "counter", _STREAM,
           "Sends of a batch that had gone out before (its rank died or left).", "redelivered"),
    Metric("sparkbus_diverged_partitions", "counter", _STREAM,
           "Partitions whose attempts sent different data (Spark recomputed them differently).", "diverged"),
    Metric("sparkbus_adopted_batches", "counter", _STREAM,
           "Batches of a lost broker the ranks had used, matched when Spark recomputed them: consumed, not sent.",
           "adopted"),
    Metric("sparkbus_unassigned_batches", "counter", _STREAM,
           "Batches of partitions this broker no longer carries (a recovery routed them elsewhere), dropped.",
           "unassigned"),
    Metric("sparkbus_superseded_attempts", "counter", _STREAM,
           "Task attempts that sent every batch they had but that Spark did not declare successful (an executor "
           "lost mid-partition, a failure upstream of the feed, a losing speculative copy): never committed.",
           "superseded"),
    Metric("sparkbus_batches_queued", "gauge", _STREAM, "Batches waiting in the broker for a rank (every epoch).",
           "queued"),
    Metric("sparkbus_batches_held_for_recovery", "gauge", _STREAM,
           "Messages (batches or packs) recomputed from Spark's lineage, waiting for every rank to say what it used.",
           "held"),
    Metric("sparkbus_partitions", "gauge", _STREAM, "Partitions of the current epoch.", "partitions"),
    Metric("sparkbus_partitions_committed", "gauge", _STREAM,
           "Partitions of the current epoch whose Spark task committed.", "committed"),
    Metric("sparkbus_epoch_closed", "gauge", _STREAM,
           "1 once the driver closed the current epoch (every partition in).", "closed"),
    Metric("sparkbus_epoch_ended", "gauge", _STREAM, "1 once the ranks were told the current epoch ended.",
           "ended"),
]
OVER_EPOCHS = frozenset({"queued", "held"})      # gauges summed over the stream's epochs, not the current one's

RANK_METRICS: list[Metric] = [
    Metric("sparkbus_rank_batches_sent", "counter", _RANK, "Batches sent to the rank's connection.", "batches", sum),
    Metric("sparkbus_rank_bytes_sent", "counter", _RANK, "Payload bytes sent to the rank's connection.", "bytes",
           sum),
    Metric("sparkbus_rank_batches_acked", "counter", _RANK, "Batches the rank acknowledged.", "acked", sum),
    Metric("sparkbus_rank_batches_in_flight", "gauge", _RANK, "Batches the rank holds unacknowledged.",
           "inflight", sum),
    Metric("sparkbus_rank_idle_seconds", "gauge", _RANK, "Seconds since the rank's last message.", "idle_s", min),
    Metric("sparkbus_rank_batches_consumed", "counter", _RANK,
           "Batches the rank's training loop took, as the rank reports.", "consumed", sum),
    Metric("sparkbus_rank_data_wait_seconds", "counter", _RANK,
           "Seconds the rank's training loop waited for data, as the rank reports.", "wait_s", sum),
    Metric("sparkbus_rank_first_batch_seconds", "gauge", _RANK,
           "Seconds from the rank's start to its first batch, as the rank reports.", "first_batch_s", min),
    Metric("sparkbus_rank_peer_wait_seconds", "counter", _RANK,
           "Of the rank's data wait, seconds it waited for peers to keep steps equal, as the rank reports.",
           "peer_wait_s", sum),
    Metric("sparkbus_rank_step_seconds", "counter", _RANK,
           "Seconds the rank's training loop spent on its batches (its own work), as the rank reports.", "step_s",
           sum),
]

METRICS: list[Metric] = BROKER_METRICS + STREAM_METRICS + EPOCH_METRICS + RANK_METRICS
METRIC = {m.name: m for m in METRICS}

