"""A training loop's side of a :class:`~worker.BatchStream` in PyTorch: tensors made without a copy.

- :class:`StreamDataset` (needs PyTorch): a ``torch.utils.data.IterableDataset`` that runs one epoch of the
  stream per iteration and yields dicts of tensors made without a copy.
- :func:`to_tensors`: one batch as tensors. To mix rows across batches first, see :mod:`worker.shuffle`.
- :func:`pad_collate`: a ``transform`` for dynamic padding: variable-length columns as padded tensors, with
  each row's length and an attention mask.

For the gradient allreduce of the training loop use :mod:`worker.collectives` (it does not spin a core).

Importing this module imports neither torch nor mpi4py; torch is imported the first time ``StreamDataset`` is
looked up (``from worker.torch_data import StreamDataset``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from sparkbus.wire.ragged import RaggedColumn, pad
from sparkbus.worker.shuffle import shuffled

if TYPE_CHECKING:                     # pragma: no cover
    from sparkbus.worker.stream import BatchStream

Batch = dict[str, Any]

# torch.from_numpy warns (once per process) that a read-only array gives a tensor it cannot protect.
_READ_ONLY_WARNING = "The given NumPy array is not writable"


def to_tensors(batch: Batch, writable: bool = False) -> dict[str, Any]:
    """The batch's numpy columns as torch tensors sharing memory with the arrays (``torch.from_numpy``).

    Columns that are no plain numpy array pass through unchanged: a :class:`~worker.RaggedColumn` (binary,
    strings, arrays of varying length: pad them with :func:`pad_collate`, decode bytes yourself), and a numpy
    masked array (a column with nulls in this batch: fill it, e.g. ``col.filled(0)``, or keep its mask).

    The arrays of a received batch are read-only views of ZeroMQ frames. With ``writable=False`` the tensors
    share that memory, no copy is made, and torch's warning about read-only arrays is suppressed here on
    purpose: **treat these tensors as read-only** (no in-place ops such as ``x.sub_(mean)`` or ``x -= mean``;
    write ``x = x - mean``). ``writable=True`` copies each read-only array first (writable arrays, e.g. from a
    shuffle buffer, are never copied).

    Raises:
        ImportError: PyTorch is not installed.
    """
    torch = _torch()

    tensors: dict[str, Any] = {}
    for name, array in batch.items():
        if not isinstance(array, np.ndarray) or isinstance(array, np.ma.MaskedArray) or array.dtype.kind in "Mm":
            tensors[name] = array        # torch has no ragged, masked or datetime tensors
        elif array.flags.writeable:
            tensors[name] = torch.from_numpy(array)
        elif writable:
            tensors[name] = torch.from_numpy(array.copy())
        else:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
                tensors[name] = torch.from_numpy(array)
    return tensors


def pad_collate(pad_values: dict[str, Any], max_length: int | dict[str, int] | None = None,
                lengths: bool = True, mask: bool = True) -> Callable[[dict], dict]:
    """A ``transform`` for :class:`StreamDataset` that pads variable-length columns per batch (dynamic padding).

    Each column named in ``pad_values`` (a :class:`~worker.RaggedColumn`, or a numpy ``[n, k]`` array when the
    batch's rows happened to share one length) becomes a ``[n, L]`` tensor, ``L`` its longest row (at most
    ``max_length``), filled with its pad value; ``<name>_lengths`` (int64 ``[n]``) and ``<name>_mask`` (bool
    ``[n, L]``, True at real values: an attention mask) are added. Other columns pass through.

    Example: ``StreamDataset(stream, transform=pad_collate({"tokens": 0}, max_length=512))``.
    """
    torch = _torch()

    def collate(batch: dict) -> dict:
        out = dict(batch)
        for name, value in pad_values.items():
            column = batch[name]
            if isinstance(column, torch.Tensor):
                column = column.numpy()
            limit = max_length.get(name) if isinstance(max_length, dict) else max_length
            padded, sizes = pad(column, value, limit)
            out[name] = torch.from_numpy(padded)
            if lengths:
                out[f"{name}_lengths"] = torch.from_numpy(sizes)
            if mask:
                out[f"{name}_mask"] = torch.arange(padded.shape[1])[None, :] < out.get(
                    f"{name}_lengths", torch.from_numpy(sizes))[:, None]
        return out

    return collate


def _torch() -> Any:
    """torch, or an ImportError that says how to get it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError("worker.torch_data needs PyTorch: pip install 'sparkbus[torch]' (or any torch build)") \
            from exc
    return torch


def _define_stream_dataset() -> type:
    _torch()
    import torch.utils.data
    from torch.utils.data import IterableDataset

    class StreamDataset(IterableDataset):
        """The epochs of a :class:`~worker.BatchStream` as a PyTorch ``IterableDataset``; one iteration = one epoch.

        Each iteration runs ``stream.epoch()`` to its end and yields every batch as a ``dict[str, Tensor]``
        (or what ``transform`` makes of it). Use it with ``DataLoader(ds, batch_size=None, num_workers=0)``:
        the batches are already batched (``batch_size=None`` turns off the loader's own batching), and
        ``num_workers`` must be 0 because the stream's socket and its step plan (the broker's grants, or the MPI
        agreement) live in this process; a loader worker is another process, which could use neither.
        Prefetching already happens in the stream (its ``prefetch`` credits).

        With an even stream (the default for a group of more than one rank: ``comm=``, ``rank=``/``size=`` or
        ``rank="auto"``) every rank yields the same number of batches per epoch,
        also through the shuffle buffer, so a synchronous allreduce per step never hangs. Every rank must
        iterate every epoch to its end.

        Args:
            stream: the :class:`~worker.BatchStream` to read.
            writable: copy the read-only arrays of received batches so the tensors may be modified in place
                (default False: no copy, treat the tensors as read-only; see :func:`to_tensors`).
            transform: applied to each dict of tensors, e.g.
                ``lambda b: (b["features"], b["label"].long())``.
            shuffle_buffer: mix rows across this many consecutive batches (:func:`worker.shuffle.shuffled`); 0
                (default) off. Mixed batches are new arrays, so no copy is added by ``writable``.
            shuffle_seed: seed of the mixing; iteration ``i`` uses ``(shuffle_seed, epoch + i, rank)``.
            epoch: the number of the first epoch this dataset yields, for the mixing seed (e.g. when
                resuming); see :meth:`set_epoch`.
        Raises:
            ValueError: ``shuffle_buffer`` is negative.
        """

        def __init__(self, stream: BatchStream, *, writable: bool = False,
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
                                   "and step plan live in the process that created it")
            epoch, self.epoch = self.epoch, self.epoch + 1
            batches: Iterable[Batch] = self.stream.epoch()
            if self.shuffle_buffer:
                seed = None if self.shuffle_seed is None else (self.shuffle_seed, epoch, self.stream.rank)
                batches = shuffled(batches, self.shuffle_buffer, seed, stream=self.stream)
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


__all__ = ["RaggedColumn", "StreamDataset", "pad_collate", "to_tensors"]  # noqa: F822 (StreamDataset: PEP 562)
