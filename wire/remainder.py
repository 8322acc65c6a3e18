"""The epoch's remainder: how the batches left over at an epoch's end (fewer than the ranks) are shared out so
that every rank takes the same number of steps. One rule, used by the broker (granted steps) and by the ranks
(steps agreed over MPI): docs/GUARANTEES.md, "Equal steps and every row".

- ``"split"`` (the default): the left-over batches are cut by rows into one piece per rank, each rank's last step
  one piece: every row once, the last step smaller. A batch gets pieces in proportion to its rows (the largest
  pieces are cut again first), so pieces differ by at most about one batch's rows over the ranks. With fewer rows
  left than ranks, some pieces hold no row: those ranks' last step is a batch of 0 rows (same columns).
- ``"pad"``: each left-over batch whole to one rank, and the ranks short of one a repeat of one of them, in turn:
  fixed batch shapes where the feed's are, rows repeated (counted).
- ``"drop"``: the left-over batches are dropped (counted, and handed to ``on_drop``).
"""

from __future__ import annotations

from typing import NamedTuple

from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import REMAINDERS


class Piece(NamedTuple):
    """One rank's last step: rows ``lo..hi-1`` of left-over batch ``batch``; ``repeat``: rows another rank has."""

    batch: int
    lo: int
    hi: int
    repeat: bool = False


def check_remainder(remainder: object) -> str:
    """``remainder`` if it is one of :data:`~wire.protocol.REMAINDERS`.

    Raises:
        ValueError: any other value.
    """
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {', '.join(map(repr, REMAINDERS))}, got {remainder!r}")
    return str(remainder)


def plan(rows: list[int], ranks: int, remainder: str) -> list[Piece]:
    """The pieces ``ranks`` ranks take of left-over batches of ``rows`` rows each: one per rank, in order (the
    same on every caller), or none with ``"drop"`` or nothing left over.

    Raises:
        ProtocolError: as many left-over batches as ranks or more (those are whole steps, not a remainder).
    """
    if remainder == "drop" or not rows:
        return []
    if len(rows) >= ranks:
        raise ProtocolError(f"{len(rows)} batches left over for {ranks} ranks: a remainder is fewer than the ranks")
    if remainder == "pad":
        whole = [Piece(i, 0, n) for i, n in enumerate(rows)]
        return whole + [Piece(j % len(rows), 0, rows[j % len(rows)], True) for j in range(ranks - len(rows))]
    counts = [1] * len(rows)
    for _ in range(ranks - len(rows)):
        # the batch whose pieces are the largest is cut once more (ties: the first)
        widest = max(range(len(rows)), key=lambda i: (rows[i] / counts[i], -i))
        counts[widest] += 1
    pieces = []
    for i, (n, k) in enumerate(zip(rows, counts)):
        lo = 0
        for j in range(k):
            hi = lo + n // k + (1 if j < n % k else 0)
            pieces.append(Piece(i, lo, hi))
            lo = hi
    return pieces
