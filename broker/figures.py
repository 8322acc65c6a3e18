"""The broker's figures (``STATS_REPLY.stats``), defined once: the records the ledger fills in, ``sparkbus status``
prints, the Prometheus exporter renders and docs/PROTOCOL.md ("Statistics") describes.

They travel as msgpack maps and are kept in ``retired.log`` as they are, so they are ``TypedDict``\\ s: plain dicts
on the wire and on disk, typed in the code. A unit test holds docs/PROTOCOL.md's list of fields to these records
and docs/OPERATIONS.md's list of metrics to :data:`EPOCH_METRICS`, :data:`RANK_METRICS` and the exporter.

Figures of epochs retired by an older broker may lack fields added since (``rows_out``): readers use ``.get``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, TypedDict


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
    batches_out: int         # handed to ranks; a batch requeued after its rank died counts once
    bytes_out: int
    rows_out: int
    acked: int               # acknowledged by ranks
    duplicates: int          # copies from task retries or speculation, dropped (messages)
    redelivered: int         # sends of a batch that had gone out before
    given_twice: int         # batches a rank came back with after --rejoin-grace, given to another meanwhile
    diverged: list[int]      # partitions whose attempts sent different data


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


# what a rank reports about itself (protocol.OPTIONAL of ACK and HEARTBEAT), in order
REPORTED = tuple(k for k in RankFigures.__annotations__ if k in RankFigures.__optional_keys__)


class OrphanFigures(TypedDict):
    """A lost rank whose batches wait ``--rejoin-grace`` for it."""

    rank: int
    inflight: int
    expires_in_s: float


class StreamFigures(TypedDict):
    expected_ranks: int      # the communicator size its ranks announced
    rejoins: int             # ranks that came back and were reconciled
    epochs: dict[str, EpochFigures]      # by epoch number, as a string (msgpack and JSON map keys)
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


class Figures(TypedDict):
    """``Broker.stats()``: what ``STATS_REPLY`` carries and ``sparkbus status --json`` prints."""

    broker: BrokerFigures
    streams: dict[str, StreamFigures]


# ---- the metrics drawn from them (broker/metrics.py renders these; docs/OPERATIONS.md lists them) ----------------


class Metric(NamedTuple):
    """A Prometheus metric read from one field of a record. ``name`` without ``_total``: a counter family adds it."""

    field: str
    name: str
    kind: str                # "counter" or "gauge"
    help: str


class RankMetric(NamedTuple):
    field: str
    name: str
    kind: str
    help: str
    combine: Callable[[list[float]], float]     # how connections with the same stream and rank number combine


# Labels stream, epoch.
EPOCH_METRICS: list[Metric] = [
    Metric("batches_in", "sparkbus_batches_in", "counter", "Batches taken from the feed socket (first copies)."),
    Metric("rows_in", "sparkbus_rows_in", "counter", "Rows in the batches taken from the feed socket."),
    Metric("bytes_in", "sparkbus_bytes_in", "counter", "Payload bytes taken from the feed socket."),
    Metric("batches_out", "sparkbus_batches_out", "counter",
           "Batches handed to ranks (a requeued batch counts once)."),
    Metric("rows_out", "sparkbus_rows_out", "counter", "Rows in the batches handed to ranks."),
    Metric("bytes_out", "sparkbus_bytes_out", "counter",
           "Payload bytes handed to ranks (a requeued batch counts once)."),
    Metric("acked", "sparkbus_batches_acked", "counter", "Batches the ranks acknowledged."),
    Metric("duplicates", "sparkbus_duplicate_batches", "counter",
           "Copies of batches already held, dropped (Spark task retries and speculative copies)."),
    Metric("redelivered", "sparkbus_redelivered_batches", "counter",
           "Sends of a batch that had gone out before (its rank died or left)."),
    Metric("queued", "sparkbus_batches_queued", "gauge", "Batches waiting in the broker for a rank."),
    Metric("partitions", "sparkbus_partitions", "gauge", "Partitions of the epoch."),
    Metric("committed", "sparkbus_partitions_committed", "gauge", "Partitions whose Spark task committed."),
    Metric("diverged", "sparkbus_diverged_partitions", "gauge",
           "Partitions whose attempts sent different data (Spark recomputed them differently)."),
    Metric("closed", "sparkbus_epoch_closed", "gauge", "1 once the driver closed the epoch (every partition in)."),
    Metric("ended", "sparkbus_epoch_ended", "gauge", "1 once the ranks were told the epoch ended."),
]

# Labels stream, rank.
RANK_METRICS: list[RankMetric] = [
    RankMetric("batches", "sparkbus_rank_batches_sent", "counter", "Batches sent to the rank's connection.", sum),
    RankMetric("bytes", "sparkbus_rank_bytes_sent", "counter", "Payload bytes sent to the rank's connection.", sum),
    RankMetric("acked", "sparkbus_rank_batches_acked", "counter", "Batches the rank acknowledged.", sum),
    RankMetric("inflight", "sparkbus_rank_batches_in_flight", "gauge", "Batches the rank holds unacknowledged.",
               sum),
    RankMetric("idle_s", "sparkbus_rank_idle_seconds", "gauge", "Seconds since the rank's last message.", min),
    RankMetric("consumed", "sparkbus_rank_batches_consumed", "counter",
               "Batches the rank's training loop took, as the rank reports.", sum),
    RankMetric("wait_s", "sparkbus_rank_data_wait_seconds", "counter",
               "Seconds the rank's training loop waited for data, as the rank reports.", sum),
    RankMetric("first_batch_s", "sparkbus_rank_first_batch_seconds", "gauge",
               "Seconds from the rank's start to its first batch, as the rank reports.", min),
]

# Counters the ledger lowers when it requeues a batch (it undoes the send): the exporter renders them as their
# high-water mark within one broker process, so that Prometheus does not mistake the undo for a counter reset.
HIGH_WATER = frozenset({"batches_out", "bytes_out", "rows_out"})
