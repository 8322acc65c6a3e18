"""The headers a broker reads, as types: one ``TypedDict`` per message kind sent to it, for mypy only.

As in :mod:`wire.headers` (what a rank reads), a header is at run time the plain dict
:func:`~wire.protocol.unpack_header` returns, validated there against :data:`~wire.protocol.SCHEMAS` and
:data:`~wire.protocol.OPTIONAL`; these types say the same, and a unit test holds them to the schemas. A kind's
required fields are a base class, its optional ones a ``total=False`` class over it. ``BATCH`` and ``HEARTBEAT``
are :class:`~wire.headers.BatchHeader` and :class:`~wire.headers.HeartbeatHeader`: the same header both ways.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from sparkbus.wire.headers import HeartbeatHeader
from sparkbus.wire.protocol import Kind


class _Request(TypedDict):
    v: int
    req: int                # the sender's request number, echoed in the reply


class _OfEpoch(_Request):
    stream: str
    epoch: int


class _HelloFields(_Request):
    kind: Literal[Kind.HELLO]
    role: str               # "feeder", "rank" or "client"
    stream: str
    rank: int
    size: int
    even: bool
    session: str
    resume: bool
    ended: int


class HelloHeader(_HelloFields, total=False):
    """``HELLO``: a feeder or client checks the version; a rank joins ``stream`` (or rejoins it)."""

    grants: bool            # even steps granted by the broker (STEPS)
    got: int                # a rank that rejoins: the batches of its current epoch it has had
    incarnation: str        # ... the incarnation of the broker it knew
    remainder: str          # granted steps: what the epoch's last batches become
    resumes: int            # a rank resuming this epoch from a checkpoint


class _EpochOpenFields(_OfEpoch):
    kind: Literal[Kind.EPOCH_OPEN]
    partitions: int
    delivery: str


class EpochOpenHeader(_EpochOpenFields, total=False):
    """``EPOCH_OPEN``: an epoch of at most ``partitions`` partitions begins."""

    commit: str             # who commits a partition's attempt: "end" or "driver"


class _EpochCloseFields(_OfEpoch):
    kind: Literal[Kind.EPOCH_CLOSE]
    partitions: int


class EpochCloseHeader(_EpochCloseFields, total=False):
    """``EPOCH_CLOSE``: the Spark job succeeded with ``partitions`` partitions."""

    expected: int           # the partitions committed at this broker (default: all of them)


class _EpochRecoverFields(_OfEpoch):
    kind: Literal[Kind.EPOCH_RECOVER]
    partitions: int
    delivery: str
    carries: list[int]      # partition ranges this broker streams
    recovered: list[int]    # ... of them, a lost broker's (or all, for a resume)
    lost: list[str]         # the lost incarnations waited for
    reset: bool             # a resume: forget what the broker had of the epoch first


class EpochRecoverHeader(_EpochRecoverFields, total=False):
    """``EPOCH_RECOVER``: partitions of ``epoch`` Spark feeds again (a lost broker's, or a resume)."""

    commit: str


class EpochQueryHeader(_OfEpoch):
    """``EPOCH_QUERY``: what the broker has of ``epoch``."""

    kind: Literal[Kind.EPOCH_QUERY]


class PartitionEndHeader(_OfEpoch):
    """``PARTITION_END``: a task attempt sent ``batches`` batches (``rows`` rows) of partition ``part``."""

    kind: Literal[Kind.PARTITION_END]
    part: int
    attempt: int
    batches: int
    rows: int


class PartitionClaimHeader(_OfEpoch):
    """``PARTITION_CLAIM``: to a partition's home broker, which broker streams it."""

    kind: Literal[Kind.PARTITION_CLAIM]
    part: int
    broker: int


class PartitionCommitHeader(_OfEpoch):
    """``PARTITION_COMMIT``: the attempts Spark declared successful, ``[part, attempt, batches]`` flat."""

    kind: Literal[Kind.PARTITION_COMMIT]
    parts: list[int]


class StatsRequestHeader(_Request):
    """``STATS_REQUEST``: the broker's figures."""

    kind: Literal[Kind.STATS_REQUEST]


class CreditHeader(TypedDict):
    """``CREDIT``: a rank's window, in batches or bytes."""

    v: int
    kind: Literal[Kind.CREDIT]
    window: int
    window_bytes: int


class _AckFields(TypedDict):
    v: int
    kind: Literal[Kind.ACK]
    ids: list[int]          # batch ids flat: epoch, part, seq, ...


class AckHeader(_AckFields, total=False):
    """``ACK``: batches consumed, and the rank's own figures (as on ``HEARTBEAT``)."""

    upto: list[int]         # progress in packs: epoch, part, seq, stop, ...
    wait_s: float
    first_batch_s: float
    consumed: int
    peer_wait_s: float
    step_s: float


class ReturnHeader(TypedDict):
    """``RETURN``: held, unused batches of ``epoch`` go back for other ranks; the rank keeps ``kept``."""

    v: int
    kind: Literal[Kind.RETURN]
    stream: str
    epoch: int
    ids: list[int]
    kept: int


class _ReclaimFields(TypedDict):
    v: int
    kind: Literal[Kind.RECLAIM]
    stream: str
    epoch: int
    lost: str               # the lost broker's incarnation, or RESUME_LOSS for a resume from a checkpoint
    entries: int            # the used entries in the frame after the header


class ReclaimHeader(_ReclaimFields, total=False):
    """``RECLAIM``: the batches of ``epoch`` a rank used from a broker that lost them (or before a checkpoint)."""

    cuts: list[int]         # rows of batches used: part, seq, index, lo, hi, checksum, ...


class ByeHeader(TypedDict):
    """``BYE``: a rank leaves its stream."""

    v: int
    kind: Literal[Kind.BYE]


ToBroker = (HelloHeader | EpochOpenHeader | EpochCloseHeader | EpochRecoverHeader | EpochQueryHeader
            | PartitionEndHeader | PartitionClaimHeader | PartitionCommitHeader | StatsRequestHeader | CreditHeader
            | AckHeader | ReturnHeader | ReclaimHeader | ByeHeader)

# What a rank tells about itself (its figures) comes on either
RankReport = AckHeader | HeartbeatHeader
