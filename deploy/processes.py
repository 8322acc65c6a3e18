"""Child processes for the demo: bounded waits, and children that are ended with all they started."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def wait_for(condition: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``condition`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of ``pid`` as ``(pid, start time)``, read from /proc (empty where there is none).

    Needed because not everything a child starts stays in its process group: hydra puts each MPI rank in a
    session of its own, the JVM its Python worker daemon in a group of its own.
    """
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


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the demo itself is killed (even with SIGKILL, as
    # `sparkbus demo` does to it on a second Ctrl-C), the kernel sends this child SIGTERM.
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    """A command run in its own session, so that it and everything it starts can be signalled as a group.

    Args:
        name: a short label for messages.
        command: the argv.
        log: file that receives stdout and stderr.
        echo: if given, called with each stdout line as well (after :meth:`start_echo`).
        env: extra environment variables.
    """

    def __init__(self, name: str, command: Sequence[str], log: Path, echo: Callable[[str], None] | None = None,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.name, self.command, self.log_path = name, list(command), log
        log.unlink(missing_ok=True)
        self._log = open(log, "a", buffering=1)     # O_APPEND: the child's stderr and echoed stdout interleave
        self._echo = echo
        self.process = subprocess.Popen(
            self.command, cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if echo else self._log, stderr=self._log,
            start_new_session=True, preexec_fn=_die_with_parent, text=True, errors="replace")
        self._reader: threading.Thread | None = None
        self._stopped = False

    def start_echo(self) -> None:
        """Start copying stdout to ``echo`` and the log (kept apart from ``__init__``: fork before threads)."""
        if self._echo and self._reader is None:
            self._reader = threading.Thread(target=self._copy, name=f"echo-{self.name}", daemon=True)
            self._reader.start()

    def _copy(self) -> None:
        for line in self.process.stdout:
            if not self._log.closed:
                self._log.write(line)
            self._echo(line.rstrip("\n"))

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited, else None."""
        return self.process.poll()

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (it and what it started), if any is left."""
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM the group, wait up to ``grace`` seconds for the child, then SIGKILL what is left."""
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        tree = descendants(self.process.pid)     # now: once the child is gone, its orphans cannot be traced
        self.signal_group(signal.SIGTERM)
        wait_for(lambda: self.process.poll() is not None and not any(map(_alive, tree)), grace)
        # Whatever is left (in the group, or a descendant that left it) does not outlive the demo.
        self.signal_group(signal.SIGKILL)
        for process in tree:
            if _alive(process):
                try:
                    os.kill(process[0], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        if self._reader is not None:
            self._reader.join(grace)
        self._log.close()
        return self.process.returncode

    def tail(self, lines: int = 15) -> str:
        """The last lines of the child's log."""
        if not self._log.closed:
            self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
