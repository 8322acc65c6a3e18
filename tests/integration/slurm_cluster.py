"""A one-node Slurm made from Debian's packages (slurmctld, slurmd, munge, slurm-client), for test_slurm.py.

Everything lives in one directory of its own: the slurm.conf, munged's key and socket, the daemons' state, spool,
logs and pid files. The daemons run in the foreground as children of the test process (stopped by their pids,
ended by the kernel if the test process dies) and listen on free loopback ports only; the client commands find
this Slurm through ``SLURM_CONF`` (:attr:`OneNodeSlurm.env`), which ``sbatch`` passes on to the job.

    python tests/integration/slurm_cluster.py       # start one, print sinfo and the start-up time, stop it
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
for root in (HERE.parents[1], HERE.parent):     # run as a script from anywhere: sparkbus, the tests' harness
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

from sparkbus.launch.processes import ChildProcess, WaitTimeout, wait_for  # noqa: E402

from harness.sockets import free_ports  # noqa: E402

PROGRAMS = {"munged": "munge", "mungekey": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sinfo": "slurm-client", "sbatch": "slurm-client", "srun": "slurm-client", "squeue": "slurm-client",
            "scancel": "slurm-client", "scontrol": "slurm-client"}
START_SECONDS = 30.0        # until sinfo shows the node idle (seen here: ~1.3 s)
STOP_SECONDS = 20.0         # for the jobs to go, then for each daemon after SIGTERM


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the one-node Slurm; the message says why (the test skips with it)."""


def unavailable() -> str | None:
    """Why a one-node Slurm cannot be made here, or None if it can be tried."""
    if os.geteuid() != 0:
        return "the one-node Slurm runs its daemons as root (SlurmUser=root): run as root"
    missing = sorted({package for program, package in PROGRAMS.items() if not shutil.which(program)})
    if missing:
        return (f"Debian's {', '.join(missing)} not installed (.ci/run installs them: apt-get install slurmd "
                "slurmctld munge slurm-client)")
    return None


class OneNodeSlurm:
    """slurmctld, slurmd and munged on this host, one node (``cpus`` CPUs declared) in one partition ``debug``.

    :meth:`start` returns once ``sinfo`` shows the node idle, or raises :class:`SlurmUnavailable` with the
    daemons' last log lines, having stopped what it started. :meth:`stop` cancels every job, waits for them to
    go, then stops the daemons by their pids (SIGTERM, then SIGKILL) and removes the directory.
    """

    def __init__(self, cpus: int = 4, directory: Path | None = None):
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.dir = Path(directory or tempfile.mkdtemp(prefix="sparkbus-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.logs = self.dir / "log"
        self.daemons: list[ChildProcess] = []
        self.start_seconds = 0.0
        self._stepd_before: set[int] = set()

    @property
    def env(self) -> dict[str, str]:
        """What the client commands need to reach this Slurm (and what sbatch passes on to the job)."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self) -> OneNodeSlurm:
        started = time.monotonic()
        self.dir.chmod(0o755)            # munged wants its socket's directories searchable by all
        for name in ("state", "spool", "log", "munge-run"):
            (self.dir / name).mkdir(mode=0o755, exist_ok=True)
        key = self.dir / "munge-key"
        key.mkdir(mode=0o700, exist_ok=True)
        self._stepd_before = set(_slurmstepds())
        try:
            self._run(["mungekey", "--create", "--keyfile", str(key / "munge.key")], timeout=10)
            socket_path = self.dir / "munge-run" / "munge.socket"
            self._daemon("munged", ["munged", "--foreground", f"--socket={socket_path}",
                                    f"--key-file={key / 'munge.key'}", f"--log-file={self.logs / 'munged.log'}",
                                    f"--pid-file={self.dir / 'munge-run' / 'munged.pid'}",
                                    f"--seed-file={key / 'munged.seed'}"])
            wait_for(lambda: socket_path.exists() or self._exited(), 10, "munged's socket")
            self._write_conf(socket_path)
            self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._daemon("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
            wait_for(lambda: self._node_state() == "idle" or self._exited(), START_SECONDS, "the node to be idle")
            if self._exited():
                raise SlurmUnavailable(f"{self._exited()} exited while Slurm started")
        except (WaitTimeout, SlurmUnavailable, OSError, subprocess.SubprocessError) as exc:
            reason = f"the one-node Slurm did not start: {exc}\n{self.tails()}"
            self.stop()
            raise SlurmUnavailable(reason) from exc
        self.start_seconds = time.monotonic() - started
        return self

    def _write_conf(self, munge_socket: Path) -> None:
        ctld_port, slurmd_port = free_ports(2)
        d = self.dir
        self.conf.write_text("\n".join([
            "ClusterName=sparkbus-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            # every daemon and srun binds the address its host name resolves to, not INADDR_ANY: loopback here
            "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",      # the node as declared below, not as probed
            "MpiDefault=none",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MailProg=/bin/true",
            "KillWait=10",                            # SIGTERM to SIGKILL when a step or job is ended
            "InactiveLimit=0",
            "MinJobAge=600",                          # finished jobs stay visible to squeue/scontrol
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4096 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
            ""]))

    def _daemon(self, name: str, command: Sequence[str]) -> None:
        self.daemons.append(ChildProcess(name, command, self.logs / f"{name}.out", env=self.env, cwd=self.dir))

    def _exited(self) -> str:
        return ", ".join(f"{d.name} (status {d.returncode})" for d in self.daemons if d.returncode is not None)

    def _node_state(self) -> str:
        result = self.run(["sinfo", "--noheader", "--nodes", self.node, "--format", "%T"], timeout=10)
        return result.stdout.strip() if result.returncode == 0 else ""

    def _run(self, command: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
        result = self.run(command, timeout)
        if result.returncode:
            raise SlurmUnavailable(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def run(self, command: Sequence[str], timeout: float = 30, **popen) -> subprocess.CompletedProcess:
        """A client command (sinfo, sbatch, squeue, ...) against this Slurm, its output captured as text."""
        env = {**os.environ, **self.env, **popen.pop("env", {})}
        return subprocess.run(list(command), capture_output=True, text=True, timeout=timeout, env=env, **popen)

    def jobs(self) -> list[str]:
        """The ids of the jobs Slurm still holds as pending, running or completing."""
        result = self.run(["squeue", "--noheader", "--format", "%i", "--states", "PD,R,CG,S,CF"], timeout=10)
        return result.stdout.split() if result.returncode == 0 else []

    def tails(self, lines: int = 15) -> str:
        """The last lines of every daemon's log, for a failure message."""
        parts = []
        for path in sorted(self.logs.glob("*")) if self.logs.exists() else ():
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> list[int]:
        """Cancel the jobs, stop the daemons, remove the directory.

        Returns:
            The pids of job step daemons (slurmstepd) found still running after slurmd stopped, which were
            then killed: a test should fail on any (none is expected once the jobs are gone).
        """
        if any(d.returncode is None for d in self.daemons if d.name == "slurmctld"):
            if self.jobs():
                self.run(["scancel", "--full", *self.jobs()], timeout=10)
                try:
                    wait_for(lambda: not self.jobs(), STOP_SECONDS, "the cancelled jobs to end", interval=0.2)
                except WaitTimeout:
                    pass
        # A finished job's step daemons report to slurmd and exit a moment after squeue stops showing the job.
        try:
            wait_for(lambda: not self._new_stepds(), STOP_SECONDS, "the jobs' slurmstepd to exit", interval=0.1)
        except WaitTimeout:
            pass
        for daemon in reversed(self.daemons):          # slurmd, slurmctld, then munged
            daemon.stop(STOP_SECONDS)
        left = self._new_stepds()
        for pid in left:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
        return left


    def _new_stepds(self) -> list[int]:
        return [pid for pid in _slurmstepds() if pid not in self._stepd_before]


def _slurmstepds() -> list[int]:
    # slurmd starts each step's slurmstepd as a daemon of its own (not its child once started): found by name
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                name = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if name == "slurmstepd":
                found.append(int(entry))
    return found


if __name__ == "__main__":
    reason = unavailable()
    if reason:
        sys.exit(reason)
    slurm = OneNodeSlurm()
    try:
        slurm.start()
        print(slurm.run(["sinfo"]).stdout, end="")
        print(f"started in {slurm.start_seconds:.2f} s; SLURM_CONF={slurm.conf}")
    finally:
        left = slurm.stop()
        print(f"stopped; slurmstepd left: {left or 'none'}")
