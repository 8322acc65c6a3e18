"""A sparkbus broker as a child process: ``python -m sparkbus.broker`` on ports it picks itself, ready when it says
so."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from sparkbus.launch.processes import ChildProcess, LaunchError, wait_for


class BrokerProcess:
    """``python -m sparkbus.broker --feed tcp://HOST:* --ranks tcp://HOST:* --ready-file F [flags]`` as a child process.

    Constructing it only records the command; :meth:`start` runs it and returns once the broker has written
    its ready file (the endpoints it bound). :meth:`restart` runs it again on the same endpoints.

    Args:
        log: file for the broker's stdout and stderr (a restart appends to it).
        flags: more ``python -m sparkbus.broker`` flags, e.g. ``"--max-buffer", "8MiB"``.
        module: the module run with ``python -m`` (``broker``: a release before 0.3.0, whose parts were top-level
            packages; the version tests start one).
        host: the address the broker binds on (default loopback).
        ready_file: where the broker writes its endpoints (default: ``log`` with the suffix ``.ready.json``).
        env: variables set over this process's own environment.
        prefix: argv put before the broker's, e.g. ``["ip", "netns", "exec", "ns1"]``; it must exec the
            broker (so that the child's pid is the broker's), as ``ip netns exec`` and ``nsenter`` do.
        cwd: the working directory.
        name: a short label for messages.

    Attributes (once started):
        feed, ranks, control: the bound endpoints, e.g. ``tcp://127.0.0.1:40123``.
        pid: the broker's own pid, from its ready file.
        child: the :class:`~launch.processes.ChildProcess` of the current run; ``proc`` is its Popen.
    """

    def __init__(self, log: Path, *flags: str, host: str = "127.0.0.1", ready_file: Path | None = None,
                 env: Mapping[str, str] | None = None, prefix: Sequence[str] = (), cwd: Path | str | None = None,
                 name: str = "broker", module: str = "sparkbus.broker"):
        self.name, self.log = name, Path(log)
        self.ready_file = Path(ready_file) if ready_file else self.log.with_suffix(".ready.json")
        self.env, self.cwd = dict(env or {}), cwd
        self.command = [*prefix, sys.executable, "-m", module, "--feed", f"tcp://{host}:*",
                        "--ranks", f"tcp://{host}:*", "--ready-file", str(self.ready_file), *flags]
        self.child: ChildProcess | None = None
        self.feed = self.ranks = self.control = ""
        self.pid = 0

    @property
    def proc(self):
        """The :class:`subprocess.Popen` of the current run."""
        return self.child.proc

    @property
    def killed(self) -> bool:
        """True if the last :meth:`stop` had to SIGKILL the broker (it did not exit on SIGTERM in time)."""
        return self.child is not None and self.child.killed

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        """Run the broker and wait until it is listening.

        Returns:
            ``self``, with ``feed``, ``ranks``, ``control`` and ``pid`` set.

        Raises:
            LaunchError: the broker exited before it was ready (the message ends with its log's last lines).
            WaitTimeout: it wrote no ready file within ``timeout`` seconds.
            OSError: the program could not be started.
            In every case nothing is left running.
        """
        if self.child is not None and self.child.returncode is None:
            raise LaunchError(f"the {self.name} (pid {self.child.pid}) is already running")
        if self.child is not None:
            self.child.stop()       # the run before, which exited (or was killed) on its own: close its log
        self.ready_file.unlink(missing_ok=True)
        child = self.child = ChildProcess(self.name, self.command, self.log, env=self.env, cwd=self.cwd,
                                          append=self.pid != 0)
        try:
            wait_for(lambda: self.ready_file.exists() or child.returncode is not None, timeout,
                     f"the {self.name}'s ready file {self.ready_file}")
            if child.returncode is not None:
                raise LaunchError(f"the {self.name} exited with status {child.returncode} before it was ready; "
                                  f"the end of {self.log}:\n{child.tail()}")
            bound = json.loads(self.ready_file.read_text())
        except BaseException:
            child.stop()
            raise
        self.feed, self.ranks, self.control, self.pid = bound["feed"], bound["ranks"], bound["control"], \
            int(bound["pid"])
        # A restart comes back on the same ports (the control port follows the feed port).
        self.command[self.command.index("--feed") + 1] = self.feed
        self.command[self.command.index("--ranks") + 1] = self.ranks
        return self

    def restart(self, timeout: float = 30.0) -> BrokerProcess:
        """Run the broker again, after it exited or was killed, on the same endpoints and with the same flags.

        Raises:
            LaunchError: it is still running, or exited before it was ready; as :meth:`start` otherwise.
        """
        if self.child is None:
            raise LaunchError(f"the {self.name} was never started")
        return self.start(timeout)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM the broker, wait up to ``grace`` seconds, then SIGKILL it; return its exit status."""
        return self.child.stop(grace) if self.child is not None else None

    def stats(self, timeout: float = 5.0) -> dict:
        """The broker's figures (``STATS`` over its control socket).

        Raises:
            broker.protocol.BrokerError: no reply within ``timeout`` seconds.
        """
        from sparkbus.broker.client import fetch_stats

        return fetch_stats(self.control, timeout)
