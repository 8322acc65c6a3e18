"""Helpers shared by the unit and integration tests: bounded waits and free loopback ports."""

from __future__ import annotations

import socket
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def free_port_triple() -> int:
    """A port P on 127.0.0.1 with P, P+1 and P+2 free (feed, ranks, derived control)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base > 65530:
            continue
        held = []
        try:
            for port in (base, base + 1, base + 2):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError("no three consecutive free ports on 127.0.0.1")
