"""What a rank used of an epoch, message by message: :class:`UsedBatches`.

A broker that lost its state (docs/design/RECOVERY.md) learns from the ranks which of its batches they already
trained (``RECLAIM``), and a checkpoint saves the same record (``BatchStream.state_dict``). Both name a message by
its ``(part, seq)``, the batches of it used (``first..stop-1``: a pack's, or ``0, 1`` for a single batch) and its
checksum as it arrived, so that a recomputation that came out differently is told apart. Of a batch a rank used
some rows only (its piece of an epoch's remainder, ``wire.remainder``), a *cut* names them:
``(part, seq, index, lo, hi, checksum)``. Both records are the wire's: :class:`~sparkbus.wire.records.UsedEntry` and
:class:`~sparkbus.wire.records.UsedCut`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from sparkbus.wire.records import UsedCut, UsedEntry

# The records of what was used are the wire's (RECLAIM carries them): one definition for the broker and the ranks.
# ``Entry`` and ``Cut`` are the names this module gave them first, kept for those who import them from here.
Entry = UsedEntry
Cut = UsedCut


class Resume(NamedTuple):
    """What a checkpoint had used of ``epoch``, for a rank that resumes from it (``BatchStream(resume=)``)."""

    epoch: int
    entries: list[UsedEntry]
    cuts: list[UsedCut]


class UsedBatches:
    """Per message ``(part, seq)``: its checksum and the indices of its batches used (a set: a pack's batches may be
    used out of order, e.g. pooled at an epoch's end), and per batch used in part, its rows. :meth:`entries` gives
    the whole batches as contiguous ranges, :meth:`cuts` the rest."""

    __slots__ = ("_messages", "_cuts")

    def __init__(self, entries: Iterable[UsedEntry] = (), cuts: Iterable[UsedCut] = ()):
        self._messages: dict[tuple[int, int], tuple[int, set[int]]] = {}
        self._cuts: dict[tuple[int, int, int], tuple[int, list[tuple[int, int]]]] = {}
        self.update(entries, cuts)

    def add(self, part: int, seq: int, index: int, checksum: int, rows: tuple[int, int] | None = None) -> None:
        """Batch ``index`` of message ``(part, seq)`` (0 for a single batch) was used: whole, or its ``rows``
        (``lo, hi``)."""
        if rows is not None:
            known_cut = self._cuts.setdefault((part, seq, index), (checksum, []))
            known_cut[1].append(rows)
            return
        known = self._messages.get((part, seq))
        if known is None:
            self._messages[(part, seq)] = (checksum, {index})
        else:
            known[1].add(index)      # the first checksum stands: the copy this rank used first

    def update(self, entries: Iterable[UsedEntry], cuts: Iterable[UsedCut] = ()) -> None:
        """Add ``(part, seq, first, stop, checksum)`` entries and ``cuts`` (another record's, or a checkpoint's)."""
        for part, seq, first, stop, checksum in entries:
            for index in range(first, stop):
                self.add(part, seq, index, checksum)
        for part, seq, index, lo, hi, checksum in cuts:
            self.add(part, seq, index, checksum, (lo, hi))

    def merge(self, other: UsedBatches) -> None:
        """Add everything ``other`` holds."""
        self.update(other.entries(), other.cuts())

    def entries(self) -> list[UsedEntry]:
        """``(part, seq, first, stop, checksum)`` per contiguous run of used batches, sorted: what
        ``protocol.pack_used`` takes."""
        out: list[UsedEntry] = []
        for (part, seq), (checksum, indices) in sorted(self._messages.items()):
            run: list[int] = []
            for index in sorted(indices):
                if run and index != run[-1] + 1:
                    out.append(UsedEntry(part, seq, run[0], run[-1] + 1, checksum))
                    run = []
                run.append(index)
            out.append(UsedEntry(part, seq, run[0], run[-1] + 1, checksum))
        return out

    def cuts(self) -> list[UsedCut]:
        """``(part, seq, index, lo, hi, checksum)`` per run of used rows of a batch not used whole, sorted."""
        out: list[UsedCut] = []
        for (part, seq, index), (checksum, ranges) in sorted(self._cuts.items()):
            whole = self._messages.get((part, seq))
            if whole is not None and index in whole[1]:
                continue
            merged: list[list[int]] = []
            for lo, hi in sorted(ranges):
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                elif hi > lo:
                    merged.append([lo, hi])
            out.extend(UsedCut(part, seq, index, lo, hi, checksum) for lo, hi in merged)
        return out

    def clear(self) -> None:
        self._messages.clear()
        self._cuts.clear()

    def __len__(self) -> int:
        """Batches used (a pack's each), a batch used in part counting one."""
        return sum(len(indices) for _, indices in self._messages.values()) + len(self.cuts())

    def __bool__(self) -> bool:
        return bool(self._messages) or bool(self._cuts)
