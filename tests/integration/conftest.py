"""Real pieces: Spark in local mode (one session for the run), the broker through its CLI, mpiexec ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from helpers import LOOPBACK_MPI, wait_for

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def spark():
    os.environ["PYSPARK_PYTHON"] = sys.executable        # executors must run the venv's Python
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"            # loopback only
    from pyspark.sql import SparkSession

    # local[2,4]: two cores, and a failed task is retried (up to 4 attempts), as on a cluster. (Spark does not
    # speculate in local mode: test_guarantees runs concurrent attempts through the feeder's task code instead.)
    session = (SparkSession.builder.master("local[2,4]").appName("sparkbus-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@dataclass
class BrokerProcess:
    proc: subprocess.Popen
    feed: str
    ranks: str
    control: str
    log: Path
    args: list

    def stats(self, timeout: float = 5.0) -> dict:
        from broker.client import fetch_stats
        return fetch_stats(self.control, timeout)

    def restart(self) -> None:
        """Start the broker again on the same endpoints with the same flags (after it was killed)."""
        assert self.proc.poll() is not None, "restart() needs a stopped broker"
        ready = Path(self.args[self.args.index("--ready-file") + 1])
        ready.unlink(missing_ok=True)
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=open(self.log, "a"))
        wait_for(lambda: ready.exists() or self.proc.poll() is not None, 15, "the restarted broker")
        assert self.proc.poll() is None, f"broker exited: {self.log.read_text()}"

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError("broker did not stop on SIGTERM")
        return self.proc.returncode


@pytest.fixture
def start_broker(tmp_path):
    """``start_broker(*flags)``: ``python -m broker`` on loopback ports it picks itself, ready when it says so."""
    started = []

    def start(*flags: str) -> BrokerProcess:
        name = f"broker-{len(started)}"
        ready, log = tmp_path / f"{name}.json", tmp_path / f"{name}.log"
        args = [sys.executable, "-m", "broker", "--feed", "tcp://127.0.0.1:*", "--ranks", "tcp://127.0.0.1:*",
                "--ready-file", str(ready), *flags]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        wait_for(lambda: ready.exists() or proc.poll() is not None, 15, "the broker's ready file")
        assert proc.poll() is None, f"broker exited: {log.read_text()}"
        bound = json.loads(ready.read_text())
        # a restart must come back on the same ports
        args[args.index("--feed") + 1], args[args.index("--ranks") + 1] = bound["feed"], bound["ranks"]
        broker = BrokerProcess(proc, bound["feed"], bound["ranks"], bound["control"], log, args)
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


@dataclass
class Ranks:
    """``mpiexec -n n`` ranks of rank_main.py (or, with n=0, one independent consumer named ``name``)."""

    proc: subprocess.Popen
    out: Path
    n: int
    name: str = ""

    def kill(self) -> None:
        """SIGKILL the whole process group (mpiexec, its proxies and the ranks)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate(timeout=10)

    def stopped(self, name: str) -> bool:
        return (self.out / f"{name}.stopped").exists()

    def wait(self, timeout: float = 90.0) -> list[dict]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
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
        program = [sys.executable, str(HERE / "rank_main.py"), "--ranks", address, "--out", str(out), *flags]
        name = ""
        if n == 0:
            name = f"consumer{len(running)}"
            program += ["--no-mpi", "--name", name]
        else:
            program = [str(BIN / "mpiexec"), "-n", str(n), *program]
        proc = subprocess.Popen(program, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, **LOOPBACK_MPI})
        ranks = Ranks(proc, out, n, name)
        running.append(ranks)
        return ranks

    yield start
    for ranks in running:
        if ranks.proc.poll() is None:
            ranks.kill()
