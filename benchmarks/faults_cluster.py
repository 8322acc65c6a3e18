"""The Spark standalone cluster of the fault table's executor-loss rows (``benchmarks/faults.py``): a Master and two
Workers on 127.0.0.1 and 127.0.0.2, one core each (``launch.cluster.StandaloneCluster``), a driver of the section's
own against it (``spark_driver.py``: a failed task retried, one executor per Worker), and the faults done to them
(``launch.cluster``'s). The executors run with ``launch.cluster.HELD_WORKERS_SITE`` on their ``PYTHONPATH``: it holds
their Python workers past the SIGHUP of a dying executor, so that a worker may read its input cut short at a record
batch boundary every time (benchmarks/README.md, section 11); :meth:`ClusterRig.release_held` SIGKILLs them after.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from sparkbus.launch.cluster import (
    HELD_WORKERS_SITE,
    HOLD_WORKERS_ENV,
    QUICK_START_JAVA_OPTS,
    StandaloneCluster,
    held_workers,
)
from sparkbus.launch.processes import descendants

from .common import Children, DriverProcess

HOSTS = ("127.0.0.1", "127.0.0.2")
# The driver's settings over StandaloneCluster.app_conf(): a failed task retried (up to 3 times, as the local
# driver's local[2,4]), and both executors registered before the first job.
DRIVER_CONF = {
    "spark.task.maxFailures": "4",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
    "spark.executor.extraJavaOptions": " ".join(QUICK_START_JAVA_OPTS),
}
# The daemons' (-D): a Worker that stopped answering is declared lost after 10 s, not 60, should the Master miss
# the end of its connection (a lost host's Worker is started again before the next feed, once the Master lists it
# gone).
CLUSTER_CONF = {"spark.worker.timeout": "10"}

class ClusterRig:
    """The cluster, its driver, and the faults done to them. Registered in ``children``: stopped with them.

    Constructing it starts the Master, the Workers and the driver (which waits for its two executors and warms
    them); :meth:`ready` waits for all that.
    """

    name = "fault cluster"

    def __init__(self, children: Children, work: Path):
        self.children, self.work = children, work
        self.hold = work / "held"
        self.hold.mkdir(parents=True, exist_ok=True)
        self.feeder: DriverProcess | None = None
        self.cluster = StandaloneCluster(work / "cluster", HOSTS, cores=1, memory="1g",
                                         java_opts=QUICK_START_JAVA_OPTS, conf=CLUSTER_CONF)
        children.add(self)
        self.cluster.start(timeout=120, wait=False)
        conf = {**self.cluster.app_conf(executor_memory="512m"), **DRIVER_CONF,
                "spark.executorEnv.PYTHONPATH": str(HELD_WORKERS_SITE),
                f"spark.executorEnv.{HOLD_WORKERS_ENV}": str(self.hold)}
        self.feeder = DriverProcess(children, work / "driver", "faults-cluster-driver",
                                    {"spark.master": self.cluster.master_url, **conf}, executors=len(HOSTS),
                                    slots=len(HOSTS), env={"SPARK_LOCAL_IP": HOSTS[0]})

    def ready(self, timeout: float) -> None:
        assert self.feeder is not None
        self.cluster.wait_ready(timeout)
        self.feeder.ready(timeout)

    # ---- what runs where ------------------------------------------------------------------------------------

    def executor_pid(self, host: str) -> int | None:
        """The pid of the executor JVM of ``host``'s Worker now (None: none, or the Worker is gone)."""
        found = self.cluster.executor_pids(HOSTS.index(host))
        return found[0] if found else None

    def streaming_hosts(self, feed_port: int) -> list[str]:
        """The hosts whose executor streams a partition now: one of its Python workers has a TCP connection to the
        broker's feed port (a feeding task opens it once its worker is up, and closes it at its end), so a kill
        lands mid-partition, not in a fresh executor's cold start."""
        def streams(pid: int) -> bool:
            try:
                return any(c.raddr and c.raddr.port == feed_port and c.status == psutil.CONN_ESTABLISHED
                           for c in psutil.Process(pid).net_connections("tcp4"))
            except psutil.Error:
                return False

        return [host for host in HOSTS if (pid := self.executor_pid(host)) is not None
                and any(streams(child) for child, _ in descendants(pid))]

    def warm(self, timeout: float = 180.0) -> list[str]:
        """Both executors registered and their Python workers warm (a feed's first tasks are then not cold)."""
        return self.feeder.request(timeout + 10, "warm", executors=len(HOSTS), slots=len(HOSTS), timeout=timeout)

    # ---- faults ---------------------------------------------------------------------------------------------

    def kill_executor(self, host: str) -> int:
        """SIGKILL the executor JVM on ``host`` (its Worker stays, and the Master starts a new executor there).

        Raises:
            LaunchError: no executor runs there (it died a moment ago)."""
        return self.cluster.kill_executors(HOSTS.index(host))[0]

    def kill_host(self, host: str) -> tuple[int, int | None]:
        """SIGKILL ``host``'s Worker JVM and its executor JVM at once (the host lost; :meth:`restore` brings a
        Worker back). Returns their pids."""
        pids = self.cluster.kill_worker(HOSTS.index(host))
        return pids[0], (pids[1] if len(pids) > 1 else None)

    def restore(self, timeout: float = 120.0) -> list[str]:
        """Start a Worker again on each host whose Worker was lost (``StandaloneCluster.restart_worker``: same work
        dir, settings and Master, waited for until the Master lists it ALIVE); returns those hosts. The driver's
        next :meth:`warm` waits for its executor."""
        restored = []
        for index, (host, worker) in enumerate(zip(HOSTS, self.cluster.workers)):
            if worker.returncode is not None:
                self.cluster.restart_worker(index, timeout)
                restored.append(host)
        return restored

    def release_held(self, everything: bool = False) -> int:
        """SIGKILL the held Python workers still running whose executor is gone (``everything``: all of them);
        returns how many were."""
        live = set()
        if not everything:
            for worker in self.cluster.workers:
                if worker.poll() is None:
                    live.update(pid for pid, _ in descendants(worker.pid))
        killed = 0
        for held in held_workers(self.hold):
            if held["pid"] in live:
                continue
            try:
                os.kill(held["pid"], signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        return killed

    def stop(self) -> None:
        """The driver (its application ends), the cluster, then any held worker left."""
        try:
            if self.feeder is not None:
                self.feeder.stop()
        finally:
            try:
                self.cluster.stop()
            finally:
                deadline = time.monotonic() + 5
                while self.release_held(everything=True) and time.monotonic() < deadline:
                    time.sleep(0.1)
