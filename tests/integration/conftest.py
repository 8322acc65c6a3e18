"""Real pieces: Spark in local mode (one session for the run), the broker through its CLI (``start_broker_process``,
from the harness), mpiexec ranks (``start_ranks``, through the harness's ``children``)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sparkbus.launch.mpi import loopback_env, mpiexec_python
from sparkbus.launch.processes import wait_for
from sparkbus.launch.spark import local_session

from harness import Children, start_broker_process  # noqa: F401

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def spark():
    # local[2,4]: two cores, and a failed task is retried (up to 4 attempts), as on a cluster. (Spark does not
    # speculate in local mode: test_guarantees runs concurrent attempts through the feeder's task code instead.)
    session = local_session("local[2,4]", "sparkbus-tests")
    yield session
    session.stop()


@pytest.fixture
def small_arrow_batches(spark):
    """Arrow batches of 100 rows between Spark's Python stages, so a task streams part of a partition."""
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    yield
    spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")


# hydra, on a loaded machine, now and then fails a launch with this before any rank runs; the broker then still
# holds every batch, so the ranks are started again (up to LAUNCH_ATTEMPTS launches in all).
HYDRA_LAUNCH_FAILURE = "process reading stdin too slowly"
LAUNCH_ATTEMPTS = 3


@dataclass
class Ranks:
    """``mpiexec -n n`` ranks of rank_main.py (or, with n=0, one independent consumer named ``name``)."""

    proc: subprocess.Popen
    out: Path
    n: int
    name: str = ""
    relaunch: Callable[[], subprocess.Popen] | None = None

    def kill(self) -> None:
        """SIGKILL mpiexec, its proxies and the ranks (or the consumer) at once."""
        Children.kill(self.proc)

    def stopped(self, name: str) -> bool:
        return (self.out / f"{name}.stopped").exists()

    def wait_stopped(self, names: list[str], timeout: float = 90.0) -> None:
        """Wait until every rank in ``names`` has stopped (``--stop-after``) and hangs; a launch that hydra failed
        before any rank ran is started again, as :meth:`wait` does.

        Raises:
            AssertionError: the ranks exited instead, with the end of their log.
        """
        for _ in range(LAUNCH_ATTEMPTS):
            wait_for(lambda: all(self.stopped(n) for n in names) or self.proc.poll() is not None, timeout,
                     f"{', '.join(names)} to stop")
            if self.proc.poll() is None:
                return
            err = self.proc.stderr.read() if self.proc.stderr else ""
            if HYDRA_LAUNCH_FAILURE not in err or any(self.out.glob("*.npz")) or self.relaunch is None:
                raise AssertionError(f"the ranks exited ({self.proc.returncode}) before they stopped:\n{err[-3000:]}")
            self.proc = self.relaunch()
        raise AssertionError(f"hydra failed {LAUNCH_ATTEMPTS} launches")

    def wait(self, timeout: float = 90.0) -> list[dict]:
        _, err = Children.finish(self.proc, timeout, "ranks")
        for attempt in range(LAUNCH_ATTEMPTS - 1):
            if (self.proc.returncode == 0 or HYDRA_LAUNCH_FAILURE not in (err or "") or self.relaunch is None
                    or any(self.out.glob("*.json")) or any(self.out.glob("*.npz"))):
                break
            self.proc = self.relaunch()
            _, err = Children.finish(self.proc, timeout, f"ranks (launch {attempt + 2})")
        assert self.proc.returncode == 0, f"ranks failed ({self.proc.returncode}):\n{err[-3000:]}"
        names = [self.name] if self.n == 0 else [f"rank{r}" for r in range(self.n)]
        return [json.loads((self.out / f"{name}.json").read_text()) for name in names]

    def epoch(self, rank: int | str, epoch: int) -> dict[str, np.ndarray]:
        name = rank if isinstance(rank, str) else (self.name or f"rank{rank}")
        with np.load(self.out / f"{name}-epoch{epoch}.npz") as data:
            return dict(data)


@pytest.fixture
def start_ranks(tmp_path, children):
    """``start_ranks(n, ranks_address, *flags)``: tests/integration/rank_main.py under ``mpiexec -n n``;
    with ``n=0``, one independent consumer (no MPI) instead. Killed at the end of the test if still running."""
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
        def launch() -> subprocess.Popen:
            return children.spawn(command, env=loopback_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)

        ranks = Ranks(launch(), out, n, name, relaunch=launch if n else None)
        running.append(ranks)
        return ranks

    return start


@dataclass
class Group:
    """``n`` plain processes of rank_main.py, ranks ``0 .. n-1`` of a group started without MPI."""

    procs: list[subprocess.Popen]
    out: Path
    n: int

    def kill(self, rank: int) -> None:
        Children.kill(self.procs[rank])

    def wait(self, timeout: float = 90.0, ranks: list[int] | None = None) -> list[dict]:
        numbers = range(self.n) if ranks is None else ranks
        for rank in numbers:
            _, err = Children.finish(self.procs[rank], timeout, f"rank {rank}")
            assert self.procs[rank].returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
        return [json.loads((self.out / f"rank{rank}.json").read_text()) for rank in numbers]

    def epoch(self, rank: int, epoch: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"rank{rank}-epoch{epoch}.npz") as data:
            return dict(data)

    def stopped(self, rank: int) -> bool:
        return (self.out / f"rank{rank}.stopped").exists()


@pytest.fixture
def start_group(tmp_path, children):
    """``start_group(n, ranks_address, *flags)``: ``n`` processes of tests/integration/rank_main.py with
    ``--group r/n`` (no MPI: equal steps granted by the broker). ``group.restart(r, *flags)`` starts rank ``r``
    again (a new process: a new session). Killed at the end of the test if still running."""
    made = []

    def start(n: int, address: str, *flags: str, out: Path | None = None, only: list[int] | None = None) -> Group:
        if out is None:
            out = tmp_path / f"group-{len(made)}"
            out.mkdir()
        procs = []
        for rank in range(n):
            if only is not None and rank not in only:
                procs.append(None)
                continue
            command = [sys.executable, str(HERE / "rank_main.py"), "--ranks", address, "--out", str(out),
                       "--group", f"{rank}/{n}", *flags]
            procs.append(children.spawn(command, env=loopback_env(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True))
        group = Group(procs, out, n)
        made.append(group)
        return group

    return start


@pytest.fixture
def killed_inside_a_pack(start_ranks):
    """``killed_inside_a_pack(broker, stream, make_frame, *flags)``: two independent consumers of ``stream`` (rank_main
    ``flags`` each); once both have joined, ``make_frame()`` is fed in batches of 100 (packs of 64) and the victim,
    which stops after five batches (its progress in the pack, four batches, told the broker), is SIGKILLed; the
    survivor (5 ms a batch) trains on to the end. Returns ``(victim, survivor)``, both finished."""

    def run(broker, stream: str, make_frame, *flags: str) -> tuple[Ranks, Ranks]:
        from sparkbus.feeder import feed

        from helpers import wait_for

        victim = start_ranks(0, broker.ranks, "--stream", stream, "--stop-after", "5", *flags)
        survivor = start_ranks(0, broker.ranks, "--stream", stream, *flags, "--slow-rank", "0",
                               "--slow-seconds", "0.005")
        # both joined before the feed: packs are few, and a consumer alone could take them all in its window
        wait_for(lambda: len(broker.stats()["streams"].get(stream, {}).get("ranks", [])) == 2, 60, "both consumers")
        feeding = threading.Thread(target=feed, args=(make_frame(), broker.feed),
                                   kwargs=dict(stream=stream, batch_size=100, timeout=60))
        feeding.start()
        wait_for(lambda: victim.stopped(victim.name), 60, "the victim to stop after five batches")
        # its progress in the pack (the first four batches, a batch window) has reached the broker
        wait_for(lambda: any(r["acked"] >= 4 for r in broker.stats()["streams"][stream]["ranks"]), 10,
                 "the victim's progress in its pack")
        victim.kill()
        feeding.join(90)
        survivor.wait()
        return victim, survivor

    return run
