"""MPI collectives that wait without spinning a core.

A blocking MPI call in the mpich wheel busy-waits: a rank waiting in ``Allreduce`` burns a full core, which on
a small node starves Spark and the broker. These start the non-blocking form of the collective and test it
with a short sleep that grows from 20 µs to 250 µs, and in a long wait to a quarter of the time waited so far
(at most 4 ms): a wait costs at most that much latency, and a long one (peers waiting for data) few wake-ups.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

_SHORT_SLEEP = 2.5e-4    # the longest sleep of a short wait: 4,000 wake-ups a second
_LONG_SLEEP = 4e-3       # the longest sleep of a long one: 250 wake-ups a second
_LATENCY_SHARE = 0.25    # a sleep adds at most this share of the time already waited
IDLE_INTERVAL = 0.05     # seconds between calls of a wait's ``idle`` hook


@contextmanager
def abort_on_error(comm: Any = None) -> Iterator[None]:
    """On an exception in the block, print it and abort the MPI job (``comm.Abort(1)``; ``comm`` default
    ``MPI.COMM_WORLD``) if it has more than one rank: the other ranks are never left waiting in a collective.
    On one rank the exception goes on as raised. mpi4py is imported only then, and only without ``comm``."""
    try:
        yield
    except BaseException:
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        if comm.Get_size() > 1:
            traceback.print_exc()
            sys.stderr.flush()
            comm.Abort(1)
        raise


def wait_until(done: Callable[[], bool], idle: Callable[[], None] | None = None) -> None:
    """Call ``done`` until it returns true, sleeping 20 µs, then longer, in between: up to 250 µs, and once the
    wait is long, up to a quarter of the time waited (at most 4 ms).

    ``idle`` (if given) is called every :data:`IDLE_INTERVAL` seconds while waiting: a rank keeps its broker
    connection alive (heartbeats, a rejoin) while its peers are slow.
    """
    delay = 0.0
    started = now = time.monotonic()
    next_idle = started + IDLE_INTERVAL
    while not done():
        time.sleep(delay)
        now = time.monotonic()
        longest = min(max(_SHORT_SLEEP, (now - started) * _LATENCY_SHARE), _LONG_SLEEP)
        delay = min(max(delay * 2, 20e-6), longest)
        if idle is not None and now >= next_idle:
            idle()
            next_idle = now + IDLE_INTERVAL


def wait(request: Any, idle: Callable[[], None] | None = None) -> None:
    """Complete an mpi4py request (``Isend``, ``Iallreduce``, …) without spinning; ``idle`` as in wait_until."""
    wait_until(request.Test, idle)


def allreduce(comm: Any, send: np.ndarray, op: Any = None) -> np.ndarray:
    """``comm.Allreduce(send, op)`` into a new array, without spinning. ``op`` defaults to ``MPI.SUM``.

    Args:
        comm: an mpi4py communicator.
        send: a numpy array (contiguous), the same shape and dtype on every rank.
    Returns:
        The reduced array, the same on every rank.
    """
    from mpi4py import MPI

    recv = np.empty_like(send)
    wait(comm.Iallreduce(send, recv, op=MPI.SUM if op is None else op))
    return recv


def gather(comm: Any, send: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Every rank's ``send`` stacked on ``root`` (None on the other ranks), without spinning."""
    recv = np.empty((comm.Get_size(), *send.shape), dtype=send.dtype) if comm.Get_rank() == root else None
    wait(comm.Igather(send, recv, root=root))
    return recv


def allreduce_min(comm: Any, value: int, idle: Callable[[], None] | None = None) -> int:
    """The smallest ``value`` over the ranks of ``comm``, on every rank; ``idle`` as in :func:`wait_until`."""
    from mpi4py import MPI

    recv = np.empty(1, dtype=np.int64)
    wait(comm.Iallreduce(np.array([value], dtype=np.int64), recv, op=MPI.MIN), idle)
    return int(recv[0])


class PendingMin:
    """A started ``MIN`` allreduce of one int over ``comm``: every rank posts it, then asks :meth:`result`.

    Starting the reduction early and asking for it later overlaps the agreement with the caller's work (the
    training step), so a rank only waits when a peer is more than that work behind.
    """

    def __init__(self, comm: Any, value: int):
        from mpi4py import MPI

        self._send = np.array([value], dtype=np.int64)
        self._recv = np.empty(1, dtype=np.int64)
        self._request = comm.Iallreduce(self._send, self._recv, op=MPI.MIN)

    def result(self, idle: Callable[[], None] | None = None) -> int:
        """The smallest value over the ranks (waits, without spinning, until every rank has posted it)."""
        wait(self._request, idle)
        return int(self._recv[0])


def allgather_count(comm: Any, count: int, idle: Callable[[], None] | None = None) -> list[int]:
    """Every rank's ``count``, in rank order; ``idle`` as in :func:`wait_until`."""
    recv = np.empty(comm.Get_size(), dtype=np.int64)
    wait(comm.Iallgather(np.array([count], dtype=np.int64), recv), idle)
    return [int(c) for c in recv]
