"""Child processes of a test: started in a session of their own, waited for with a bound, and killed with all they
started when the test ends; and the tests' bounded wait."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

# wait_for: the tests' bounded wait, the one the benchmark and the demo use (WaitTimeout says what it awaited)
from sparkbus.launch.processes import kill_tree, spawn, wait_for

__all__ = ["Children", "children", "run_child", "wait_for"]


class Children:
    """The child processes of one test: started by :func:`launch.processes.spawn` (a session of their own, ended
    if the test process dies), waited for with a bound, and killed with all they started at teardown."""

    def __init__(self) -> None:
        self.running: list[subprocess.Popen] = []

    def spawn(self, command: Sequence[str | Path], **popen: Any) -> subprocess.Popen:
        """Start ``command`` (``popen``: ``env`` set over this environment, ``stdout``, ``stderr``, ``text``...)."""
        proc = spawn([str(part) for part in command], **popen)
        self.running.append(proc)
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float, what: str) -> tuple[Any, Any]:
        """``proc.communicate()`` within ``timeout`` seconds: its ``(stdout, stderr)``. If it does not finish in
        time, it and all it started (mpiexec, its proxies, the ranks) are killed and the test fails, naming
        ``what`` and showing the end of its stderr."""
        try:
            return proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _, err = Children.kill(proc)
            raise AssertionError(f"{what} did not finish within {timeout:g} s:\n{(err or '')[-3000:]}") from None

    @staticmethod
    def kill(proc: subprocess.Popen) -> tuple[Any, Any]:
        """SIGKILL ``proc`` and everything it started, at once; its remaining ``(stdout, stderr)``."""
        kill_tree(proc)
        return proc.communicate(timeout=10)

    def end(self) -> None:
        """Kill every child still running."""
        for proc in self.running:
            if proc.poll() is None:
                self.kill(proc)


def run_child(command: Sequence[str | Path], timeout: float, *, check: bool = False,
              **popen: Any) -> subprocess.CompletedProcess:
    """Run ``command`` to its end as :meth:`Children.spawn` starts it, its output captured as text: as
    :func:`subprocess.run` does, except that a timeout kills all it started too and fails the test (see
    :meth:`Children.finish`). ``check``: raise :class:`subprocess.CalledProcessError` if it exits non-zero."""
    proc = spawn([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 **popen)
    try:
        out, err = Children.finish(proc, timeout, " ".join(str(part) for part in command[:3]))
    finally:
        if proc.poll() is None:
            Children.kill(proc)
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def children():
    """:class:`Children`: ``children.spawn(command, ...)``, ``children.finish(proc, timeout, what)``; those still
    running at the end of the test are killed with all they started."""
    started = Children()
    yield started
    started.end()
