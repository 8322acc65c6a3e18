"""Pieces of a pack: a pack of small batches cut in two at one of its batches, each piece the same frames behind a
header whose ``take`` names its batches (docs/PROTOCOL.md, "Packs" and "Granted steps"). The broker cuts a pack to
give its unused tail to another rank at an epoch's end, and to redeliver only the batches a lost rank had not used.
"""

from __future__ import annotations

import msgpack

from sparkbus.broker.state import HeldBatch


def cut(piece: HeldBatch, first: int) -> tuple[HeldBatch, HeldBatch]:
    """A pack (or a piece of one) cut before its batch ``first``: the two pieces, each the same frames behind a
    header whose ``take`` names its batches. Rows and bytes are shared out by the pack's ``splits``."""
    header = msgpack.unpackb(_bytes(piece.frames[0]), raw=False)
    splits = header["splits"]
    stop = piece.first + piece.count
    whole = piece.whole or piece
    whole.pieces += 1
    head_rows = sum(splits[piece.first:first])
    head_bytes = piece.nbytes * head_rows // piece.rows if piece.rows else 0
    head = HeldBatch(piece.id, _taking(header, piece.first, first, piece.frames), head_bytes, head_rows,
                     sends=piece.sends, count=first - piece.first, first=piece.first, whole=whole,
                     used=min(piece.used, first))
    tail = HeldBatch(piece.id, _taking(header, first, stop, piece.frames), piece.nbytes - head_bytes,
                     piece.rows - head_rows, sends=piece.sends, count=stop - first, first=first, whole=whole,
                     used=max(piece.used, first))
    return head, tail


def _taking(header: dict, first: int, stop: int, frames: list) -> list:
    return [msgpack.packb(dict(header, take=[first, stop]), use_bin_type=True), *frames[1:]]


def _bytes(frame: object) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)  # type: ignore[call-overload]
