"""Mix rows across ``k`` consecutive batches of a rank without changing the step count (numpy only).

:class:`ShuffleBuffer` / :func:`shuffled` emit exactly as many batches as came in, with the same sizes, so equal
step counts across ranks survive. For the same sequence of input batches and the same ``seed`` the output is the
same, row for row. The input sequence of a rank, however, depends on timing (which rank the broker gave which
batch, see docs/TRAINING.md), so a rank's mixed batches are reproducible only if its input is.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Iterator

import numpy as np

Batch = dict[str, np.ndarray]


class ShuffleBuffer:
    """Mixes rows across the last ``batches`` batches it was given; returns as many batches as it receives.

    Rows are copied into a pool when a batch is pushed. Once the pool holds ``batches`` batches, each push
    returns one batch of rows drawn uniformly at random, without replacement, from the whole pool; its size is
    that of the oldest batch not yet answered, so the output sizes are the input sizes in the same order.
    :meth:`flush` returns the rest at the end of an epoch. With ``batches=1`` each batch is only permuted.

    Args:
        batches: ``k``, how many batches' rows are mixed together (at least 1). The pool holds about ``k``
            batches of rows; the first mixed batch comes out after ``k`` went in.
        seed: a seed for ``numpy.random.default_rng`` (an int, a sequence of ints, or None for fresh entropy).
    Raises:
        ValueError: ``batches`` below 1.

    The returned arrays are new, writable and C-contiguous (no longer views of received frames).
    """

    def __init__(self, batches: int, seed: Any = None):
        if batches < 1:
            raise ValueError(f"a shuffle buffer mixes at least 1 batch, not {batches}")
        self.batches = batches
        self._rng = np.random.default_rng(seed)
        self._pool: dict[str, np.ndarray] = {}
        self._rows = 0                       # rows held in the pool
        self._pending: deque[int] = deque()  # sizes of the batches pushed and not yet answered

    def __len__(self) -> int:
        """Batches pushed and not yet returned."""
        return len(self._pending)

    def push(self, batch: Batch) -> Batch | None:
        """Add a batch's rows; return a mixed batch once the pool holds ``batches`` batches, else None.

        Raises:
            ValueError: the batch's columns, dtypes or row shapes differ from the first batch's, or its
                columns have different lengths.
        """
        rows = self._check(batch)
        self._reserve(self._rows + rows)
        for name, column in batch.items():
            self._pool[name][self._rows:self._rows + rows] = column
        self._rows += rows
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
        if not self._pool:
            self._pool = {name: np.empty((0, *c.shape[1:]), dtype=c.dtype) for name, c in batch.items()}
        layout = {name: (c.dtype, c.shape[1:]) for name, c in self._pool.items()}
        given = {name: (np.asarray(c).dtype, np.shape(c)[1:]) for name, c in batch.items()}
        if given != layout:
            raise ValueError(f"a batch with columns {given} does not match the first batch's {layout}")
        return lengths.pop()

    def _reserve(self, rows: int) -> None:
        capacity = len(next(iter(self._pool.values())))
        if rows <= capacity:
            return
        capacity = max(rows, 2 * capacity)
        for name, column in self._pool.items():
            grown = np.empty((capacity, *column.shape[1:]), dtype=column.dtype)
            grown[:self._rows] = column[:self._rows]
            self._pool[name] = grown

    def _emit(self, size: int) -> Batch:
        held = self._rows
        chosen = self._rng.choice(held, size, replace=False)      # in random order
        out = {name: column[chosen] for name, column in self._pool.items()}
        # Keep the pool contiguous: rows from its tail that were not chosen fill the holes left below it.
        tail = held - size
        holes = chosen[chosen < tail]
        unchosen = np.ones(size, dtype=bool)
        unchosen[chosen[chosen >= tail] - tail] = False
        movers = tail + np.flatnonzero(unchosen)
        for column in self._pool.values():
            column[holes] = column[movers]
        self._rows = tail
        return out


def shuffled(batches: Iterable[Batch], buffer_batches: int, seed: Any = None) -> Iterator[Batch]:
    """Yield ``batches`` with rows mixed across ``buffer_batches`` consecutive batches (see :class:`ShuffleBuffer`).

    Yields exactly as many batches as ``batches`` does, with the same sizes in the same order: wrapped around
    ``stream.epoch()`` of an even :class:`~worker.BatchStream`, every rank still takes the same number of steps.
    The buffer reads ``buffer_batches - 1`` batches ahead, so those are acknowledged to the broker before they
    are trained on: a rank that dies loses up to that many batches of the epoch instead of having them
    redelivered.

    Args:
        batches: dicts of numpy arrays with the same columns, dtypes and row shapes.
        buffer_batches: how many batches' rows are mixed together (1: permute within each batch).
        seed: seed of the mixing (use e.g. ``(seed, epoch, rank)`` for a different mix per epoch and rank).
    Raises:
        ValueError: ``buffer_batches`` below 1, or batches whose layouts differ.
    """
    buffer = ShuffleBuffer(buffer_batches, seed)
    for batch in batches:
        mixed = buffer.push(batch)
        if mixed is not None:
            yield mixed
    yield from buffer.flush()


__all__ = ["ShuffleBuffer", "shuffled"]
