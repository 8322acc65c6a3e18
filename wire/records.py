"""The records the wire contract names by position, as named tuples: a batch's id, and what a rank used.

Each is a :class:`~typing.NamedTuple`, so it unpacks, compares and hashes as the plain tuple it stands for: a
``BatchId`` and the ``(epoch, part, seq)`` built from an ACK's numbers are the same dict key, and msgpack writes a
record as the list it was read from. :mod:`sparkbus.wire.protocol` makes them where it reads them from the wire
(:func:`~sparkbus.wire.protocol.batch_id`, ``unpack_ids``, ``unpack_used``, ``unpack_cuts``); the broker and the
ranks both import them from here.
"""

from __future__ import annotations

from typing import NamedTuple


class BatchId(NamedTuple):
    """A batch's ``(epoch, part, seq)``, as its BATCH header names it: unique within a stream, what a rank
    acknowledges, and the key the broker and the rank hold a batch under. A pack of small batches has one id."""

    epoch: int
    part: int
    seq: int

    def __str__(self) -> str:
        return f"(epoch {self.epoch}, part {self.part}, seq {self.seq})"


class UsedEntry(NamedTuple):
    """Batches ``first..stop-1`` of message ``(part, seq)`` used whole (``0, 1``: a batch that is not a pack), and the
    message's checksum as it arrived: a RECLAIM entry (``protocol.pack_used`` writes it, ``unpack_used`` reads it),
    and a ``used`` entry of a rank's ``BatchStream.state_dict``."""

    part: int
    seq: int
    first: int
    stop: int
    checksum: int


class UsedCut(NamedTuple):
    """Rows ``lo..hi-1`` of batch ``batch`` of message ``(part, seq)`` (its ``index`` in a pack, 0 for a batch that is
    not a pack), used when the batch was not used whole (a piece of an epoch's remainder), and the message's checksum:
    a RECLAIM's ``cuts`` (``protocol.unpack_cuts``), and a ``cuts`` entry of a rank's state_dict."""

    part: int
    seq: int
    batch: int                        # ``index`` on the wire (a NamedTuple has its own tuple.index)
    lo: int
    hi: int
    checksum: int
