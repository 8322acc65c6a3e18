"""A training loop's side of a :class:`~worker.BatchStream`: PyTorch tensors and a row-mixing shuffle buffer.

- :class:`StreamDataset` (needs PyTorch): a ``torch.utils.data.IterableDataset`` that runs one epoch of the
  stream per iteration and yields dicts of tensors made without a copy.
- :class:`ShuffleBuffer` / :func:`shuffled` (numpy only): mix rows across ``k`` consecutive batches of a rank,
  emitting exactly as many batches as came in, with the same sizes, so equal step counts across ranks survive.

For the gradient allreduce of the training loop use :mod:`worker.collectives` (it does not spin a core).

Importing this module imports neither torch nor mpi4py; torch is imported the first time ``StreamDataset`` is
looked up (``from worker.torch_data import StreamDataset``).

Order guarantees of the shuffle buffer: for the same sequence of input batches and the same ``seed`` the output
is the same, row for row. The input sequence of a rank, however, depends on timing (which rank the broker gave
which batch, see docs/TRAINING.md), so a rank's mixed batches are reproducible only if its input is.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

if TYPE_CHECKING:                     # pragma: no cover
    import torch

    from .stream import BatchStream

Batch = dict[str, np.ndarray]

# torch.from_numpy warns (once per process) that a read-only array gives a tensor it cannot protect.
_READ_ONLY_WARNING = "The given NumPy array is not writable"


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


def to_tensors(batch: Batch, writable: bool = False) -> dict[str, "torch.Tensor"]:
    """The batch's columns as torch tensors sharing memory with the arrays (``torch.from_numpy``).

    The arrays of a received batch are read-only views of ZeroMQ frames. With ``writable=False`` the tensors
    share that memory, no copy is made, and torch's warning about read-only arrays is suppressed here on
    purpose: **treat these tensors as read-only** (no in-place ops such as ``x.sub_(mean)`` or ``x -= mean``;
    write ``x = x - mean``). ``writable=True`` copies each read-only array first (writable arrays, e.g. from a
    shuffle buffer, are never copied).

    Raises:
        ImportError: PyTorch is not installed.
    """
    import torch

    tensors = {}
    for name, array in batch.items():
        if array.flags.writeable:
            tensors[name] = torch.from_numpy(array)
        elif writable:
            tensors[name] = torch.from_numpy(array.copy())
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
                tensors[name] = torch.from_numpy(array)
    return tensors


def _define_stream_dataset() -> type:
    import torch.utils.data
    from torch.utils.data import IterableDataset

    class StreamDataset(IterableDataset):
        """The epochs of a :class:`~worker.BatchStream` as a PyTorch ``IterableDataset``; one iteration = one epoch.

        Each iteration runs ``stream.epoch()`` to its end and yields every batch as a ``dict[str, Tensor]``
        (or what ``transform`` makes of it). Use it with ``DataLoader(ds, batch_size=None, num_workers=0)``:
        the batches are already batched (``batch_size=None`` turns off the loader's own batching), and
        ``num_workers`` must be 0 because the stream's socket and its MPI agreement live in this process; a
        loader worker is another process, which could neither use the socket nor take part in the ranks'
        step agreement. Prefetching already happens in the stream (its ``prefetch`` credits).

        With an even stream (the default under MPI) every rank yields the same number of batches per epoch,
        also through the shuffle buffer, so a synchronous allreduce per step never hangs. Every rank must
        iterate every epoch to its end.

        Args:
            stream: the :class:`~worker.BatchStream` to read.
            writable: copy the read-only arrays of received batches so the tensors may be modified in place
                (default False: no copy, treat the tensors as read-only; see :func:`to_tensors`).
            transform: applied to each dict of tensors, e.g.
                ``lambda b: (b["features"], b["label"].long())``.
            shuffle_buffer: mix rows across this many consecutive batches (:func:`shuffled`); 0 (default) off.
                Mixed batches are new arrays, so no copy is added by ``writable``.
            shuffle_seed: seed of the mixing; iteration ``i`` uses ``(shuffle_seed, epoch + i, rank)``.
            epoch: the number of the first epoch this dataset yields, for the mixing seed (e.g. when
                resuming); see :meth:`set_epoch`.
        Raises:
            ValueError: ``shuffle_buffer`` is negative.
        """

        def __init__(self, stream: "BatchStream", *, writable: bool = False,
                     transform: Callable[[dict], Any] | None = None, shuffle_buffer: int = 0,
                     shuffle_seed: int | None = None, epoch: int = 0):
            super().__init__()
            if shuffle_buffer < 0:
                raise ValueError(f"shuffle_buffer must not be negative, not {shuffle_buffer}")
            self.stream, self.writable, self.transform = stream, writable, transform
            self.shuffle_buffer, self.shuffle_seed, self.epoch = shuffle_buffer, shuffle_seed, epoch

        def set_epoch(self, epoch: int) -> None:
            """Number the next iteration ``epoch`` (it then counts up by one per iteration)."""
            self.epoch = epoch

        def __iter__(self) -> Iterator[Any]:
            """Run the stream's next epoch. Raises RuntimeError inside a DataLoader worker process."""
            if torch.utils.data.get_worker_info() is not None:
                raise RuntimeError("StreamDataset must be read with num_workers=0: the BatchStream's socket "
                                   "and MPI agreement live in the process that created it")
            epoch, self.epoch = self.epoch, self.epoch + 1
            batches: Iterable[Batch] = self.stream.epoch()
            if self.shuffle_buffer:
                seed = None if self.shuffle_seed is None else (self.shuffle_seed, epoch, self.stream.rank)
                batches = shuffled(batches, self.shuffle_buffer, seed)
            for batch in batches:
                tensors = to_tensors(batch, self.writable)
                yield tensors if self.transform is None else self.transform(tensors)

    StreamDataset.__module__, StreamDataset.__qualname__ = __name__, "StreamDataset"
    return StreamDataset


def __getattr__(name: str) -> Any:
    # PEP 562: StreamDataset subclasses a torch class, so it is defined (and torch imported) on first use.
    if name == "StreamDataset":
        cls = globals()["StreamDataset"] = _define_stream_dataset()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ShuffleBuffer", "StreamDataset", "shuffled", "to_tensors"]
