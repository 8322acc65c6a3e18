"""The padding share of per-batch padding, in Spark's order and with ``bucket_by``, measured through a broker.

A batch of variable-length rows padded to its longest row holds ``n * max(lengths)`` slots, of which
``sum(lengths)`` are real tokens; the **padding share** of a set of batches is ``1 - real / slots``. Section 7 of
the benchmark (``varlen``) runs :func:`measure`; a script may load this file by path and call it.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


def padding_share(lengths_per_batch: Iterable[Sequence[int] | np.ndarray]) -> float:
    """Padded slots that are padding / all padded slots, each batch (the lengths of its rows) padded to its own
    longest row; 0.0 when there are no slots at all."""
    slots = real = 0
    for lengths in lengths_per_batch:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.size:
            slots += lengths.size * int(lengths.max())
            real += int(lengths.sum())
    return 1.0 - real / slots if slots else 0.0


@dataclass(frozen=True)
class PaddingShares:
    """What :func:`measure` found: the padding share of each epoch, their ratio, and what was fed."""

    plain: float                # Spark's order
    bucketed: float             # bucket_by=column
    ratio: float                # bucketed / plain (inf if plain is 0 and bucketed is not)
    rows: int                   # rows per epoch
    batches: tuple[int, int]    # batches of the plain and the bucketed epoch
    batch_size: int
    bucket_window: int
    seconds: float              # both feeds and reads, broker start excluded


def lengths_of(column: Any) -> np.ndarray:
    """Row lengths of a received variable-length column: a ragged column's ``lengths()``, or ``k`` for every row
    of a ``[n, k]`` array (a batch whose rows happened to share one length)."""
    if hasattr(column, "lengths"):
        return np.asarray(column.lengths())
    return np.full(len(column), column.shape[1] if column.ndim > 1 else 1, dtype=np.int64)


def measure(df: Any, column: str = "tokens", *, batch_size: int = 64, bucket_window: int = 64,
            feed_address: str | None = None, ranks_address: str | None = None, stream: str = "padding",
            first_epoch: int = 0, timeout: float = 60.0, **feed_kwargs: Any) -> PaddingShares:
    """Feed ``df[column]`` (a variable-length array column) as epoch ``first_epoch`` of ``stream`` as is and as the
    next with ``bucket_by=column``, read both back with one :class:`worker.BatchStream` without MPI in a thread
    while the feed runs (every batch as Spark made it), and measure both padding shares.

    ``feed_address``, ``ranks_address``: a running broker's (both or neither: a broker is then started for the
    measurement); ``timeout`` bounds every wait; ``feed_kwargs``: more :func:`feeder.feed` arguments. Raises
    ValueError if only one address was given, as ``feed`` does, and RuntimeError if the reader failed or did not
    finish within ``timeout`` of the end of the feed.
    """
    if (feed_address is None) != (ranks_address is None):
        raise ValueError("give both feed_address and ranks_address, or neither (a broker is then started)")
    if feed_address is None:
        from sparkbus.launch.broker import BrokerProcess

        with tempfile.TemporaryDirectory(prefix="sparkbus-padding-") as tmp:
            broker = BrokerProcess(Path(tmp) / "broker.log").start(timeout=30)
            try:
                return measure(df, column, batch_size=batch_size, bucket_window=bucket_window,
                               feed_address=broker.feed, ranks_address=broker.ranks, stream=stream,
                               first_epoch=first_epoch, timeout=timeout, **feed_kwargs)
            finally:
                broker.stop()

    from sparkbus.feeder import feed
    from sparkbus.worker import BatchStream

    lengths: list[list[np.ndarray]] = [[], []]
    failure: list[BaseException] = []

    def read() -> None:
        try:
            with BatchStream(ranks_address, stream=stream, timeout=timeout) as s:
                for epoch in range(2):
                    lengths[epoch] = [lengths_of(batch[column]) for batch in s.epoch()]
        except BaseException as exc:          # re-raised in the caller's thread below
            failure.append(exc)

    started = time.monotonic()
    reader = threading.Thread(target=read, name="padding-reader", daemon=True)
    reader.start()
    bucketings: tuple[dict[str, Any], ...] = ({}, {"bucket_by": column, "bucket_window": bucket_window})
    reports = [feed(df, feed_address, stream=stream, epoch=first_epoch + i, batch_size=batch_size,
                    columns=[column], ragged=[column], timeout=timeout, **feed_kwargs, **bucketing)
               for i, bucketing in enumerate(bucketings)]
    reader.join(timeout)
    if reader.is_alive():
        raise RuntimeError(f"the reader of stream {stream!r} did not finish both epochs within {timeout} s")
    if failure:
        raise RuntimeError(f"the reader of stream {stream!r} failed: {failure[0]!r}") from failure[0]
    plain, bucketed = padding_share(lengths[0]), padding_share(lengths[1])
    ratio = bucketed / plain if plain else (float("inf") if bucketed else 1.0)
    return PaddingShares(plain, bucketed, ratio, reports[0].rows, (len(lengths[0]), len(lengths[1])), batch_size,
                         bucket_window, time.monotonic() - started)
