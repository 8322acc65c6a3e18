"""Pieces of a pack: a pack of small batches cut in two at one of its batches, each piece the same frames behind a
header whose ``take`` names its batches (docs/PROTOCOL.md, "Packs" and "Granted steps"). The broker cuts a pack to
give its unused tail to another rank at an epoch's end, and to redeliver only the batches a lost rank had not used.

A single batch is also cut by rows (:func:`cut_rows`): the epoch's remainder shared out (``wire.remainder``), and the
rows a rank had not used of a batch it used part of (a recovery). A row piece is the same frames behind a header
whose ``cut`` names its rows.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from sparkbus.broker.state import HeldBatch


class RowRange(NamedTuple):
    """One row piece :func:`cut_rows` cuts: rows ``lo..hi-1`` of the batch, counted within what the piece it cuts
    carries; ``repeat``: rows another rank has too (remainder "pad")."""

    lo: int
    hi: int
    repeat: bool = False


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


def singles(piece: HeldBatch) -> list[HeldBatch]:
    """``piece`` as pieces of one batch each (itself, unless it carries several batches of a pack)."""
    out = []
    while piece.count > 1:
        head, piece = cut(piece, piece.first + 1)
        out.append(head)
    out.append(piece)
    return out


def batch_rows(piece: HeldBatch) -> tuple[int, int]:
    """The rows of its one batch that ``piece`` carries: ``(lo, hi)``."""
    return piece.cut if piece.cut is not None else (0, piece.rows)


def cut_rows(piece: HeldBatch, ranges: list[RowRange]) -> list[HeldBatch]:
    """A piece of one batch cut into row pieces, one per :class:`RowRange`, rows counted within the batch (within
    what ``piece`` carries). Bytes are shared out by rows; a repeat carries none (it frees nothing when consumed)."""
    assert piece.count == 1
    header = msgpack.unpackb(_bytes(piece.frames[0]), raw=False)
    base, top = batch_rows(piece)
    whole = piece.whole or piece
    whole.pieces += len(ranges) - 1
    counted = sum(hi - lo for lo, hi, repeat in ranges if not repeat)
    pieces, bytes_left = [], piece.nbytes
    for n, (lo, hi, repeat) in enumerate(ranges):
        if not base <= base + lo <= base + hi <= top:
            raise ValueError(f"rows {lo}..{hi} are not within the {top - base} rows of the piece")
        last = n == len(ranges) - 1 or all(r for _, _, r in ranges[n + 1:])
        nbytes = 0 if repeat else (bytes_left if last else
                                   piece.nbytes * (hi - lo) // counted if counted else 0)
        if not repeat:
            bytes_left -= nbytes
        fields = dict(header, cut=[base + lo, base + hi])
        if repeat:
            fields["repeat"] = True
        pieces.append(HeldBatch(piece.id, [msgpack.packb(fields, use_bin_type=True), *piece.frames[1:]], nbytes,
                                hi - lo, sends=0, count=1, first=piece.first, whole=whole, used=piece.used,
                                cut=(base + lo, base + hi), repeat=repeat))
    return pieces


def _taking(header: dict, first: int, stop: int, frames: list) -> list:
    return [msgpack.packb(dict(header, take=[first, stop]), use_bin_type=True), *frames[1:]]


def _bytes(frame: object) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)  # type: ignore[call-overload]
