"""A Spark standalone cluster on this machine: a Master and Workers from the pyspark wheel, as child processes.

Each daemon is ``bin/spark-class`` of the pyspark package (``SPARK_HOME`` is the package directory), run by
:class:`~launch.processes.ChildProcess`: in a session of its own, dying with its parent, stopped with every
executor and Python worker it started. Ports are the system's choice (``--port 0``); the Master's URL and web
UI port are read from its log, and the cluster is ready when the Master's ``/json/`` lists every Worker ALIVE.

Workers on different loopback addresses (127.0.0.1, 127.0.0.2, ...) are different hosts to Spark's scheduler.
That matters for speculation: Spark never starts a speculative copy on a host that already runs an attempt of
the task, so copies need a second host.

Faults, for tests: :meth:`StandaloneCluster.kill_executors` SIGKILLs the executor JVMs a Worker started (its Python
daemon and workers are left to notice it, as on a real machine), :meth:`StandaloneCluster.kill_worker` a Worker and
its executors at once (a host lost), and :meth:`StandaloneCluster.restart_worker` brings a killed Worker back.

    with StandaloneCluster(tmp, hosts=["127.0.0.1", "127.0.0.2"], cores=1) as cluster:
        spark = SparkSession.builder.master(cluster.master_url).config(map=cluster.app_conf()).getOrCreate()
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sparkbus.launch.processes import ChildProcess, LaunchError, descendants, wait_for

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"

# JVM flags for daemons that must start fast and do little (tests): the C1 compiler only and a serial GC spend
# less CPU while three JVMs start at once on two cores.
QUICK_START_JAVA_OPTS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")

# The Master's REST submission server listens on the fixed port 6066 unless disabled: two clusters would clash.
MASTER_CONF = {"spark.master.rest.enabled": "false"}

_MASTER_URL = re.compile(r"Starting Spark master at (spark://\S+)")
_MASTER_UI_PORT = re.compile(r"Successfully started service 'MasterUI' on port (\d+)")
_MASTER_ALIVE = "New state: ALIVE"


def spark_home() -> Path:
    """The pyspark package's directory, which holds ``bin/spark-class`` and ``jars/`` (found without importing it).

    Raises:
        LaunchError: pyspark is not installed in this interpreter.
    """
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.origin:
        raise LaunchError(f"pyspark is not installed in {sys.executable}")
    return Path(spec.origin).parent


def _java_opts(conf: Mapping[str, str], java_opts: Sequence[str]) -> str:
    return " ".join([*java_opts, *(f"-D{key}={value}" for key, value in conf.items())])


class StandaloneCluster:
    """A Spark standalone Master on ``master_host`` and one Worker per entry of ``hosts``.

    Constructing it only records the settings; :meth:`start` runs the daemons and returns once every Worker has
    registered. Use it as a context manager, or call :meth:`stop`.

    Args:
        workdir: directory for the daemons' logs (``master.log``, ``worker-N.log``) and the Workers' work dirs
            (``worker-N/``, ``SPARK_WORKER_DIR``: executors' stdout, stderr and files live there).
        hosts: one address per Worker, each also its ``SPARK_LOCAL_IP``; repeat an address for several Workers
            on one host.
        cores: cores each Worker offers.
        memory: memory each Worker offers to executors, e.g. ``"1g"``.
        master_host: the address the Master binds.
        java_opts: extra JVM flags of every daemon (e.g. :data:`QUICK_START_JAVA_OPTS`); not of the executors.
        conf: Spark properties of the daemons (``-D``), over :data:`MASTER_CONF` for the Master.
        env: variables set over this process's environment for every daemon (and so for the executors).

    Attributes (once started):
        master_url: e.g. ``spark://127.0.0.1:40123``.
        web_url: the Master's web UI, e.g. ``http://127.0.0.1:40124`` (``/json/`` is its status).
        master, workers: the :class:`~launch.processes.ChildProcess` of each daemon.
    """

    def __init__(self, workdir: Path | str, hosts: Sequence[str] = ("127.0.0.1", "127.0.0.2"), cores: int = 1,
                 memory: str = "1g", master_host: str = "127.0.0.1", java_opts: Sequence[str] = (),
                 conf: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None):
        if not hosts:
            raise ValueError("a cluster needs at least one Worker host")
        self.workdir = Path(workdir)
        self.hosts, self.cores, self.memory, self.master_host = list(hosts), cores, memory, master_host
        self.java_opts, self.conf, self.env = list(java_opts), dict(conf or {}), dict(env or {})
        self.master_url = self.web_url = ""
        self.master: ChildProcess | None = None
        self.workers: list[ChildProcess] = []

    def _daemon(self, name: str, main_class: str, args: Sequence[str], host: str,
                extra_env: Mapping[str, str], append: bool = False) -> ChildProcess:
        home = spark_home()
        env = {"SPARK_HOME": str(home), "SPARK_LOCAL_IP": host, "SPARK_CONF_DIR": str(self.workdir / "conf"),
               **self.env, **{key: value for key, value in extra_env.items() if value}}
        if self.java_opts:
            env["SPARK_DAEMON_JAVA_OPTS"] = _java_opts({}, self.java_opts)
        return ChildProcess(name, ["bash", str(home / "bin" / "spark-class"), main_class, *args],
                            self.workdir / f"{name}.log", env=env, cwd=self.workdir, append=append)

    def start(self, timeout: float = 120.0, wait: bool = True) -> str:
        """Start the Master, then the Workers, and wait until the Master lists every Worker ALIVE.

        Args:
            timeout: seconds for the Master to come up and, again, for all Workers to register.
            wait: False returns once the Master is up and the Workers are starting, so that a driver can start
                meanwhile (it waits for its executors anyway); call :meth:`wait_ready` then.

        Returns:
            The master URL, ``spark://HOST:PORT``.

        Raises:
            LaunchError: a daemon exited before the cluster was ready (the message ends with its log's last
                lines), or the cluster is already running.
            WaitTimeout: the Master or the Workers were not ready within ``timeout``.
            In every case nothing is left running.
        """
        if self.master is not None:
            raise LaunchError("the cluster has already been started")
        (self.workdir / "conf").mkdir(parents=True, exist_ok=True)     # no spark-defaults.conf from elsewhere
        try:
            self._start_master(timeout)
            for i in range(len(self.hosts)):
                self.workers.append(self._worker(i))
        except BaseException:
            self.stop()
            raise
        if wait:
            self.wait_ready(timeout)
        return self.master_url

    def _worker(self, index: int, append: bool = False) -> ChildProcess:
        host = self.hosts[index]
        work = self.workdir / f"worker-{index}"
        work.mkdir(exist_ok=True)
        return self._daemon(
            f"worker-{index}", WORKER_CLASS,
            [self.master_url, "--cores", str(self.cores), "--memory", self.memory, "--host", host,
             "--port", "0", "--webui-port", "0"], host,
            {"SPARK_WORKER_DIR": str(work), "SPARK_WORKER_OPTS": _java_opts(self.conf, ())}, append=append)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until the Master lists every Worker ALIVE.

        Raises:
            LaunchError: a daemon exited (the message ends with its log's last lines).
            WaitTimeout: not every Worker had registered within ``timeout`` seconds.
            In both cases the cluster has been stopped.
        """
        try:
            wait_for(self._all_workers_alive, timeout, f"{len(self.hosts)} Spark Workers to register with "
                     f"{self.master_url} (logs in {self.workdir})", interval=0.25)
        except BaseException:
            self.stop()
            raise

    def _start_master(self, timeout: float) -> None:
        master = self.master = self._daemon(
            "master", MASTER_CLASS, ["--host", self.master_host, "--port", "0", "--webui-port", "0"],
            self.master_host, {"SPARK_MASTER_OPTS": _java_opts({**MASTER_CONF, **self.conf}, ())})

        def alive() -> bool:
            self._check_running(master)
            return _MASTER_ALIVE in master.log.read_text(errors="replace")

        wait_for(alive, timeout, f"the Spark Master to be ALIVE ({master.log})", interval=0.1)
        text = master.log.read_text(errors="replace")
        url, port = _MASTER_URL.search(text), _MASTER_UI_PORT.search(text)
        if not url or not port:
            raise LaunchError(f"the Spark Master's log does not say its URL and web UI port:\n{master.tail()}")
        self.master_url, self.web_url = url.group(1), f"http://{self.master_host}:{port.group(1)}"

    def _all_workers_alive(self) -> bool:
        for child in [self.master, *self.workers]:
            if child is not None:
                self._check_running(child)
        try:
            status = self.status(timeout=2.0)
        except (OSError, ValueError):        # the UI is busy or not serving yet: asked again on the next poll
            return False
        alive = sorted(w["host"] for w in status.get("workers", []) if w.get("state") == "ALIVE")
        return alive == sorted(self.hosts)

    @staticmethod
    def _check_running(child: ChildProcess) -> None:
        if child.returncode is not None:
            raise LaunchError(f"the Spark {child.name} exited with status {child.returncode}; the end of "
                              f"{child.log}:\n{child.tail()}")

    def status(self, timeout: float = 5.0) -> dict:
        """The Master's status: its ``/json/`` (``workers`` with host, state, cores; ``activeapps``; ...).

        Raises:
            OSError: the Master did not answer within ``timeout`` (``urllib.error.URLError`` is one).
            ValueError: the answer was not JSON.
        """
        with urllib.request.urlopen(f"{self.web_url}/json/", timeout=timeout) as reply:
            return json.loads(reply.read())

    def app_conf(self, executor_memory: str = "512m", driver_host: str | None = None) -> dict[str, str]:
        """Spark settings of a driver that takes the whole cluster, one executor per Worker.

        Args:
            executor_memory: each executor's heap; at most the Worker's ``memory``.
            driver_host: the address executors reach the driver at (default: the Master's).
        """
        host = driver_host or self.master_host
        return {"spark.master": self.master_url, "spark.cores.max": str(self.cores * len(self.hosts)),
                "spark.executor.cores": str(self.cores), "spark.executor.memory": executor_memory,
                "spark.driver.host": host, "spark.driver.bindAddress": host}

    # ---- faults (tests) ---------------------------------------------------------------------------------------

    def worker_index(self, host: str) -> int:
        """The index of the (first) Worker on ``host``.

        Raises:
            ValueError: no Worker runs on ``host``.
        """
        return self.hosts.index(host)

    def executor_pids(self, worker: int) -> list[int]:
        """The executor JVMs (``CoarseGrainedExecutorBackend``) Worker ``worker`` started and that still run."""
        if worker >= len(self.workers) or self.workers[worker].returncode is not None:
            return []
        return [pid for pid, _ in descendants(self.workers[worker].pid) if EXECUTOR_CLASS in _cmdline(pid)]

    def kill_executors(self, worker: int) -> list[int]:
        """SIGKILL the executor JVMs of Worker ``worker`` (not what they started: a JVM killed by the kernel's OOM
        killer leaves its Python daemon and workers to notice it). Returns their pids.

        Raises:
            LaunchError: the Worker runs no executor.
        """
        pids = self.executor_pids(worker)
        if not pids:
            raise LaunchError(f"Spark worker-{worker} ({self.hosts[worker]}) runs no executor")
        for pid in pids:
            _kill(pid)
        return pids

    def kill_worker(self, worker: int) -> list[int]:
        """A host lost: SIGKILL Worker ``worker``'s JVM and its executor JVMs at once (their Python daemons and
        workers are left to notice it). Returns the pids killed, the Worker's first. :meth:`restart_worker`
        starts it again."""
        daemon = self.workers[worker]
        pids = [daemon.pid, *self.executor_pids(worker)]
        for pid in pids:
            _kill(pid)
        daemon.proc.wait(10)
        daemon.stop()          # reaps it, closes its log; nothing of its group is left to stop
        return pids

    def restart_worker(self, worker: int, timeout: float = 120.0) -> None:
        """Start Worker ``worker`` again (after :meth:`kill_worker`), on its host and work dir, and wait until the
        Master lists every Worker ALIVE (the killed one's registration gone, the new one's made).

        Raises:
            LaunchError: the Worker is still running, or a daemon exited (as :meth:`wait_ready`).
            WaitTimeout: not ready within ``timeout`` seconds (the cluster has then been stopped).
        """
        if self.workers[worker].returncode is None:
            raise LaunchError(f"Spark worker-{worker} is still running")
        self.workers[worker] = self._worker(worker, append=True)
        self.wait_ready(timeout)

    def stop(self, grace: float = 10.0) -> None:
        """Stop the Workers (and their executors and Python workers) together, then the Master; SIGKILL what
        does not exit within ``grace`` seconds. Safe to call twice."""
        if self.workers:
            with ThreadPoolExecutor(len(self.workers)) as pool:
                list(pool.map(lambda child: child.stop(grace), self.workers))
        if self.master is not None:
            self.master.stop(grace)

    def __enter__(self) -> StandaloneCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Test-only: put on the executors' PYTHONPATH with HOLD_WORKERS_ENV=DIR in their environment, the sitecustomize.py
# of this folder makes pyspark's forked Python workers outlive their daemon's SIGHUP, each recorded in DIR.
HELD_WORKERS_SITE = Path(__file__).resolve().parent / "held_workers"
HOLD_WORKERS_ENV = "SPARKBUS_TEST_HOLD_WORKERS"


def held_workers(directory: Path) -> list[dict[str, int]]:
    """The held Python workers recorded under ``directory`` (at any depth) that still run.

    Returns:
        ``{"pid", "parent", "ppid"}`` each: ``parent`` as recorded when it was held (its pyspark daemon), ``ppid``
        now (another once the daemon is gone). A recorded pid now another process's (start time) is left out.
    """
    found = []
    for path in Path(directory).glob("**/held-*.json"):
        try:
            record = json.loads(path.read_text())
            with open(f"/proc/{record['pid']}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        if stat[0] != "Z" and stat[19] == record["start"]:
            found.append({"pid": record["pid"], "parent": record["parent"], "ppid": int(stat[1])})
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparkbus.launch.cluster [--hosts 127.0.0.1,127.0.0.2] [--cores 1] [--memory 1g] [--dir DIR]``:
    run a cluster until Ctrl-C, printing the master URL."""
    import argparse
    import tempfile
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--hosts", default="127.0.0.1,127.0.0.2", help="one address per Worker")
    parser.add_argument("--cores", type=int, default=1)
    parser.add_argument("--memory", default="1g")
    parser.add_argument("--dir", help="logs and work dirs (default: a new temporary directory)")
    args = parser.parse_args(argv)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="sparkbus-cluster-"))
    with StandaloneCluster(workdir, args.hosts.split(","), args.cores, args.memory) as cluster:
        print(f"{cluster.master_url}  (web UI {cluster.web_url}, logs in {workdir}); Ctrl-C stops it", flush=True)
        try:
            while all(c is not None and c.returncode is None for c in [cluster.master, *cluster.workers]):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
