"""The headers a rank reads, as types: one ``TypedDict`` per message kind, for mypy only.

At run time a header is the plain dict :func:`~wire.protocol.unpack_header` returns (msgpack), validated there
against :data:`~wire.protocol.SCHEMAS` (required fields) and :data:`~wire.protocol.OPTIONAL` (fields a header may
carry). These types say the same, so that code reading ``header["rows"]`` is checked, and name the few fields the
rank adds itself (a pack's batch: ``index``, ``nbytes``; a batch carried to another rank: ``arrived``; a loss found
by a rejoin: ``restarted``). A unit test holds them to the schemas. The ``kind`` of each is a literal: comparing
``header["kind"]`` with a :class:`~wire.protocol.Kind` narrows a :data:`FromBroker` to its kind. (A kind's
required fields are a base class, its optional ones a ``total=False`` class over it: ``NotRequired`` needs 3.11.)
"""

from __future__ import annotations

from typing import Literal, TypedDict

from sparkbus.wire.protocol import Kind


class _Header(TypedDict):
    v: int                  # the protocol version it speaks (unpack_header reads an older one as it defined it)


class _OfEpoch(_Header):
    stream: str
    epoch: int


class _BatchFields(_OfEpoch):
    kind: Literal[Kind.BATCH]
    part: int
    seq: int
    attempt: int
    rows: int
    cols: list
    checksum: int


class BatchHeader(_BatchFields, total=False):
    """``BATCH``, as the rank sees it: a batch, a pack of small batches, or one batch of a pack cut out of it."""

    splits: list[int]       # a pack: the rows of each of its batches
    take: list[int]         # [first, stop]: the pack's batches meant for this rank
    cut: list[int]          # [lo, hi]: the rows of the one batch meant for this rank (an epoch's remainder)
    repeat: bool            # ... rows another rank has too (remainder "pad")
    bucket: int             # coordinated buckets: the length bucket of its rows (feed(bucket_bounds=))
    index: int              # set by the rank: which batch of its pack this is
    nbytes: int             # set by the rank: the bytes of its frames (a pack's batch: its share)
    arrived: int            # a batch carried between ranks (worker.rebalance): its message's checksum as it arrived


class _StepsFields(_OfEpoch):
    kind: Literal[Kind.STEPS]
    steps: int


class StepsHeader(_StepsFields, total=False):
    """``STEPS``: of ``epoch``, the batches of this broker every rank of the group may use (cumulative)."""

    adopted: int            # of this rank's count, the batches it used of lost brokers


class ReleaseHeader(_OfEpoch):
    """``RELEASE``, at an epoch's end (granted steps): keep ``keep``, drop ``drop``, return the rest."""

    kind: Literal[Kind.RELEASE]
    keep: int
    drop: int


class _EpochEndFields(_OfEpoch):
    kind: Literal[Kind.EPOCH_END]
    batches: int


class EpochEndHeader(_EpochEndFields, total=False):
    """``EPOCH_END``: no more batches of ``epoch`` will come from this broker."""

    steps: int              # granted steps: the epoch's steps from this broker, the same on every rank


class _LostFields(_OfEpoch):
    kind: Literal[Kind.LOST]
    lost: str


class LostHeader(_LostFields, total=False):
    """``LOST``: the broker of incarnation ``lost`` lost ``epoch``."""

    restarted: bool         # set by the rank: its own rejoin found that broker restarted without a journal


class _WelcomeFields(_Header):
    kind: Literal[Kind.WELCOME]
    req: int
    broker: str
    incarnation: str
    journal: bool
    free: int


class WelcomeHeader(_WelcomeFields, total=False):
    """``WELCOME``: a HELLO accepted."""

    ranks: int
    unread: list[str]       # streams that hold data no rank reads (this rank's has nothing under way)


class _HeartbeatFields(_Header):
    kind: Literal[Kind.HEARTBEAT]


class HeartbeatHeader(_HeartbeatFields, total=False):
    """``HEARTBEAT``: still here."""

    wait_s: float
    first_batch_s: float
    consumed: int
    peer_wait_s: float
    step_s: float
    unread: list[str]       # as WELCOME's


class ErrorHeader(_Header):
    """``ERROR``: a request refused; ``code`` (an :class:`~wire.protocol.ErrorCode`) says why."""

    kind: Literal[Kind.ERROR]
    req: int
    code: int
    reason: str


# What a broker sends a rank; and what the rank's connection passes on to its intake (BrokerConnection.receive).
FromBroker = (BatchHeader | StepsHeader | ReleaseHeader | EpochEndHeader | LostHeader | WelcomeHeader
              | HeartbeatHeader | ErrorHeader)
ToIntake = BatchHeader | StepsHeader | ReleaseHeader | EpochEndHeader | LostHeader
