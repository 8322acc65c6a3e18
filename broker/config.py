"""Settings: human units (``512MiB``, ``30s``) and ``SPARKBUS_*`` environment variables, read in one place."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Callable, TypeVar

log = logging.getLogger("sparkbus.config")
T = TypeVar("T")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_size(text: str | int) -> int:
    """Bytes from ``1073741824``, ``1GiB``, ``512MiB``, ``64k`` (SI and binary units)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 1GiB, 512MiB or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(text: str | float) -> float:
    """Seconds from ``30``, ``30s``, ``250ms``, ``2m``, ``1h``."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (try 30s, 250ms or 2m)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def from_env(name: str, parse: Callable[[str], T], default: T) -> T:
    """``SPARKBUS_<NAME>`` parsed with ``parse``; the default, with a warning, when it is unset or bad."""
    key = f"SPARKBUS_{name.upper()}"
    raw = os.environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        log.warning("ignoring %s=%r: %s", key, raw, exc)
        return default


@dataclass
class BrokerConfig:
    """What a broker binds and how it behaves. Recorded here; sockets are made by the loop that owns them."""

    feed: str                          # PULL: data batches from Spark tasks
    ranks: str                         # ROUTER: the ranks' DEALER sockets
    control: str | None = None         # ROUTER: feeders' and drivers' requests (derived from feed if None)
    max_buffer: int = 1 << 30          # bytes of batches held before the feed socket stops being read
    max_message: int = 1 << 30         # ZeroMQ MAXMSGSIZE on every socket: no peer makes us allocate more
    heartbeat: float = 1.0             # seconds between heartbeats to ranks
    dead_after: float = 5.0            # a rank's connection silent this long (no transport heartbeat) is dead
    rejoin_grace: float = 10.0         # a lost rank's unacknowledged batches wait this long for it to rejoin
    journal: str | None = None         # directory of the append-only journal; None: state lives in memory only
    ready_file: str | None = None      # written (JSON of the bound endpoints) once every socket is bound
