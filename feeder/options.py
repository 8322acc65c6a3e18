"""Every option of one feed as one typed record, checked once: what :func:`feeder.feed` takes besides the data.

``feed()`` keeps its keyword arguments (they are the public contract, docs/REFERENCE.md) and builds one
:class:`FeedOptions` of them; the driver, the Spark job and the recovery read that record, and nothing re-lists the
arguments. The brokers' addresses are resolved once here (``SPARKBUS_FEED_ADDRESS`` when ``address`` is None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sparkbus.feeder.task import DEFAULT_PACK_BYTES
from sparkbus.wire.address import feed_and_control_addresses
from sparkbus.wire.protocol import MAX_BUCKETS

DEFAULT_MAX_BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class FeedOptions:
    """The options of one :func:`feeder.feed` (each as documented there), with the brokers' addresses resolved.

    Raises (on construction):
        ValueError: an address that does not parse, not as many control addresses as feed addresses,
            ``bucket_window`` below 1, or ``batch_tokens`` below 1 or without a column to count (``tokens_by``,
            else ``bucket_by``, else the one ``ragged`` column); ``bucket_bounds`` without ``bucket_by``, not
            rising whole numbers of at least 0, or more than ``MAX_BUCKETS - 1`` of them.
    """

    address: str | Sequence[str] | None = None
    stream: str = "train"
    epoch: int = 0
    batch_size: int = 1024
    columns: Sequence[str] | None = None
    timeout: float = 60.0
    delivery: str = "stream"
    control: str | Sequence[str] | None = None
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    pack_bytes: int = DEFAULT_PACK_BYTES
    ragged: Sequence[str] = ()
    bucket_by: str | None = None
    bucket_window: int = 64
    bucket_bounds: Sequence[int] | None = None
    batch_tokens: int | None = None
    tokens_by: str | None = None
    arrow_batch_rows: int | None = None
    key: str | None = None
    broker_key: str | None = None
    recover: bool = True
    resume: bool = False
    # resolved from address and control: the brokers' feed and control addresses, in the same order
    feeds: tuple[str, ...] = field(init=False)
    controls: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        feeds, controls = feed_and_control_addresses(self.address, self.control)
        if self.bucket_window < 1:
            raise ValueError(f"bucket_window must be at least 1, not {self.bucket_window}")
        object.__setattr__(self, "feeds", tuple(feeds))
        object.__setattr__(self, "controls", tuple(controls))
        object.__setattr__(self, "ragged", tuple(self.ragged))
        if self.bucket_bounds is not None:
            object.__setattr__(self, "bucket_bounds", check_bucket_bounds(self.bucket_bounds, self.bucket_by))
        if self.batch_tokens is not None:
            if type(self.batch_tokens) is not int or self.batch_tokens < 1:
                raise ValueError(f"batch_tokens must be a number of tokens, at least 1, not {self.batch_tokens!r}")
            counted = self.tokens_by or self.bucket_by or (self.ragged[0] if len(self.ragged) == 1 else None)
            if counted is None:
                raise ValueError("batch_tokens counts the lengths of one column of arrays, binary or strings: name "
                                 "it with tokens_by= (or bucket_by=, or declare it alone in ragged=)")
            object.__setattr__(self, "tokens_by", counted)
        elif self.tokens_by is not None:
            raise ValueError("tokens_by= names the column batch_tokens= counts: pass batch_tokens too")
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))

    @property
    def control_derived(self) -> bool:
        """Whether the control addresses are the feed ports + 2 (no ``control=``): what an unreachable broker's
        message says."""
        return self.control is None

    def cutting(self) -> dict[str, Any]:
        """How a task cuts its partition into messages (:func:`feeder.columns.partition_messages`' arguments)."""
        return dict(batch_size=self.batch_size, max_bytes=self.max_batch_bytes, pack_bytes=self.pack_bytes,
                    ragged=self.ragged, bucket_by=self.bucket_by, bucket_window=self.bucket_window,
                    tokens_by=self.tokens_by, batch_tokens=self.batch_tokens, bucket_bounds=self.bucket_bounds)

    def task_settings(self) -> dict[str, Any]:
        """Where and how a task streams (:func:`feeder.task.stream_messages`' arguments besides its partition)."""
        return dict(feed_address=list(self.feeds), control_address=list(self.controls), stream=self.stream,
                    epoch=self.epoch, timeout=self.timeout, key=self.key, broker_key=self.broker_key)


def check_bucket_bounds(bounds: Sequence[int], bucket_by: str | None) -> tuple[int, ...]:
    """``bounds`` as a tuple, if they are coordinated buckets' bounds: rising lengths of ``bucket_by``'s column
    (whole numbers, at least 0), at most ``MAX_BUCKETS - 1`` of them (the buckets are one more).

    Raises:
        ValueError: no ``bucket_by``, or bounds that are not as above.
    """
    if not bucket_by:
        raise ValueError("bucket_bounds= are lengths of the column bucket_by= names: pass bucket_by too")
    if isinstance(bounds, (str, bytes)) or not isinstance(bounds, Sequence):
        raise ValueError(f"bucket_bounds must be a sequence of lengths, such as (64, 128, 256), not {bounds!r:.60}")
    checked = tuple(bounds)
    if not checked or len(checked) > MAX_BUCKETS - 1:
        raise ValueError(f"bucket_bounds must hold 1 to {MAX_BUCKETS - 1} lengths (the buckets are one more), "
                         f"not {len(checked)}")
    if not all(type(b) is int and b >= 0 for b in checked) \
            or any(a >= b for a, b in zip(checked, checked[1:])):
        raise ValueError(f"bucket_bounds must be rising whole numbers of at least 0, not {checked!r:.80}")
    return checked


__all__ = ["FeedOptions", "DEFAULT_MAX_BATCH_BYTES", "check_bucket_bounds"]
