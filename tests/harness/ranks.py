"""Ranks for the tests: a rank's HELLO (for the ledger, or sent on a socket), the steps a rank takes of an epoch,
and real ranks, tests/integration/rank_main.py under ``mpiexec``, as one consumer, or as a group without MPI
(``start_ranks``, ``start_group``: both give :class:`Ranks`)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sparkbus.launch.mpi import loopback_env, mpiexec_python
from sparkbus.wire.protocol import Kind

from harness.processes import Children, wait_for
from harness.sockets import send

RANK_MAIN = Path(__file__).parents[1] / "integration" / "rank_main.py"

# hydra, on a loaded machine, now and then fails a launch with this before any rank runs; the broker then still
# holds every batch, so the ranks are started again (up to LAUNCH_ATTEMPTS launches in all).
HYDRA_LAUNCH_FAILURE = "process reading stdin too slowly"
LAUNCH_ATTEMPTS = 3


def hello(rank=0, size=1, *, even=False, stream="s", session="", resume=False, ended=-1, req=1,
          grants=None, got=None) -> dict:
    """A rank's HELLO (every field of ``protocol.SCHEMAS[Kind.HELLO]``), as the ledger's ``join_rank`` takes it;
    ``grants``: the optional field (a rank whose steps the broker grants).

    The default ``session`` is empty: a rank that cannot rejoin, so what it held is requeued as soon as it goes.
    """
    h = {"req": req, "role": "rank", "stream": stream, "rank": rank, "size": size, "even": even,
         "session": session, "resume": resume, "ended": ended}
    if grants is not None:
        h["grants"] = grants
    if got is not None:
        h["got"] = got
    return h


def send_hello(sock, rank=0, size=1, **fields):
    """Send a rank's HELLO on ``sock`` (``fields`` as :func:`hello` takes them)."""
    send(sock, Kind.HELLO, **hello(rank, size, **fields))


def steps_of(batches: int, size: int, remainder: str = "split") -> int:
    """The steps each of ``size`` ranks takes of an epoch of ``batches`` batches from one broker: the share, and
    one more (a piece of the batches left over) unless they are dropped (``BatchStream(remainder=)``)."""
    return batches // size + (1 if batches % size and remainder != "drop" else 0)


@dataclass
class Launch:
    """One process of :class:`Ranks` and the ranks it runs: ``mpiexec`` (all of them), a consumer, or one rank of
    a group."""

    proc: subprocess.Popen
    names: list[str]                                  # the ranks' files in ``out``: rank0, rank1... or the consumer's
    what: str                                         # in messages: "ranks", "rank 1"
    again: Callable[[], subprocess.Popen] | None = None   # starts it again (mpiexec, after hydra failed a launch)


class Ranks:
    """Ranks of rank_main.py, each writing its summary (``NAME.json``), its epochs (``NAME-epochN.npz``) and a
    ``NAME.stopped`` mark (``--stop-after``) in ``out``: ``mpiexec -n n`` ranks, one independent consumer named
    ``name`` (``n`` 0), or ranks of a group of ``n`` started without MPI, a process each.

    A rank is named by its number or its file name (``rank1``, ``consumer0``).
    """

    def __init__(self, out: Path, n: int, launches: list[Launch], name: str = "") -> None:
        self.out = out
        self.n = n
        self.name = name
        self.launches = launches

    @property
    def proc(self) -> subprocess.Popen:
        """The process of ``mpiexec`` ranks or of a consumer."""
        [launch] = self.launches
        return launch.proc

    def kill(self, rank: int | str | None = None) -> None:
        """SIGKILL at once every process and all it started (mpiexec, its proxies, the ranks), or, with ``rank``,
        the process running that rank (in a group, that rank's own)."""
        for launch in self._launches(None if rank is None else [rank]):
            Children.kill(launch.proc)

    def stopped(self, rank: int | str) -> bool:
        return (self.out / f"{self._name(rank)}.stopped").exists()

    def wait_stopped(self, ranks: list[int | str], timeout: float = 90.0) -> None:
        """Wait until every rank in ``ranks`` has stopped (``--stop-after``) and hangs; a launch that hydra failed
        before any rank ran is started again, as :meth:`wait` does.

        Raises:
            AssertionError: the ranks exited instead, with the end of their log.
        """
        names = [self._name(rank) for rank in ranks]
        launches = self._launches(ranks)
        for _ in range(LAUNCH_ATTEMPTS):
            wait_for(lambda: all(self.stopped(n) for n in names) or any(la.proc.poll() is not None for la in launches),
                     timeout, f"{', '.join(names)} to stop")
            exited = [launch for launch in launches if launch.proc.poll() is not None]
            if not exited:
                return
            launch = exited[0]
            err = launch.proc.stderr.read() if launch.proc.stderr else ""
            if HYDRA_LAUNCH_FAILURE not in err or any(self.out.glob("*.npz")) or launch.again is None:
                raise AssertionError(f"the ranks exited ({launch.proc.returncode}) before they stopped:\n"
                                     f"{err[-3000:]}")
            launch.proc = launch.again()
        raise AssertionError(f"hydra failed {LAUNCH_ATTEMPTS} launches")

    def wait(self, timeout: float = 90.0, ranks: list[int | str] | None = None) -> list[dict]:
        """Wait for every process (of ``ranks`` only, if given) to exit 0, each within ``timeout`` seconds; a
        launch that hydra failed before any rank ran is started again. Returns the ranks' summaries, in order.

        Raises:
            AssertionError: a process failed or did not finish in time, with the end of its log.
        """
        for launch in self._launches(ranks):
            _, err = Children.finish(launch.proc, timeout, launch.what)
            for attempt in range(LAUNCH_ATTEMPTS - 1):
                if (launch.proc.returncode == 0 or HYDRA_LAUNCH_FAILURE not in (err or "") or launch.again is None
                        or any(self.out.glob("*.json")) or any(self.out.glob("*.npz"))):
                    break
                launch.proc = launch.again()
                _, err = Children.finish(launch.proc, timeout, f"{launch.what} (launch {attempt + 2})")
            assert launch.proc.returncode == 0, f"{launch.what} failed ({launch.proc.returncode}):\n{err[-3000:]}"
        names = [n for launch in self.launches for n in launch.names] if ranks is None else \
            [self._name(rank) for rank in ranks]
        return [json.loads((self.out / f"{name}.json").read_text()) for name in names]

    def epoch(self, rank: int | str, epoch: int) -> dict[str, np.ndarray]:
        with np.load(self.out / f"{self._name(rank)}-epoch{epoch}.npz") as data:
            return dict(data)

    def _name(self, rank: int | str) -> str:
        return rank if isinstance(rank, str) else (self.name or f"rank{rank}")

    def _launches(self, ranks: Iterable[int | str] | None) -> list[Launch]:
        """The processes running any of ``ranks`` (None: all), each once."""
        if ranks is None:
            return self.launches
        names = {self._name(rank) for rank in ranks}
        return [launch for launch in self.launches if names & set(launch.names)]


def _spawner(children: Children, command: list[str]) -> Callable[[], subprocess.Popen]:
    def launch() -> subprocess.Popen:
        return children.spawn(command, env=loopback_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)

    return launch


@pytest.fixture
def start_ranks(tmp_path, children):
    """``start_ranks(n, ranks_address, *flags)``: tests/integration/rank_main.py under ``mpiexec -n n``;
    with ``n=0``, one independent consumer (no MPI) instead. Killed at the end of the test if still running."""
    running = []

    def start(n: int, address: str, *flags: str) -> Ranks:
        out = tmp_path / f"ranks-{len(running)}"
        out.mkdir()
        script = [str(RANK_MAIN), "--ranks", address, "--out", str(out), *flags]
        if n == 0:
            name = f"consumer{len(running)}"
            spawn = _spawner(children, [sys.executable, *script, "--no-mpi", "--name", name])
            launch = Launch(spawn(), [name], "ranks")
        else:
            name = ""
            spawn = _spawner(children, mpiexec_python(n, *script))
            launch = Launch(spawn(), [f"rank{r}" for r in range(n)], "ranks", again=spawn)
        ranks = Ranks(out, n, [launch], name)
        running.append(ranks)
        return ranks

    return start


@pytest.fixture
def start_group(tmp_path, children):
    """``start_group(n, ranks_address, *flags)``: ``n`` processes of tests/integration/rank_main.py with
    ``--group r/n`` (no MPI: equal steps granted by the broker). ``only``: start these ranks only; ``out``: write
    where an earlier group wrote, so that a rank started again there (a new process: a new session) completes
    it. Killed at the end of the test if still running."""
    made = []

    def start(n: int, address: str, *flags: str, out: Path | None = None, only: list[int] | None = None) -> Ranks:
        if out is None:
            out = tmp_path / f"group-{len(made)}"
            out.mkdir()
        launches = []
        for rank in range(n) if only is None else only:
            command = [sys.executable, str(RANK_MAIN), "--ranks", address, "--out", str(out), "--group", f"{rank}/{n}",
                       *flags]
            launches.append(Launch(_spawner(children, command)(), [f"rank{rank}"], f"rank {rank}"))
        group = Ranks(out, n, launches)
        made.append(group)
        return group

    return start
