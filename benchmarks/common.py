"""Shared pieces of the benchmark: sizes, the children it starts (each stopped by :meth:`Children.stop_all` on
success, error and signal; brokers and mpiexec are ``launch`` children), a Spark driver process, mpiexec ranks, RSS.
Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkbus.launch.broker import BrokerProcess
from sparkbus.launch.mpi import loopback_env, mpiexec_python
from sparkbus.launch.processes import ChildProcess, wait_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


class BenchError(RuntimeError):
    """A part of the benchmark could not run (a child failed or did not answer)."""


class EarlyExit(BenchError):
    """Ranks exited before they were ready, before any clock started (hydra, on a loaded machine, now and then fails
    a launch: "process reading stdin too slowly"); the caller may start them again."""


@dataclass
class Sizes:
    """How big each measurement is. ``full`` is the default; ``quick`` checks the harness at small sizes."""

    name: str
    reps: int                      # repetitions per figure (the median is reported)
    hop_seconds: float             # each broker-hop measurement sends for at least this long
    rows: int                      # rows of the cached DataFrame for the end-to-end and scaling runs
    partitions: int                # its partitions (feeding tasks); local[2] runs 2 at a time
    rss_bytes: int                 # bytes pushed through the broker for its peak RSS
    rss_max_buffer: int            # the broker's --max-buffer for that
    wait_epoch_seconds: float      # target length of the data-wait epoch
    spark_rows: int                # rows of the DataFrame each Spark configuration feeds (figure 6)
    cluster_rows: int              # rows of each DataFrame of the cluster-shaped end-to-end runs (figure 2b)
    cluster_reps: int              # their repetitions: short runs on one core, more of them for a steady median
    varlen_rows: int               # rows of 64 KiB of each DataFrame of the variable-length section (figure 7)
    spark_executor_memory: str     # heap of a standalone executor (it caches that DataFrame)
    driver_memory: str
    timeout: float                 # bound on any single run (a feed, a set of ranks)


FULL = Sizes("full", reps=3, hop_seconds=1.0, rows=1 << 22, partitions=4,
             rss_bytes=4 * GiB, rss_max_buffer=64 * MiB, wait_epoch_seconds=3.0, spark_rows=1 << 20,
             cluster_rows=1 << 21, cluster_reps=5, varlen_rows=4096,
             spark_executor_memory="1g", driver_memory="4g",
             timeout=300.0)
QUICK = Sizes("quick", reps=1, hop_seconds=0.12, rows=100_000, partitions=4,
              rss_bytes=200 * MiB, rss_max_buffer=64 * MiB, wait_epoch_seconds=0.8, spark_rows=100_000,
              cluster_rows=100_000, cluster_reps=1, varlen_rows=512,
              spark_executor_memory="1g", driver_memory="2g",
              timeout=60.0)


class Children:
    """Every child the benchmark started, stopped in reverse order by :meth:`stop_all` (idempotent)."""

    def __init__(self, logs: Path):
        self.logs = logs
        self._items: list[Any] = []
        self._count = 0

    def add(self, child: Any) -> Any:
        self._items.append(child)
        return child

    def discard(self, child: Any) -> None:
        child.stop()
        if child in self._items:
            self._items.remove(child)

    def log(self, name: str) -> Path:
        self._count += 1
        return self.logs / f"{self._count:03d}-{name}.log"

    def stop_all(self) -> None:
        while self._items:
            child = self._items.pop()
            try:
                child.stop()
            except Exception as exc:          # keep stopping the others
                print(f"warning: could not stop {getattr(child, 'name', child)}: {exc}", file=sys.stderr)

    def broker(self, max_buffer: int | str = "256MiB", timeout: float = 20.0, *flags: str,
               prefix: Sequence[str] = ()) -> BrokerProcess:
        """``python -m sparkbus.broker`` (more ``flags``; ``prefix``: e.g. :func:`on_cpus`), once it listens."""
        broker = BrokerProcess(self.log("broker"), "--max-buffer", str(max_buffer), "--log-level", "WARNING",
                               *flags, cwd=ROOT, prefix=prefix)
        return self.add(broker.start(timeout))


class DriverProcess:
    """``spark_driver.py`` as a child, asked through request and answer files in ``dir``: ``driver.prepare(...)``
    and every other method of ``spark_driver.Driver`` is a request. ``conf``: its Spark settings (``spark.master``
    among them); ``executors``, ``slots``: what it waits for and warms before it is ready; ``cpus``: pin it."""

    def __init__(self, children: Children, dir: Path, name: str, conf: dict, *, executors: int = 0, slots: int = 2,
                 cpus: Sequence[int] = (), prefix: Sequence[str] = (), env: dict | None = None,
                 timeout: float = 180.0):
        self.children, self.dir, self.name, self.timeout = children, dir, name, timeout
        dir.mkdir(parents=True, exist_ok=True)
        command = [*prefix, sys.executable, str(HERE / "spark_driver.py"), "--dir", str(dir), "--executors",
                   str(executors), "--slots", str(slots), "--timeout", str(timeout),
                   *(f"--conf={k}={v}" for k, v in conf.items()),
                   *(["--cpus", ",".join(map(str, cpus))] if cpus else [])]
        self.child = children.add(ChildProcess(name, command, children.log(name), env=env, cwd=ROOT))
        self._number = 0

    def _check(self) -> None:
        if self.child.poll() is not None:
            raise BenchError(f"{self.name} exited ({self.child.poll()}):\n{self.child.tail(30)}")

    def ready(self, timeout: float | None = None) -> dict:
        """Once its executors are up and warm: ``{"executors": [...], "session_seconds": s}``."""
        wait_for(lambda: (self.dir / "ready").exists() or self.child.poll() is not None,
                 timeout or self.timeout + 30, f"{self.name} and its executors", interval=0.1)
        self._check()
        return json.loads((self.dir / "ready").read_text())

    def submit(self, cmd: str, /, **arguments: Any) -> Path:
        """Ask ``cmd``; where its answer will be (see :meth:`answered`)."""
        self._number += 1
        path = self.dir / f"req-{self._number}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"cmd": cmd, **arguments}))
        path.with_suffix(".tmp").rename(path)
        return self.dir / f"res-{self._number}.json"

    def answered(self, answer: Path) -> dict | None:
        if answer.exists():
            return json.loads(answer.read_text())
        self._check()
        return None

    def request(self, wait: float, cmd: str, /, **arguments: Any) -> Any:
        """``cmd``'s answer, waited for ``wait`` s at most. Raises BenchError if it failed."""
        answer = self.submit(cmd, **arguments)
        reply = wait_for(lambda: self.answered(answer), wait, f"{self.name}'s answer to {cmd}")
        if not reply["ok"]:
            raise BenchError(f"{self.name} failed in {cmd}:\n{reply['traceback']}")
        return reply["value"]

    def __getattr__(self, cmd: str) -> Callable[..., Any]:
        if cmd.startswith("_"):
            raise AttributeError(cmd)
        return lambda **arguments: self.request(self.timeout + 30, cmd, **arguments)

    def running_tasks(self, stream: str) -> list[int]:
        """Pids of the Python workers running a task of ``stream`` of ``feed_ids`` now (rows not all produced)."""
        pids = []
        for mark in (self.dir / "pids").glob(f"{stream}-p*.pid"):
            if not mark.with_suffix(".end").exists():
                try:
                    pid = int(mark.read_text())
                    os.kill(pid, 0)
                except (ValueError, OSError):
                    continue
                pids.append(pid)
        return sorted(pids)

    def stop(self, polite: bool = True) -> None:
        """Ask it to stop its session, if ``polite``; then stop the process and all it started, whatever is left."""
        try:
            if polite and self.child.poll() is None:
                self.request(30, "stop")
                self.child.wait(30)
        except Exception:
            pass                   # stopped below all the same
        finally:
            self.children.discard(self.child)


def on_cpus(cpus: Sequence[int]) -> list[str]:
    """The argv prefix that runs a command, and everything it starts, on ``cpus`` only (``taskset``, which execs it)."""
    return ["taskset", "-c", ",".join(str(c) for c in cpus)]


def run_ranks(children: Children, name: str, n: int, script: str, out: Path, args: Sequence[str],
              start: Callable[[], Any], timeout: float, ready_timeout: float = 60.0,
              prefix: Sequence[str] = ()) -> tuple[list[dict], Any]:
    """``mpiexec -n n python benchmarks/<script> --out out args`` (``prefix``: e.g. :func:`on_cpus`); once every rank
    is ready (``rank.ready``), ``start()`` (the timed part). Returns every rank's ``rank<r>.json`` and its value."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = children.add(ChildProcess(name, [*prefix, *mpiexec_python(n, HERE / script, "--out", str(out), *args)],
                                      children.log(name), env=loopback_env(), cwd=ROOT))
    try:
        wait_for(lambda: all((out / f"rank{r}.ready").exists() for r in range(n)) or ranks.poll() is not None,
                 ready_timeout, f"{n} ranks of {name} to be ready")
        if ranks.poll() is not None:
            raise EarlyExit(f"{name} ranks exited early ({ranks.poll()}):\n{ranks.tail()}")
        value = start()
        code = ranks.wait(timeout)
        if code != 0:
            raise BenchError(f"{name} ranks failed with exit status {code}:\n{ranks.tail()}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)], value
    finally:
        children.discard(ranks)


def open_epoch(client: Any, stream: str, epoch: int, partitions: int) -> dict:
    """``EPOCH_OPEN`` as ``feeder.feed`` sends it (plain streaming delivery)."""
    from sparkbus.wire.protocol import Kind

    return client.request(Kind.EPOCH_OPEN, stream=stream, epoch=epoch, partitions=partitions, delivery="stream")


def feed_parts(client: Any, broker: Any, stream: str, epoch: int, parts: Sequence[Any], timeout: float,
               **options: Any) -> None:
    """One epoch without Spark: :func:`open_epoch`, each of ``parts`` (an iterable of batches) through
    ``feeder.task.stream_partition`` as that partition, ``EPOCH_CLOSE``."""
    from sparkbus.feeder.task import stream_partition
    from sparkbus.wire.protocol import Kind

    open_epoch(client, stream, epoch, len(parts))
    for number, batches in enumerate(parts):
        stream_partition(batches, broker.feed, broker.control, stream, epoch, number, 0, timeout, **options)
    client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=epoch, partitions=len(parts))


class RssSampler(threading.Thread):
    """Samples a process's RSS every ``interval`` s from when it is made; :meth:`stop` returns the peak bytes."""

    def __init__(self, pid: int, interval: float = 0.05):
        import psutil

        super().__init__(daemon=True, name=f"rss-{pid}")
        self.proc, self.interval, self.peak, self.halt = psutil.Process(pid), interval, 0, threading.Event()
        self.start()

    def run(self) -> None:
        import psutil

        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return
            self.halt.wait(self.interval)

    def stop(self) -> int:
        self.halt.set()
        self.join(5)
        return self.peak
