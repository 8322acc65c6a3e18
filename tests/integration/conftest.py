"""Real pieces: Spark in local mode (one session for the run), the broker through its CLI, mpiexec ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from launch.broker import BrokerProcess
from launch.mpi import loopback_env, mpiexec_python
from launch.processes import kill_tree, spawn
from launch.spark import local_session

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def spark():
    # local[2,4]: two cores, and a failed task is retried (up to 4 attempts), as on a cluster. (Spark does not
    # speculate in local mode: test_guarantees runs concurrent attempts through the feeder's task code instead.)
    session = local_session("local[2,4]", "sparkbus-tests")
    yield session
    session.stop()


@pytest.fixture
def start_broker(tmp_path):
    """``start_broker(*flags)``: ``python -m broker`` on loopback ports it picks itself, ready when it says so.

    The :class:`launch.broker.BrokerProcess` has ``feed``, ``ranks``, ``control``, ``proc``, ``log``,
    ``stats()`` and ``restart()``; each must stop on SIGTERM at the end of the test.
    """
    started = []

    def start(*flags: str) -> BrokerProcess:
        broker = BrokerProcess(tmp_path / f"broker-{len(started)}.log", *flags)
        started.append(broker)
        return broker.start(timeout=15)

    yield start
    for broker in started:
        broker.stop()
    assert not [broker for broker in started if broker.killed], "broker did not stop on SIGTERM"


@dataclass
class Ranks:
    """``mpiexec -n n`` ranks of rank_main.py (or, with n=0, one independent consumer named ``name``)."""

    proc: subprocess.Popen
    out: Path
    n: int
    name: str = ""

    def kill(self) -> None:
        """SIGKILL mpiexec, its proxies and the ranks (or the consumer) at once."""
        kill_tree(self.proc)
        self.proc.communicate(timeout=10)

    def stopped(self, name: str) -> bool:
        return (self.out / f"{name}.stopped").exists()

    def wait(self, timeout: float = 90.0) -> list[dict]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"ranks did not finish within {timeout} s:\n{err[-3000:]}")
        assert self.proc.returncode == 0, f"ranks failed ({self.proc.returncode}):\n{err[-3000:]}"
        names = [self.name] if self.n == 0 else [f"rank{r}" for r in range(self.n)]
        return [json.loads((self.out / f"{name}.json").read_text()) for name in names]

    def epoch(self, rank: int | str, epoch: int) -> dict[str, np.ndarray]:
        name = rank if isinstance(rank, str) else (self.name or f"rank{rank}")
        with np.load(self.out / f"{name}-epoch{epoch}.npz") as data:
            return dict(data)


@pytest.fixture
def start_ranks(tmp_path):
    """``start_ranks(n, ranks_address, *flags)``: tests/integration/rank_main.py under ``mpiexec -n n``;
    with ``n=0``, one independent consumer (no MPI) instead."""
    running = []

    def start(n: int, address: str, *flags: str) -> Ranks:
        out = tmp_path / f"ranks-{len(running)}"
        out.mkdir()
        script = [str(HERE / "rank_main.py"), "--ranks", address, "--out", str(out), *flags]
        name = ""
        if n == 0:
            name = f"consumer{len(running)}"
            command = [sys.executable, *script, "--no-mpi", "--name", name]
        else:
            command = mpiexec_python(n, *script)
        proc = spawn(command, env=loopback_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ranks = Ranks(proc, out, n, name)
        running.append(ranks)
        return ranks

    yield start
    for ranks in running:
        if ranks.proc.poll() is None:
            ranks.kill()
