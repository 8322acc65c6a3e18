"""What a rank used of an epoch, message by message: :class:`UsedBatches`.

A broker that lost its state (docs/design/RECOVERY.md) learns from the ranks which of its batches they already
trained (``RECLAIM``), and a checkpoint saves the same record (``BatchStream.state_dict``). Both name a message by
its ``(part, seq)``, the batches of it used (``first..stop-1``: a pack's, or ``0, 1`` for a single batch) and its
checksum as it arrived, so that a recomputation that came out differently is told apart.
"""

from __future__ import annotations

from collections.abc import Iterable

from sparkbus.wire.protocol import UsedEntry


class UsedBatches:
    """Per message ``(part, seq)``: its checksum and the indices of its batches used (a set: a pack's batches may be
    used out of order, e.g. pooled at an epoch's end). :meth:`entries` gives them as contiguous ranges."""

    __slots__ = ("_messages",)

    def __init__(self, entries: Iterable[UsedEntry] = ()):
        self._messages: dict[tuple[int, int], tuple[int, set[int]]] = {}
        self.update(entries)

    def add(self, part: int, seq: int, index: int, checksum: int) -> None:
        """Batch ``index`` of message ``(part, seq)`` (0 for a single batch) was used."""
        known = self._messages.get((part, seq))
        if known is None:
            self._messages[(part, seq)] = (checksum, {index})
        else:
            known[1].add(index)      # the first checksum stands: the copy this rank used first

    def update(self, entries: Iterable[UsedEntry]) -> None:
        """Add ``(part, seq, first, stop, checksum)`` entries (another record's, or a checkpoint's)."""
        for part, seq, first, stop, checksum in entries:
            for index in range(first, stop):
                self.add(part, seq, index, checksum)

    def entries(self) -> list[UsedEntry]:
        """``(part, seq, first, stop, checksum)`` per contiguous run of used batches, sorted: what
        ``protocol.pack_used`` takes."""
        out: list[UsedEntry] = []
        for (part, seq), (checksum, indices) in sorted(self._messages.items()):
            run: list[int] = []
            for index in sorted(indices):
                if run and index != run[-1] + 1:
                    out.append((part, seq, run[0], run[-1] + 1, checksum))
                    run = []
                run.append(index)
            out.append((part, seq, run[0], run[-1] + 1, checksum))
        return out

    def clear(self) -> None:
        self._messages.clear()

    def __len__(self) -> int:
        """Batches used (a pack's each)."""
        return sum(len(indices) for _, indices in self._messages.values())

    def __bool__(self) -> bool:
        return bool(self._messages)
