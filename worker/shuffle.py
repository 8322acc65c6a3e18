"""Mix rows across ``k`` consecutive batches of a rank without changing the step count (numpy, no torch).

:class:`ShuffleBuffer` / :func:`shuffled` emit exactly as many batches as came in, with the same sizes, so equal
step counts across ranks survive. For the same sequence of input batches and the same ``seed`` the output is the
same, row for row. The input sequence of a rank, however, depends on timing (which rank the broker gave which
batch, see docs/TRAINING.md), so a rank's mixed batches are reproducible only if its input is.

Give the buffer the stream it reads (``stream=``): ``BatchStream.state_dict`` then refuses while the buffer holds
rows, which the model has not trained although the stream yielded them (an exact resume would need them too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from sparkbus.wire.ragged import RaggedColumn, concat_ragged

Batch = dict[str, Any]


class ShuffleBuffer:
    """Mixes rows across the last ``batches`` batches it was given; returns as many batches as it receives.

    Once the buffer holds ``batches`` batches, each push returns one batch of rows drawn uniformly at random,
    without replacement, from every row it holds; its size is that of the oldest batch not yet answered, so the
    output sizes are the input sizes in the same order. :meth:`flush` returns the rest at the end of an epoch.
    With ``batches=1`` each batch is only permuted. Columns may take every form a rank receives: numpy arrays,
    masked arrays (a mixed column is masked where any of its rows came from a masked one) and
    :class:`~broker.ragged.RaggedColumn`.

    Args:
        batches: ``k``, how many batches' rows are mixed together (at least 1). The buffer holds about ``k``
            batches of rows; the first mixed batch comes out after ``k`` went in.
        seed: a seed for ``numpy.random.default_rng`` (an int, a sequence of ints, or None for fresh entropy).
        stream: the :class:`~worker.BatchStream` whose batches are pushed, if any: its ``state_dict`` refuses while
            this buffer holds rows (see the module).
    Raises:
        ValueError: ``batches`` below 1.

    The returned columns are new (numpy arrays writable and C-contiguous), no longer views of received frames.
    """

    def __init__(self, batches: int, seed: Any = None, *, stream: Any = None):
        if batches < 1:
            raise ValueError(f"a shuffle buffer mixes at least 1 batch, not {batches}")
        if stream is not None:
            stream.track_buffer(self)
        self.batches = batches
        self._rng = np.random.default_rng(seed)
        self._held: list[Batch] = []          # the batches whose rows are not all given out yet
        self._left: list[np.ndarray] = []     # per held batch, the rows not given out yet
        self._layout: dict[str, Any] | None = None
        self._pending: deque[int] = deque()  # sizes of the batches pushed and not yet answered

    def __len__(self) -> int:
        """Batches pushed and not yet returned."""
        return len(self._pending)

    def push(self, batch: Batch) -> Batch | None:
        """Add a batch's rows; return a mixed batch once the pool holds ``batches`` batches, else None.

        Raises:
            ValueError: the batch's columns, dtypes or row shapes (or forms) differ from the first batch's, or
                its columns have different lengths.
        """
        rows = self._check(batch)
        self._held.append(batch)
        self._left.append(np.arange(rows))
        self._pending.append(rows)
        return self._emit(self._pending.popleft()) if len(self._pending) >= self.batches else None

    def flush(self) -> Iterator[Batch]:
        """Yield the batches still owed, one per batch pushed and not yet returned, emptying the pool."""
        while self._pending:
            yield self._emit(self._pending.popleft())

    def _check(self, batch: Batch) -> int:
        if not batch:
            raise ValueError("a batch needs at least one column")
        lengths = {len(column) for column in batch.values()}
        if len(lengths) != 1:
            raise ValueError(f"the columns of a batch have different lengths: {sorted(lengths)}")
        layout = {name: _layout(c) for name, c in batch.items()}
        if self._layout is None:
            self._layout = layout
        elif layout != self._layout:
            raise ValueError(f"a batch with columns {layout} does not match the first batch's {self._layout} "
                             f"(a column of arrays of varying length: declare it feed(..., ragged=[...]))")
        return lengths.pop()

    def _emit(self, size: int) -> Batch:
        counts = np.array([len(left) for left in self._left])
        ends = np.cumsum(counts)
        chosen = self._rng.choice(int(ends[-1]), size, replace=False)      # in random order
        source = np.searchsorted(ends, chosen, side="right")
        order = np.argsort(source, kind="stable")
        parts: list[tuple[Batch, np.ndarray]] = []
        for i in np.unique(source):
            picked = chosen[source == i] - (ends[i - 1] if i else 0)
            parts.append((self._held[i], self._left[i][picked]))
            self._left[i] = np.delete(self._left[i], picked)
        back = np.argsort(order)            # from the parts' order back to the drawn order
        out = {name: _gather([batch[name] for batch, _ in parts], [rows for _, rows in parts], back)
               for name in self._layout or {}}
        keep = [i for i, left in enumerate(self._left) if len(left)]
        self._held = [self._held[i] for i in keep]
        self._left = [self._left[i] for i in keep]
        return out


def _layout(column: Any) -> Any:
    if isinstance(column, RaggedColumn):
        return ("ragged", column.kind, column.dtype.str, column.depth)
    array = np.asarray(column)
    return (array.dtype.str, array.shape[1:])


def _gather(columns: list[Any], rows: list[np.ndarray], order: np.ndarray) -> Any:
    """Rows ``rows[i]`` of ``columns[i]``, joined, then put in ``order``."""
    if isinstance(columns[0], RaggedColumn):
        return concat_ragged([c.take(r) for c, r in zip(columns, rows)]).take(order)
    if any(isinstance(c, np.ma.MaskedArray) for c in columns):
        return np.ma.concatenate([c[r] for c, r in zip(columns, rows)])[order]
    return np.ascontiguousarray(np.concatenate([c[r] for c, r in zip(columns, rows)])[order])


def shuffled(batches: Iterable[Batch], buffer_batches: int, seed: Any = None, *, stream: Any = None
             ) -> Iterator[Batch]:
    """Yield ``batches`` with rows mixed across ``buffer_batches`` consecutive batches (see :class:`ShuffleBuffer`).

    Yields exactly as many batches as ``batches`` does, with the same sizes in the same order: wrapped around
    ``stream.epoch()`` of an even :class:`~worker.BatchStream`, every rank still takes the same number of steps.
    The buffer reads ``buffer_batches - 1`` batches ahead, so those are acknowledged to the broker before they
    are trained on: a rank that dies loses up to that many batches of the epoch instead of having them
    redelivered.

    Args:
        batches: dicts of columns (numpy, masked, RaggedColumn) with the same columns, dtypes and row shapes.
        buffer_batches: how many batches' rows are mixed together (1: permute within each batch).
        seed: seed of the mixing (use e.g. ``(seed, epoch, rank)`` for a different mix per epoch and rank).
        stream: the :class:`~worker.BatchStream` that ``batches`` come from (``shuffled(stream.epoch(), k,
            stream=stream)``): its ``state_dict`` then refuses while the buffer holds rows. Pass it whenever the
            job checkpoints with ``state_dict``.
    Raises:
        ValueError: ``buffer_batches`` below 1, or batches whose layouts differ.
    """
    buffer = ShuffleBuffer(buffer_batches, seed, stream=stream)
    for batch in batches:
        mixed = buffer.push(batch)
        if mixed is not None:
            yield mixed
    yield from buffer.flush()


__all__ = ["ShuffleBuffer", "shuffled"]
