"""Child processes that end with everything they started, and bounded waits.

A child runs in a session of its own, so that it and what it starts can be signalled as one group, and gets
``PR_SET_PDEATHSIG``: the kernel sends it SIGTERM when the process that started it dies, even by SIGKILL. Not
everything a child starts stays in its group (hydra puts each MPI rank in a session of its own, the JVM its
Python worker daemon in a group of its own), so stopping a child also ends its descendants, found in /proc.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


class LaunchError(RuntimeError):
    """A child process could not be started, or exited before it was ready."""


class WaitTimeout(LaunchError, TimeoutError):
    """A bounded wait ran out; the message says what was awaited."""


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Args:
        condition: called every ``interval`` seconds.
        timeout: seconds to wait at most.
        what: what is awaited, for the message ("the broker's ready file").

    Raises:
        WaitTimeout: ``condition`` was still falsy after ``timeout`` seconds.
    """
    value = _poll(condition, timeout, interval)
    if not value:
        raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
    return value


def _poll(condition: Callable[[], T], timeout: float, interval: float) -> T:
    # The last value of ``condition``: truthy as soon as it is, falsy once ``timeout`` has passed.
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def announce_ready(path: Path | str, **fields: Any) -> None:
    """Write ``fields`` as JSON to ``path`` at once (a temporary file renamed over it): a process says it is ready,
    and whoever polls for the file never reads half of it."""
    path = Path(path)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(fields))
    temporary.rename(path)


def die_with_parent(parent: int | None = None) -> None:
    """In a child: be sent SIGTERM when the thread that started it exits (the process dying, even by SIGKILL).

    Args:
        parent: the starting process's pid, if known; if it has already died (before this call), the child
            sends itself SIGTERM at once.
    """
    if _libc is None:
        return
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def spawn(command: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
          **popen: Any) -> subprocess.Popen:
    """Start ``command`` in a session of its own, ended by SIGTERM if this process dies.

    Args:
        command: the argv.
        env: variables set over this process's own environment.
        cwd: the working directory.
        popen: other :class:`subprocess.Popen` arguments (``stdout``, ``stderr``, ``text``, ...).

    Returns:
        The :class:`subprocess.Popen`; stdin is ``/dev/null``. End it with :func:`stop_tree` or :func:`kill_tree`.

    Raises:
        OSError: the program could not be started.
    """
    return subprocess.Popen(list(command), cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=functools.partial(die_with_parent, os.getpid()),
                            **popen)


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of ``pid`` as ``(pid, start time)``, read from /proc (empty where there is none)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat:
                children.setdefault(int(stat[1]), []).append((int(entry), stat[19]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ..., starttime at 19)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _alive(process: tuple[int, str]) -> bool:
    # Same pid and same start time: the very process, not a later one that reused its pid. Zombies are gone.
    stat = _stat(process[0])
    return stat is not None and stat[19] == process[1] and stat[0] != "Z"


def _descendants_while_running(proc: subprocess.Popen) -> list[tuple[int, str]]:
    # Once proc has been reaped its pid may belong to another process, whose children are none of ours.
    return descendants(proc.pid) if proc.poll() is None else []


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (started by :func:`spawn`), if any of it is left."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(proc: subprocess.Popen, tree: list[tuple[int, str]] | None = None) -> None:
    """SIGKILL ``proc``'s group and every descendant of ``proc`` now (``tree``: descendants noted earlier)."""
    tree = _descendants_while_running(proc) if tree is None else tree
    signal_group(proc, signal.SIGKILL)
    for process in tree:
        if _alive(process):
            try:
                os.kill(process[0], signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop_tree(proc: subprocess.Popen, grace: float = 5.0) -> bool:
    """SIGTERM ``proc``'s group, wait up to ``grace`` seconds for it and its descendants, SIGKILL what is left.

    Returns:
        True if ``proc`` itself had exited within ``grace`` (False: it had to be killed).
    """
    tree = _descendants_while_running(proc)    # now: once proc is gone, its orphans cannot be traced
    signal_group(proc, signal.SIGTERM)
    _poll(lambda: proc.poll() is not None and not any(map(_alive, tree)), grace, 0.02)
    exited = proc.poll() is not None
    kill_tree(proc, tree)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    return exited


class ChildProcess:
    """A command run by :func:`spawn` with its output in a log file; :meth:`stop` ends it and all it started.

    Args:
        name: a short label for messages.
        command: the argv.
        log: file that receives stdout and stderr (replaced, unless ``append``).
        env: variables set over this process's own environment.
        cwd: the working directory.
        echo: if given, also called with each stdout line, once :meth:`start_echo` was called.
        append: add to ``log`` instead of replacing it (a restarted process).

    Raises:
        OSError: the program could not be started.
    """

    def __init__(self, name: str, command: Sequence[str], log: Path, *, env: Mapping[str, str] | None = None,
                 cwd: Path | str | None = None, echo: Callable[[str], None] | None = None, append: bool = False):
        self.name, self.command, self.log = name, list(command), Path(log)
        if not append:
            self.log.unlink(missing_ok=True)
        self._log = open(self.log, "a", buffering=1)   # O_APPEND: the child's stderr and echoed stdout interleave
        self._echo = echo
        try:
            self.proc = spawn(self.command, env=env, cwd=cwd, stdout=subprocess.PIPE if echo else self._log,
                              stderr=self._log, text=True, errors="replace")
        except BaseException:
            self._log.close()
            raise
        self.pid = self.proc.pid
        self.killed = False           # True once stop() had to SIGKILL it
        self._reader: threading.Thread | None = None
        self._stopped = False

    def start_echo(self) -> None:
        """Start copying stdout to ``echo`` and the log (kept apart from ``__init__``: fork before threads)."""
        if self._echo and self._reader is None:
            self._reader = threading.Thread(target=self._copy, name=f"echo-{self.name}", daemon=True)
            self._reader.start()

    def _copy(self) -> None:
        echo, stdout = self._echo, self.proc.stdout
        if echo is None or stdout is None:        # started without echo: nothing to copy
            return
        for line in stdout:
            if not self._log.closed:
                self._log.write(line)
            echo(line.rstrip("\n"))

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited, else None."""
        return self.proc.poll()

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group now, without waiting (safe in a signal handler)."""
        signal_group(self.proc, sig)

    def wait(self, timeout: float) -> int:
        """Wait for the child to exit and return its status.

        Raises:
            WaitTimeout: it had not exited after ``timeout`` seconds; it has been stopped.
        """
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise WaitTimeout(f"{self.name} did not finish within {timeout:g} s; the end of {self.log}:\n"
                              f"{self.tail()}") from None

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the child and all it started, wait up to ``grace`` seconds, SIGKILL what is left.

        Returns:
            The child's exit status (None only if it survived SIGKILL for ``grace`` seconds).
        """
        if self._stopped:
            return self.proc.returncode
        self._stopped = True
        self.killed = not stop_tree(self.proc, grace)
        if self._reader is not None:
            self._reader.join(grace)
        self._log.close()
        return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        """The last lines of the child's log."""
        if not self._log.closed:
            self._log.flush()
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
