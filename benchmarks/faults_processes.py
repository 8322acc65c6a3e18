"""The processes of a fault-table run (``benchmarks/faults.py``) beside its Spark driver: its consumers, its network.

Each is registered in the bench's :class:`~benchmarks.common.Children`, so that it is stopped on success, error,
Ctrl-C and SIGTERM; :class:`NetworkChild` deletes the namespaces (and ends every process in them) when stopped.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.launch.processes import ChildProcess, wait_for

from .common import HERE, ROOT, BenchError, Children

TRAIN_SECONDS = 0.005          # a consumer's step


class Consumers:
    """The consumers of one run (``faults_consumer.py``), each writing the ids it yielded into ``out``."""

    def __init__(self, children: Children, out: Path, ranks: str, stream: str, prefix: list[str] = (),
                 env: dict | None = None, timeout: float = 60.0, group: int = 0):
        self.children, self.out, self.ranks, self.stream, self.group = children, out, ranks, stream, group
        self.prefix, self.env, self.timeout = list(prefix), env, timeout
        self.running: dict[str, ChildProcess] = {}
        self.rank_of: dict[str, int] = {}         # with a group: each consumer's rank number
        self._count = 0
        out.mkdir(parents=True, exist_ok=True)

    def start(self, rank: int | None = None) -> str:
        """Start a consumer; its name. With a group: rank ``rank`` of it (default: the ``i``-th started is rank
        ``i``), e.g. a new process taking a dead rank's number."""
        name = f"consumer{self._count}"
        if self.group:
            self.rank_of[name] = self._count if rank is None else rank
        group = [f"--group={self.rank_of[name]}/{self.group}"] if self.group else []
        self._count += 1
        self.running[name] = self.children.add(ChildProcess(
            name, [*self.prefix, sys.executable, str(HERE / "faults_consumer.py"), "--ranks", self.ranks,
                   "--stream", self.stream, "--out", str(self.out), "--name", name, "--train", str(TRAIN_SECONDS),
                   "--timeout", str(self.timeout), *group], self.children.log(f"faults-{name}"), env=self.env,
            cwd=ROOT))
        return name

    def ready(self, name: str, timeout: float = 60.0) -> None:
        child = self.running[name]
        wait_for(lambda: (self.out / f"{name}.ready").exists() or child.poll() is not None, timeout,
                 f"{name} to join the broker")
        if child.poll() is not None:
            raise BenchError(f"{name} exited ({child.poll()}) before it joined:\n{child.tail()}")

    def kill(self, name: str) -> None:
        """SIGKILL one consumer (its own pid: with ``ip netns exec`` as its prefix, exec'd into it)."""
        child = self.running.pop(name)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(10)
        self.children.discard(child)

    def finish(self, timeout: float) -> list[str]:
        """Wait until every running consumer has ended its epoch (``.done``) or ``timeout``; stop them all.

        Returns the names that had not finished."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                (self.out / f"{n}.done").exists() or c.poll() is not None for n, c in self.running.items()):
            time.sleep(0.05)
        unfinished = [n for n in self.running if not (self.out / f"{n}.done").exists()]
        for child in self.running.values():
            self.children.discard(child)
        self.running.clear()
        return unfinished

    def yielded_any(self) -> bool:
        return any(p.stat().st_size > 0 for p in self.out.glob("*.ids"))

    def ids(self, suffix: str = "ids") -> dict[str, np.ndarray]:
        """Every consumer's yielded ids, in the order it yielded them (``suffix="dropped"``: those it dropped)."""
        return {p.stem: np.fromfile(p, dtype=np.int64) for p in sorted(self.out.glob(f"*.{suffix}"))}


class NetworkChild:
    """A :class:`launch.netns.Network` held by :class:`Children`: stopping it ends its processes and deletes it."""

    name = "fault network"

    def __init__(self, network: Any):
        self.network = network

    def stop(self) -> None:
        self.network.close()
