"""The sparkbus wire protocol: message kinds, their header schemas, and validation on receipt.

Every message is a ZeroMQ multipart message. Frame 0 is a msgpack map, the *header*; a data batch adds its
columns' buffers as raw frames, laid out as Arrow lays them out (validity bitmaps, offsets, values). Nothing on
the wire is ever pickled. The prose contract is ``docs/PROTOCOL.md``; this module is its implementation, and the
two must say the same thing (a unit test compares the document's message table with :data:`SCHEMAS`). A refusal
is an ``ERROR`` whose ``code`` (:class:`ErrorCode`) clients act on.

The rest of the contract lives beside this module, one role each: :mod:`sparkbus.wire.codec` turns columns into
batch frames and back, :mod:`sparkbus.wire.ragged` is the rank's view of a variable-length column,
:mod:`sparkbus.wire.records` holds the records it reads by position (a batch's id, what a rank used) as named tuples,
:mod:`sparkbus.wire.address` derives endpoints, :mod:`sparkbus.wire.errors` holds the errors.
This module needs no numpy: the broker validates batches from their headers and frame lengths alone.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from enum import IntEnum
from typing import Any

import msgpack

from sparkbus.wire.errors import ProtocolError, VersionMismatch
from sparkbus.wire.records import BatchId, UsedCut, UsedEntry

VERSION = 7
SUPPORTED = (VERSION - 1, VERSION)   # what this side reads and speaks: its own version and the one before
RECOVERY_VERSION = 6      # the version that brought recovery from lineage and exact resume (RECLAIM, LOST, ...)
MAX_HEADER_BYTES = 64 * 1024
MAX_SPLITS = 4096         # small batches in one pack at most
MAX_FRAME_ITEMS = 1 << 48     # values (or offsets) in one column frame at most: far beyond any message size
# Length buckets a coordinated feed may have (``feed(bucket_bounds=)``: one more than its bounds): a BATCH's
# ``bucket`` is below this, so a broker's pools of them are bounded whatever a peer sends.
MAX_BUCKETS = 64


class Kind(IntEnum):
    """Message kinds. The comment says who sends it, to whom, and on which socket."""

    BATCH = 1                 # feeder -> broker (feed PULL); broker -> rank (ranks ROUTER), frames unchanged
    PARTITION_END = 2         # feeder -> broker (control): "I sent `batches` batches of this partition"
    PARTITION_COMMITTED = 3   # broker -> feeder (control): every batch of the partition arrived
    EPOCH_OPEN = 4            # driver -> broker (control): an epoch of (at most) `partitions` partitions begins
    EPOCH_CLOSE = 5           # driver -> broker (control): the Spark job succeeded, no more partitions
    OK = 6                    # broker -> driver/feeder (control): request done
    HELLO = 7                 # feeder or rank -> broker: version check, and a rank joins a stream
    WELCOME = 8               # broker -> feeder or rank: hello accepted
    CREDIT = 9                # rank -> broker: my window: up to `window` batches or `window_bytes` in flight
    ACK = 10                  # rank -> broker: these batches were consumed (their room in the window is free)
    HEARTBEAT = 11            # both ways on the ranks socket: "still here"
    EPOCH_END = 12            # broker -> rank: no more batches of `epoch` will come to you
    ERROR = 13                # broker -> anyone: a request was refused; `code` says why (`reason`: for a human)
    STATS_REQUEST = 14        # anyone -> broker (control or ranks socket)
    STATS_REPLY = 15          # broker -> requester: `stats` map (see docs/PROTOCOL.md)
    BYE = 16                  # rank -> broker: leaving the stream
    PARTITION_CLAIM = 17      # feeder -> the partition's home broker (control): which broker streams it (OK)
    STEPS = 18                # broker -> rank (granted streams): `steps` batches of `epoch` from me may be used
    RELEASE = 19              # broker -> rank (granted streams), at an epoch's end: keep `keep`, drop `drop`, return
    RETURN = 20               # rank -> broker: these held, unused batches (or a pack's tail) go back for others
    RECLAIM = 21              # rank -> broker (ranks): the batches of `epoch` it used from a broker that lost them
    LOST = 22                 # broker -> rank (ranks): the broker of incarnation `lost` lost `epoch`: send RECLAIM
    EPOCH_RECOVER = 23        # driver -> broker (control): partitions of `epoch` Spark feeds again, a lost broker's
    EPOCH_QUERY = 24          # driver -> broker (control): what the broker has of `epoch` (OK: see PROTOCOL.md)
    PARTITION_RECEIVED = 25   # broker -> feeder (control): every batch of the attempt arrived; Spark's word commits it
    PARTITION_COMMIT = 26     # driver -> broker (control): these attempts are the ones Spark declared successful


class ErrorCode(IntEnum):
    """Why the broker answered ``ERROR``: its ``code`` field. Clients decide on the code, never on ``reason``,
    which is for a human and may be reworded. docs/PROTOCOL.md lists the codes and what a client does."""

    MALFORMED = 1             # unreadable: not msgpack, a bad field, the wrong frames (`req` is 0 if unreadable)
    VERSION = 2               # the request speaks another protocol version
    UNEXPECTED_KIND = 3       # a kind this socket does not take
    REFUSED = 4               # a valid request the broker's rules refuse (an epoch not open, a bad window, ...)
    UNKNOWN_RANK = 5          # a rank's message on a connection that has not joined: rejoin (HELLO, resume)
    ALREADY_CONNECTED = 6     # another process holds this rank number: retry, it clears once that one is dead
    INTERNAL = 7              # a broker bug, logged with its traceback; the broker keeps serving


# Per kind, the fields a header must carry beyond "v" and "kind", and their types.
# One definition per kind: senders build headers from it, receivers validate against it.
SCHEMAS: dict[Kind, dict[str, type | tuple[type, ...]]] = {
    Kind.BATCH: {"stream": str, "epoch": int, "part": int, "seq": int, "attempt": int, "rows": int,
                 "cols": list, "checksum": int},
    Kind.PARTITION_END: {"req": int, "stream": str, "epoch": int, "part": int, "attempt": int,
                         "batches": int, "rows": int},
    Kind.PARTITION_COMMITTED: {"req": int, "stream": str, "epoch": int, "part": int},
    Kind.EPOCH_OPEN: {"req": int, "stream": str, "epoch": int, "partitions": int, "delivery": str},
    Kind.EPOCH_CLOSE: {"req": int, "stream": str, "epoch": int, "partitions": int},
    Kind.OK: {"req": int},
    Kind.HELLO: {"req": int, "role": str, "stream": str, "rank": int, "size": int, "even": bool,
                 "session": str, "resume": bool, "ended": int},
    Kind.WELCOME: {"req": int, "broker": str, "incarnation": str, "journal": bool, "free": int},
    Kind.CREDIT: {"window": int, "window_bytes": int},
    Kind.ACK: {"ids": list},
    Kind.HEARTBEAT: {},
    Kind.EPOCH_END: {"stream": str, "epoch": int, "batches": int},
    Kind.ERROR: {"req": int, "code": int, "reason": str},     # code: an ErrorCode
    Kind.STATS_REQUEST: {"req": int},
    Kind.STATS_REPLY: {"req": int, "stats": dict},
    Kind.BYE: {},
    Kind.PARTITION_CLAIM: {"req": int, "stream": str, "epoch": int, "part": int, "broker": int},
    Kind.STEPS: {"stream": str, "epoch": int, "steps": int},
    Kind.RELEASE: {"stream": str, "epoch": int, "keep": int, "drop": int},
    Kind.RETURN: {"stream": str, "epoch": int, "ids": list, "kept": int},
    Kind.RECLAIM: {"stream": str, "epoch": int, "lost": str, "entries": int},     # + one frame: pack_used()
    Kind.LOST: {"stream": str, "epoch": int, "lost": str},
    Kind.EPOCH_RECOVER: {"req": int, "stream": str, "epoch": int, "partitions": int, "delivery": str,
                         "carries": list, "recovered": list, "lost": list, "reset": bool},
    Kind.EPOCH_QUERY: {"req": int, "stream": str, "epoch": int},
    Kind.PARTITION_RECEIVED: {"req": int, "stream": str, "epoch": int, "part": int, "attempt": int},
    Kind.PARTITION_COMMIT: {"req": int, "stream": str, "epoch": int, "parts": list},   # [part, attempt, batches]*
}

# Fields a header may carry, checked for type when present (additions that older senders leave out).
OPTIONAL: dict[Kind, dict[str, type]] = {
    Kind.BATCH: {"splits": list,           # a pack of small batches: the rows of each, in order
                 "take": list,             # [first, stop]: only these of the pack's batches are for this rank
                 "cut": list,              # [lo, hi]: only rows lo..hi-1 of the one batch it names (an epoch's end)
                 "repeat": bool,           # ... a copy of rows another rank has too (remainder "pad")
                 "bucket": int},           # coordinated buckets: the length bucket of the batch's rows
    Kind.HELLO: {"grants": bool,           # even steps granted by the broker (STEPS), not agreed among the ranks
                 "got": int,               # ... a rank that rejoins: the batches of its current epoch it has had
                 "incarnation": str,       # a rank that rejoins: the incarnation of the broker it knew
                 "remainder": str,         # granted steps: what the epoch's last batches become (REMAINDERS)
                 "resumes": int},          # a rank resuming this epoch from a checkpoint (BatchStream(resume=))
    Kind.STEPS: {"adopted": int},          # of the rank's count, batches it used from lost brokers (RECLAIM)
    Kind.EPOCH_END: {"steps": int},        # granted streams: the epoch's steps from this broker, the same for all
    Kind.EPOCH_CLOSE: {"expected": int},   # partitions committed at this broker (default: all of them)
    Kind.EPOCH_OPEN: {"commit": str},      # who commits a partition: "end" (its PARTITION_END) or "driver"
    Kind.EPOCH_RECOVER: {"commit": str},   # ... for an epoch EPOCH_RECOVER opens
    Kind.RECLAIM: {"cuts": list},          # rows of batches used: [part, seq, index, lo, hi, checksum]*
    # a rank's own figures, on the messages it sends anyway: for `sparkbus status` and the metrics
    Kind.ACK: {"wait_s": float, "first_batch_s": float, "consumed": int,
               "peer_wait_s": float,           # of wait_s, the wait for peers (equal steps: a grant, an agreement)
               "step_s": float,                # the training loop's own time with its batches
               "upto": list},                  # progress in packs: [e, p, s, stop, ...], batches before stop used
    Kind.HEARTBEAT: {"wait_s": float, "first_batch_s": float, "consumed": int, "peer_wait_s": float,
                     "step_s": float,
                     "unread": list},      # broker -> rank whose stream has nothing under way: streams no rank reads
    Kind.WELCOME: {"ranks": int,           # to a feeder's HELLO naming a stream: the ranks reading it now
                   "unread": list},        # to a rank's: as HEARTBEAT's
}

# What each version added to the one before. A header of an older version is read as that version defined it: a
# kind added since is a protocol error, an optional field added since is dropped (its sender cannot have meant it).
ADDED: dict[int, tuple[frozenset[Kind], dict[Kind, tuple[str, ...]]]] = {
    5: (frozenset({Kind.STEPS, Kind.RELEASE, Kind.RETURN}),
        {Kind.BATCH: ("take",), Kind.HELLO: ("grants", "got"), Kind.EPOCH_END: ("steps",),
            Kind.ACK: ("upto",)}),
    6: (frozenset({Kind.RECLAIM, Kind.LOST, Kind.EPOCH_RECOVER, Kind.EPOCH_QUERY}),
        {Kind.HELLO: ("incarnation",), Kind.STEPS: ("adopted",)}),
    7: (frozenset({Kind.PARTITION_RECEIVED, Kind.PARTITION_COMMIT}),
        {Kind.EPOCH_OPEN: ("commit",), Kind.EPOCH_RECOVER: ("commit",), Kind.WELCOME: ("ranks", "unread"),
            Kind.HEARTBEAT: ("unread", "peer_wait_s", "step_s"), Kind.BATCH: ("cut", "repeat", "bucket"),
            Kind.HELLO: ("remainder", "resumes"), Kind.RECLAIM: ("cuts",), Kind.ACK: ("peer_wait_s", "step_s")}),
}

_KINDS = {int(k): k for k in Kind}
ROLES = ("feeder", "rank", "client")
DELIVERY_MODES = ("stream", "atomic")
# Who commits a partition's attempt: "end", its own PARTITION_END (a feed without Spark, and every epoch opened by
# a version-6 driver); "driver", the driver's PARTITION_COMMIT naming the attempt Spark declared successful.
COMMIT_MODES = ("end", "driver")
# What the batches left over at an epoch's end (fewer than the ranks) become with granted or agreed steps:
# "split", shared out by rows so that every rank takes one more, smaller step (the default); "drop", dropped
# (counted); "pad", each rank a whole batch, repeats of them for the ranks short of one (counted).
REMAINDERS = ("split", "drop", "pad")
# RECLAIM's ``lost`` that names no lost broker but a resume from a checkpoint: what the checkpointed model had used of
# the epoch (``BatchStream(resume=)``). An incarnation is never empty, so the two cannot meet.
RESUME_LOSS = ""
MAX_CUTS = 4096           # [part, seq, index, lo, hi, checksum] entries in one RECLAIM's cuts
MAX_COMMITS = 1024        # [part, attempt, batches] triplets in one PARTITION_COMMIT (its header stays < 32 KiB)

# Leaf dtypes allowed on the wire (numpy's ``dtype.str``): fixed-size numbers, little-endian or byte-sized,
# dates and times as datetime64/timedelta64, and the byte strings of binary ("bin") and string ("str") columns.
ITEMSIZE = {"|b1": 1, "|i1": 1, "|u1": 1, "<i2": 2, "<u2": 2, "<i4": 4, "<u4": 4, "<i8": 8, "<u8": 8,
            "<f2": 2, "<f4": 4, "<f8": 8,
            **{f"<{kind}8[{unit}]": 8 for kind in "Mm" for unit in ("D", "s", "ms", "us", "ns")},
            "bin": 1, "str": 1}
WIRE_DTYPES = frozenset(ITEMSIZE)
BYTE_STRINGS = frozenset({"bin", "str"})     # leaves whose innermost level is the offsets of each value's bytes
OFFSET_WIDTHS = (4, 8)                         # int32 or int64 offsets, as Arrow's list/large_list


def pack_header(kind: Kind, **fields: Any) -> bytes:
    """Encode a header of ``kind``, in :data:`VERSION` or in the version ``v=`` says (a connection's, see
    :func:`negotiated`). Fields are taken as given; receivers validate them."""
    fields.setdefault("v", VERSION)
    fields["kind"] = int(kind)
    return msgpack.packb(fields, use_bin_type=True)


def negotiated(theirs: Any) -> int | None:
    """The version a connection speaks when its peer says ``theirs`` (its HELLO's, or the broker's ERROR's ``v``):
    that version if this side speaks it too (:data:`SUPPORTED`), else None."""
    return theirs if type(theirs) is int and theirs in SUPPORTED else None


def reencode(frame: bytes | memoryview, version: int) -> bytes:
    """A header frame (as received, already validated) in another version this side speaks: its ``v`` changed, the
    fields that version does not know dropped. What a broker does to a frame it forwards to an older peer."""
    header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    if header.get("v") == version:
        return bytes(frame)
    header["v"] = version
    for added in range(version + 1, VERSION + 1):
        for name in ADDED.get(added, (frozenset(), {}))[1].get(Kind(header["kind"]), ()):
            header.pop(name, None)
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(buf: bytes | memoryview) -> dict[str, Any]:
    """Decode and validate a header frame.

    A header of any version in :data:`SUPPORTED` is read; one of an older version as that version defined it
    (:data:`ADDED`). ``header["v"]`` says which it was.

    Returns:
        The header as a dict; ``header["kind"]`` is a :class:`Kind`.
    Raises:
        VersionMismatch: the version field is not one of :data:`SUPPORTED`.
        ProtocolError: oversized, not msgpack, not a map, unknown kind, missing or mistyped fields.
    """
    if len(buf) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {len(buf)} bytes exceeds the limit of {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises several unrelated types for garbage
        raise ProtocolError("header is not valid msgpack") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    version = header.get("v")
    raw_kind = header.get("kind")
    kind = _KINDS.get(raw_kind) if type(raw_kind) is int else None
    if version != VERSION:
        if type(version) is not int or version not in SUPPORTED:
            raise VersionMismatch(version, VERSION, also=SUPPORTED[0] if SUPPORTED[0] != VERSION else None)
        if kind is not None:
            kind = _older(header, kind, version)
    if kind is None:
        raise ProtocolError(f"unknown message kind {raw_kind!r}")
    header["kind"] = kind
    get = header.get
    for name, expected in _REQUIRED[kind]:
        if type(get(name)) is not expected:   # msgpack makes exact types; a bool is not an int here
            raise _field_error(kind, name, get(name), expected)
    for name, expected in _OPTIONAL[kind]:
        if name in header and type(header[name]) is not expected:
            raise _field_error(kind, name, header[name], expected)
    return header


def _older(header: dict[str, Any], kind: Kind, version: int) -> Kind:
    """Read a header of an older ``version`` as it defined it (see :data:`ADDED`)."""
    for added in range(version + 1, VERSION + 1):
        kinds, fields = ADDED.get(added, (frozenset(), {}))
        if kind in kinds:
            raise ProtocolError(f"{kind.name} is not a message of protocol version {version}")
        for name in fields.get(kind, ()):
            header.pop(name, None)
    return kind


# The checks above, flattened once per kind: on the broker's hot path a header costs a few dict lookups.
_REQUIRED = {kind: tuple(fields.items()) for kind, fields in SCHEMAS.items()}
_OPTIONAL = {kind: tuple(OPTIONAL.get(kind, {}).items()) for kind in Kind}


def _field_error(kind: Kind, name: str, value: Any, expected: type | tuple[type, ...]) -> ProtocolError:
    return ProtocolError(f"{kind.name} header field {name!r} must be {_type_name(expected)}, "
                         f"got {type(value).__name__}")


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


def check_batch_frames(header: Mapping[str, Any], frame_sizes: Sequence[int]) -> None:
    """Check that a BATCH header describes exactly the column frames that came with it.

    The broker calls this with frame lengths only, so it never touches the payload. What only the payload can
    show (offsets that rise and end where the next level's count says) is checked by the rank's decoder.

    Raises:
        ProtocolError: wrong frame count, bad column spec, unsupported dtype, or size mismatch.
    """
    rows = header["rows"]
    if not 0 <= rows <= MAX_FRAME_ITEMS:
        raise ProtocolError("negative row count" if rows < 0 else f"row count out of range (at most {MAX_FRAME_ITEMS})")
    expected = []
    for spec in header["cols"]:
        expected.extend(column_frame_sizes(spec, rows))
    if len(expected) != len(frame_sizes):
        raise ProtocolError(f"batch header describes {len(expected)} frames but {len(frame_sizes)} came")
    for i, (want, size) in enumerate(zip(expected, frame_sizes)):
        if want != size:
            raise ProtocolError(f"frame {i + 1}: {size} bytes, the header says {want}")
    splits = header.get("splits")
    if splits is not None and (not splits or len(splits) > MAX_SPLITS    # the types first: sum() of str raises
                               or not all(type(n) is int and n >= 0 for n in splits) or sum(splits) != rows):
        raise ProtocolError(f"a pack's splits must be 1 to {MAX_SPLITS} row counts that add up to its {rows} rows")
    if "take" in header:
        taken_range(header)
    bucket = header.get("bucket")
    if bucket is not None and (not 0 <= bucket < MAX_BUCKETS or splits is not None):
        raise ProtocolError(f"a BATCH's bucket must be 0..{MAX_BUCKETS - 1}, on a batch alone (not a pack), got "
                            f"{bucket}{' on a pack' if splits is not None else ''}")


def taken_range(header: Mapping[str, Any]) -> tuple[int, int]:
    """The batches of a pack meant for the receiving rank: ``(first, stop)``, all of them unless the broker sent a
    slice (``take``, at an epoch's end, see docs/PROTOCOL.md "Granted steps").

    Raises:
        ProtocolError: a ``take`` that is not ``[first, stop]`` within the pack's splits.
    """
    splits = header.get("splits")
    whole = len(splits) if splits is not None else 1
    take = header.get("take")
    if take is None:
        return 0, whole
    if (splits is None or len(take) != 2 or not all(type(i) is int for i in take)
            or not 0 <= take[0] < take[1] <= whole):
        raise ProtocolError(f"a BATCH's take must be [first, stop] within its {whole} batches, got {take!r:.40}")
    return take[0], take[1]


def row_cut(header: Mapping[str, Any]) -> tuple[int, int] | None:
    """The rows of a batch meant for the receiving rank when the broker sent part of one (``cut``, an epoch's
    remainder shared out by rows, see docs/PROTOCOL.md "The epoch's remainder"): ``(lo, hi)``, else None.

    Raises:
        ProtocolError: a ``cut`` that is not ``[lo, hi]`` within the rows of the one batch the message names.
    """
    cut = header.get("cut")
    if cut is None:
        return None
    first, stop = taken_range(header)
    splits = header.get("splits")
    rows = splits[first] if splits is not None else header["rows"]
    if (stop - first != 1 or len(cut) != 2 or not all(type(i) is int for i in cut)
            or not 0 <= cut[0] <= cut[1] <= rows):
        raise ProtocolError(f"a BATCH's cut must be [lo, hi] within the {rows} rows of the one batch it names, got "
                            f"{cut!r:.40}")
    return cut[0], cut[1]


def unpack_cuts(flat: Sequence[Any]) -> list[UsedCut]:
    """RECLAIM's ``cuts``: a :class:`~sparkbus.wire.records.UsedCut` ``(part, seq, index, lo, hi, checksum)`` per
    batch of which a rank used rows lo..hi-1.

    Raises:
        ProtocolError: not whole sextuples of integers, more than :data:`MAX_CUTS`, or an empty or negative range.
    """
    if len(flat) % 6 or len(flat) // 6 > MAX_CUTS or not all(type(i) is int for i in flat):
        raise ProtocolError(f"RECLAIM cuts must be at most {MAX_CUTS} (part, seq, index, lo, hi, checksum) "
                            f"sextuples of integers, got {len(flat)} values")
    values = iter(flat)
    cuts = list(map(UsedCut._make, zip(values, values, values, values, values, values)))
    if any(p < 0 or s < 0 or i < 0 or not 0 <= lo < hi for p, s, i, lo, hi, _ in cuts):
        raise ProtocolError("a RECLAIM cut has a negative number or an empty range of rows")
    return cuts


def column_frame_sizes(spec: Any, rows: int) -> list[int]:
    """The byte size of each frame of one column, from its spec ``[name, dtype, shape(, levels, nulls)]``.

    ``levels`` lists the column's variable-length levels, outermost first, each ``[count, width, nulls]``: its
    entries, its offsets' width (4 or 8) and whether a validity bitmap precedes its offsets. The leaf is
    ``prod(shape)`` values of ``dtype``, after its own bitmap when ``nulls`` is true. A bitmap holds one bit per
    entry, least significant bit first (Arrow's), ``ceil(count / 8)`` bytes.

    Raises:
        ProtocolError: a malformed spec, a dtype not allowed, or counts that do not start with ``rows``.
    """
    if not isinstance(spec, list) or len(spec) not in (3, 5) or not isinstance(spec[0], str) \
            or not isinstance(spec[1], str) or not _counts(spec[2]):
        raise ProtocolError(f"malformed column spec {spec!r:.80}")
    name, dtype, shape = spec[:3]
    levels, leaf_nulls = (spec[3], spec[4]) if len(spec) == 5 else ([], False)
    if not isinstance(levels, list) or type(leaf_nulls) is not bool or not all(
            isinstance(lv, list) and len(lv) == 3 and _counts(lv[:1]) and lv[1] in OFFSET_WIDTHS
            and type(lv[2]) is bool for lv in levels):
        raise ProtocolError(f"malformed column spec {spec!r:.80}")
    itemsize = ITEMSIZE.get(dtype)
    if itemsize is None:
        raise ProtocolError(f"column {name!r}: dtype {dtype!r} is not allowed on the wire")
    if dtype in BYTE_STRINGS and (not levels or len(shape) != 1):
        raise ProtocolError(f"column {name!r}: a {dtype} column needs a level of offsets and a 1-D shape")
    top = levels[0][0] if levels else (shape[0] if shape else -1)
    if top != rows:
        raise ProtocolError(f"column {name!r}: {top} entries, the batch has {rows} rows")
    sizes = []
    for count, width, nulls in levels:
        if nulls:
            sizes.append((count + 7) // 8)
        sizes.append((count + 1) * width)
    values = math.prod(shape)
    if values > MAX_FRAME_ITEMS or any(count > MAX_FRAME_ITEMS for count, _, _ in levels):
        # compared before any arithmetic or message: a product of thousands of digits cannot even be printed
        raise ProtocolError(f"column {name!r}: a frame of more than {MAX_FRAME_ITEMS} items")
    if leaf_nulls:
        sizes.append((values + 7) // 8)
    sizes.append(values * itemsize)
    return sizes


def _counts(values: Any) -> bool:
    return isinstance(values, list) and len(values) > 0 and all(type(d) is int and d >= 0 for d in values)


_new_tuple = tuple.__new__


def batch_id(header: Mapping[str, Any]) -> BatchId:
    """The batch's :class:`~sparkbus.wire.records.BatchId` ``(epoch, part, seq)``: unique within a stream, and what
    ranks acknowledge."""
    # tuple.__new__, not BatchId(...): half the cost, on a rank's path of every batch (timeit, Python 3.11: 150 ns
    # against 310 ns; 65 ns for a plain tuple). The broker keeps its per-message id a plain tuple (broker.state).
    return _new_tuple(BatchId, (header["epoch"], header["part"], header["seq"]))


# ---- batch ids in a frame (a rank's HELLO when it rejoins) ----------------------------------------------------

_ID = struct.Struct("<qqq")
MAX_IDS = 1 << 22


def pack_ids(ids: Iterable[BatchId]) -> bytes:
    """Batch ids as one frame: little-endian int64 triples ``(epoch, part, seq)``, back to back."""
    return b"".join(_ID.pack(*i) for i in ids)


def unpack_ids(buf: bytes | memoryview) -> list[BatchId]:
    """The inverse of :func:`pack_ids`. Raises :class:`ProtocolError` on a length that is not whole ids."""
    if len(buf) % _ID.size or len(buf) // _ID.size > MAX_IDS:
        raise ProtocolError(f"an id frame of {len(buf)} bytes is not a list of at most {MAX_IDS} batch ids")
    return list(map(BatchId._make, _ID.iter_unpack(buf)))


# ---- used batches in a frame (RECLAIM), and sets of partitions as ranges --------------------------------------

_USED = struct.Struct("<qqqqQ")
MAX_USED = 1 << 22


def pack_used(entries: Iterable[UsedEntry]) -> bytes:
    """RECLAIM's frame: per message a rank used, a :class:`~sparkbus.wire.records.UsedEntry`
    ``(part, seq, first, stop, checksum)`` as little-endian int64 (the checksum uint64), back to back.
    ``first..stop-1`` are the batches of the message it used (``0, 1`` for a batch that is not a pack); ``checksum``
    is the message's ``checksum`` as it arrived."""
    return b"".join(_USED.pack(*e) for e in entries)


def unpack_used(buf: bytes | memoryview, count: int) -> list[UsedEntry]:
    """The inverse of :func:`pack_used`, checked against the header's ``entries``.

    Raises:
        ProtocolError: a frame that is not ``count`` entries, or an entry whose range is empty or negative.
    """
    if len(buf) != count * _USED.size or not 0 <= count <= MAX_USED:
        raise ProtocolError(f"a RECLAIM frame of {len(buf)} bytes is not {count} used-batch entries")
    entries = list(map(UsedEntry._make, _USED.iter_unpack(buf)))
    if any(p < 0 or s < 0 or not 0 <= f < t for p, s, f, t, _ in entries):
        raise ProtocolError("a RECLAIM entry has a negative number or an empty range of batches")
    return entries


def pack_ranges(numbers: Iterable[int]) -> list[int]:
    """A set of partition numbers as flat ranges ``[start, stop, start, stop, ...]``, sorted: what EPOCH_RECOVER
    and EPOCH_QUERY's answer carry, so that a header stays small however many partitions there are."""
    flat: list[int] = []
    for n in sorted(set(numbers)):
        if flat and flat[-1] == n:
            flat[-1] = n + 1
        else:
            flat.extend((n, n + 1))
    return flat


def range_pairs(flat: Sequence[Any], limit: int | None = None) -> list[tuple[int, int]]:
    """Flat ranges ``[start, stop, ...]`` (:func:`pack_ranges`) checked, as ``(start, stop)`` pairs: a receiver keeps
    them as they are (:class:`PartitionRanges`), since one pair may name millions of partitions.

    Raises:
        ProtocolError: not whole pairs of integers, a range that is empty or not ascending, or past ``limit``.
    """
    if len(flat) % 2 or not all(type(n) is int for n in flat):
        raise ProtocolError("partition ranges must be pairs of integers [start, stop, ...]")
    pairs = list(zip(flat[::2], flat[1::2]))
    last = 0
    for start, stop in pairs:
        if not last <= start < stop or (limit is not None and stop > limit):
            raise ProtocolError(f"partition range [{start}, {stop}) is empty, out of order or out of range")
        last = stop
    return pairs


def unpack_ranges(flat: Sequence[Any], limit: int | None = None) -> set[int]:
    """The inverse of :func:`pack_ranges`, as a set (for the few partitions of an answer: a driver's use).

    Raises:
        ProtocolError: as :func:`range_pairs`.
    """
    return {n for start, stop in range_pairs(flat, limit) for n in range(start, stop)}


class PartitionRanges:
    """A set of integers held as sorted, disjoint, half-open ranges, as ``EPOCH_RECOVER`` names partitions: the upper
    bound of a Spark Connect feed (10,000,000 partitions) is one pair, not ten million numbers. (The journal's
    ``EpochRanges`` is the same set, spelled with inclusive ranges.)"""

    __slots__ = ("_starts", "_stops")

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()):
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in pairs:
            self._add(start, stop)

    def _add(self, start: int, stop: int) -> None:
        # the ranges that touch or overlap [start, stop) merge into one
        lo = bisect.bisect_left(self._stops, start)
        hi = bisect.bisect_right(self._starts, stop)
        if lo < hi:
            start, stop = min(start, self._starts[lo]), max(stop, self._stops[hi - 1])
        self._starts[lo:hi], self._stops[lo:hi] = [start], [stop]

    @classmethod
    def of(cls, numbers: Iterable[int]) -> PartitionRanges:
        flat = pack_ranges(numbers)
        return cls(zip(flat[::2], flat[1::2]))

    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._stops))

    def __contains__(self, number: object) -> bool:
        if type(number) is not int:
            return False
        i = bisect.bisect_right(self._starts, number) - 1
        return i >= 0 and number < self._stops[i]

    def __or__(self, other: PartitionRanges) -> PartitionRanges:
        return PartitionRanges([*self.pairs(), *other.pairs()])

    def issubset(self, other: PartitionRanges) -> bool:
        """Whether every number of this set is in ``other``."""
        for start, stop in self.pairs():
            i = bisect.bisect_right(other._starts, start) - 1
            if i < 0 or stop > other._stops[i]:
                return False
        return True

    def __le__(self, other: PartitionRanges) -> bool:
        return self.issubset(other)

    def count_in(self, numbers: Iterable[int]) -> int:
        """How many of ``numbers`` (distinct) are in this set."""
        return sum(1 for n in numbers if n in self)

    def __len__(self) -> int:
        """How many numbers (not ranges)."""
        return sum(stop - start for start, stop in self.pairs())

    def __iter__(self) -> Iterator[int]:
        for start, stop in self.pairs():
            yield from range(start, stop)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PartitionRanges):
            return type(self) is type(other) and self.pairs() == other.pairs()
        if isinstance(other, (set, frozenset)):
            return len(self) == len(other) and all(n in self for n in other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PartitionRanges({self.pairs()})"
