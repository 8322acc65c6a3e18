"""Figure 11, a fault table (issue 18 §4): per fault kind (``KINDS``), a long feed from Spark with faults injected at
seeded random times, and the rows lost (ids fed that no consumer yielded) and trained twice (yielded copies beyond
the first). A report, not an assertion. benchmarks/README.md, section 11, describes every kind, the processes
(``spark_driver.py``, the consumers ``rank.py --name``, ``faults_cluster.py``) and the ``SPARKBUS_BENCH_FAULTS_*``
variables."""

from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.broker import BrokerProcess
from sparkbus.launch.processes import ChildProcess, LaunchError, wait_for

from .common import HERE, ROOT, BenchError, Children, DriverProcess
from .faults_cluster import HOSTS, ClusterRig
from .sections import Context, Run, Section

KINDS = ("none", "broker_journal", "broker_journal_group", "broker_no_journal", "broker_no_journal_group", "rank",
         "rank_group", "executor", "cluster_executor", "cluster_executor_atomic", "cluster_host", "cluster_host_atomic",
         "link")
# The rows fed from a standalone cluster (faults_cluster.py): not in --quick unless SPARKBUS_BENCH_FAULTS_KINDS asks
CLUSTER_KINDS = ("cluster_executor", "cluster_executor_atomic", "cluster_host", "cluster_host_atomic")
CONSUMERS = 2
WIDTH = 256                    # the cluster rows' x: float32s a row (a 100-row batch is 100 KiB, see spark_driver)
TRAIN_SECONDS = 0.005          # a consumer's step
GAP = 2.5                      # seconds between two faults of a run, at least
BATCH = 100
# The section's own Spark driver (spark_driver.py): two task slots and a failed task retried
DRIVER = {"spark.master": "local[2,4]", "spark.app.name": "sparkbus-bench-faults"}


@dataclass
class Plan:
    """The sizes of a fault table."""

    seed: int
    rows: int
    partitions: int
    pause: float               # a task's sleep after each batch's worth of rows
    faults: int                # per kind
    kinds: tuple[str, ...]
    timeout: float             # bound on a run's feed and its consumers
    broker_timeout: float = 4.0   # feed(timeout=) where the broker is killed: a task waits that long for it
    skipped: dict[str, str] = field(default_factory=dict)     # kinds not run, and why

    @property
    def feed_seconds(self) -> float:
        """The feed's expected length: waves of 2 tasks, each ``rows / partitions / BATCH`` pauses."""
        return math.ceil(self.partitions / 2) * self.rows / self.partitions / BATCH * self.pause


FULL_PLAN = dict(rows=60_000, partitions=8, pause=0.04, faults=3, broker_timeout=4.0)    # 600 batches, ~12 s a feed
QUICK_PLAN = dict(rows=4_000, partitions=4, pause=0.08, faults=1, broker_timeout=1.0)     # 40 batches, ~1.6 s


@dataclass
class FaultRun:
    """One feed of the table and what its consumers yielded."""

    kind: str
    rows_fed: int
    yielded: int = 0
    lost: int = 0
    twice: int = 0
    out_of_range: int = 0
    dropped: int = 0               # rows a group dropped to keep its steps equal (counted, not lost)
    answered_s: float = 0.0        # when feed() returned or raised, in seconds after the first row yielded
    outcome: str = ""              # "completed", or "failed: <exception type>"
    error: str = ""
    seconds: float = 0.0
    planned: int = 0               # faults planned in this run
    faults: list[dict] = field(default_factory=list)     # injected: at_s, what, seconds
    delivery: str = "stream"
    held: int = 0                  # cluster rows: Python workers of lost executors still running after the feed
    broker: dict = field(default_factory=dict)           # the broker's figures of the epoch at the end, if reachable
    twice_ids: list[str] = field(default_factory=list)   # the first runs of ids trained twice, and who had them
    lost_ids: list[str] = field(default_factory=list)    # the first runs of ids lost


SUMMED = ("planned", "rows_fed", "yielded", "lost", "twice", "out_of_range", "dropped", "seconds")


@dataclass
class FaultTable:
    """Figure 11: every run, per kind, and the kinds skipped with their reason."""

    plan: Plan
    runs: list[FaultRun] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def rows(self) -> list[dict]:
        """Per kind (in ``KINDS`` order): its runs added up, or why it was skipped."""
        out: list[dict] = []
        for kind in self.plan.kinds:
            runs = [r for r in self.runs if r.kind == kind]
            if kind in self.skipped:
                out.append({"kind": kind, "skipped": self.skipped[kind]})
            elif runs:
                out.append({"kind": kind, "runs": len(runs), "faults": sum(len(r.faults) for r in runs),
                            "outcomes": dict(Counter(r.outcome for r in runs)),
                            **{key: sum(getattr(r, key) for r in runs) for key in SUMMED}})
        return out


def plan_of(quick: bool, timeout: float) -> Plan:
    base = dict(QUICK_PLAN if quick else FULL_PLAN)
    env = os.environ.get
    seed = int(env("SPARKBUS_BENCH_FAULTS_SEED") or time.time_ns() % 1_000_000)
    rows = int(env("SPARKBUS_BENCH_FAULTS_ROWS") or base["rows"])
    faults = int(env("SPARKBUS_BENCH_FAULTS_FAULTS") or base["faults"])
    kinds = tuple(k.strip() for k in (env("SPARKBUS_BENCH_FAULTS_KINDS") or ",".join(KINDS)).split(",") if k.strip())
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise BenchError(f"SPARKBUS_BENCH_FAULTS_KINDS: unknown kinds {sorted(unknown)}; choose from {KINDS}")
    skipped = {} if env("SPARKBUS_BENCH_FAULTS_KINDS") or not quick else {
        kind: "not in --quick (a standalone cluster of its own, about a minute more); "
              "SPARKBUS_BENCH_FAULTS_KINDS runs it" for kind in CLUSTER_KINDS if kind in kinds}
    return Plan(seed, rows, base["partitions"], base["pause"], faults, kinds, timeout, base["broker_timeout"],
                skipped)


def fault_times(rng: random.Random, n: int, length: float) -> list[float]:
    """``n`` times within 10-85 % of ``length``, sorted, at least :data:`GAP` apart (later ones pushed back)."""
    times = sorted(rng.uniform(0.10 * length, 0.85 * length) for _ in range(n))
    for i in range(1, len(times)):
        times[i] = max(times[i], times[i - 1] + GAP)
    return times


class Consumers:
    """The consumers of one run (``rank.py --name NAME --ids``), each writing the ids it yielded into ``out``."""

    def __init__(self, children: Children, out: Path, ranks: str, stream: str, prefix: list[str] = (),
                 env: dict | None = None, timeout: float = 60.0, group: int = 0):
        self.children, self.out, self.ranks, self.stream, self.group = children, out, ranks, stream, group
        self.prefix, self.env, self.timeout = list(prefix), env, timeout
        self.running: dict[str, ChildProcess] = {}
        self.rank_of: dict[str, int] = {}         # with a group: each consumer's rank number
        self._count = 0
        out.mkdir(parents=True, exist_ok=True)

    def start(self, rank: int | None = None) -> str:
        """Start a consumer; its name. With a group: rank ``rank`` of it (default: the ``i``-th started is rank
        ``i``), e.g. a new process taking a dead rank's number."""
        name = f"consumer{self._count}"
        if self.group:
            self.rank_of[name] = self._count if rank is None else rank
        group = [f"--group={self.rank_of[name]}/{self.group}"] if self.group else []
        self._count += 1
        self.running[name] = self.children.add(ChildProcess(
            name, [*self.prefix, sys.executable, str(HERE / "rank.py"), "--ranks", self.ranks, "--stream",
                   self.stream, "--out", str(self.out), "--launch", "none", "--name", name, "--ids", "--compute",
                   str(TRAIN_SECONDS), "--prefetch-bytes", "0", "--timeout", str(self.timeout), *group],
            self.children.log(f"faults-{name}"), env=self.env, cwd=ROOT))
        return name

    def ready(self, name: str, timeout: float = 60.0) -> None:
        child = self.running[name]
        wait_for(lambda: (self.out / f"{name}.ready").exists() or child.poll() is not None, timeout,
                 f"{name} to join the broker")
        if child.poll() is not None:
            raise BenchError(f"{name} exited ({child.poll()}) before it joined:\n{child.tail()}")

    def kill(self, name: str) -> None:
        """SIGKILL one consumer (its own pid: with ``ip netns exec`` as its prefix, exec'd into it)."""
        child = self.running.pop(name)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(10)
        self.children.discard(child)

    def finish(self, timeout: float) -> list[str]:
        """Wait until every running consumer has ended its epoch (``NAME.json``) or ``timeout``; stop them all.

        Returns the names that had not finished."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(
                (self.out / f"{n}.json").exists() or c.poll() is not None for n, c in self.running.items()):
            time.sleep(0.05)
        unfinished = [n for n in self.running if not (self.out / f"{n}.json").exists()]
        for child in self.running.values():
            self.children.discard(child)
        self.running.clear()
        return unfinished

    def yielded_any(self) -> bool:
        return any(p.stat().st_size > 0 for p in self.out.glob("*.ids"))

    def ids(self, suffix: str = "ids") -> dict[str, np.ndarray]:
        """Every consumer's yielded ids, in the order it yielded them (``suffix="dropped"``: those it dropped)."""
        return {p.stem: np.fromfile(p, dtype=np.int64) for p in sorted(self.out.glob(f"*.{suffix}"))}


# ---- one run ----------------------------------------------------------------------------------------------

def count(run: FaultRun, yielded: dict[str, np.ndarray], rows: int, dropped: dict[str, np.ndarray]) -> None:
    """Lost and trained twice from every consumer's ids; where rows came twice, which ones and who had them.
    ``dropped``: ids a group dropped to keep its steps equal, counted (``stats.dropped_batches``): not lost."""
    ids = np.concatenate(list(yielded.values())) if yielded else np.zeros(0, np.int64)
    inside = ids[(ids >= 0) & (ids < rows)]
    unique, copies = np.unique(inside, return_counts=True)
    run.dropped = int(sum(len(d) for d in dropped.values()))
    accounted = np.union1d(unique, np.concatenate(list(dropped.values()))) if dropped else unique
    run.yielded, run.out_of_range = len(ids), len(ids) - len(inside)
    run.lost, run.twice = rows - len(accounted[(accounted >= 0) & (accounted < rows)]), len(inside) - len(unique)
    run.twice_ids = [describe(span, yielded) for span in spans(unique[copies > 1])[:5]]
    run.lost_ids = [f"{a:,}-{b:,}" for a, b in spans(np.setdiff1d(np.arange(rows), accounted))[:5]]


def spans(ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted ids as runs of consecutive ids ``(first, last)``."""
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1)
    starts, ends = np.r_[ids[0], ids[breaks + 1]], np.r_[ids[breaks], ids[-1]]
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


def describe(span: tuple[int, int], yielded: dict[str, np.ndarray]) -> str:
    """``ids A-B: consumer0 (at batch i), consumer1 (at batch j)``: who yielded the span, and when (its batch)."""
    who = []
    for name, ids in yielded.items():
        for position in np.flatnonzero(ids == span[0]):
            who.append(f"{name} (its batch {position // BATCH + 1} of {len(ids) // BATCH})")
    return f"ids {span[0]:,}-{span[1]:,}: " + ", ".join(who)


def broker_flags(kind: str, journal: Path) -> list[str]:
    flags = ["--heartbeat", "200ms"]
    if kind.startswith("broker_journal"):
        flags += ["--journal", str(journal)]
    if kind.startswith("rank"):
        flags += ["--rejoin-grace", "2s"]
    if kind == "link":
        flags = ["--heartbeat", "500ms", "--dead-after", "2s"]
    return flags


def one_run(ctx: Context, plan: Plan, kind: str, times: list[float], rng: random.Random, index: int,
            feeder: DriverProcess, where: dict) -> FaultRun:
    """One feed of ``kind`` with faults at ``times`` (s after the feed's start)."""
    stream = f"{kind}-{index}"
    work = ctx.work / "faults" / stream
    work.mkdir(parents=True, exist_ok=True)
    request = where.get("request", {})      # the cluster rows: source="dataframe", delivery
    run = FaultRun(kind, plan.rows, planned=len(times), delivery=request.get("delivery", "stream"))
    broker = ctx.children.add(BrokerProcess(ctx.children.log(f"faults-broker-{stream}"), "--max-buffer", "64MiB",
                                            "--log-level", "WARNING", *broker_flags(kind, work / "journal"),
                                            host=where.get("host", "127.0.0.1"), prefix=where.get("broker", ()),
                                            env=where.get("env"), cwd=ROOT, name=f"broker {stream}"))
    broker.start(30)
    consumers = Consumers(ctx.children, work / "ids", broker.ranks, stream, where.get("ranks", ()),
                          where.get("env"), timeout=max(plan.timeout, 30.0),
                          group=CONSUMERS if kind.endswith("_group") else 0)
    try:
        for _ in range(CONSUMERS):
            consumers.ready(consumers.start())
        feed_timeout = plan.broker_timeout if kind.startswith("broker") else 15.0
        started = time.monotonic()
        answer = feeder.submit("feed_ids", rows=plan.rows, partitions=plan.partitions, batch_size=BATCH,
                               pause=plan.pause, address=broker.feed, stream=stream, timeout=feed_timeout,
                               pack_bytes=0, **request)
        # The faults' clock starts at the first row a consumer yielded (the Spark job's start is not the feed's).
        reply = wait_for(lambda: feeder.answered(answer) or consumers.yielded_any(), plan.timeout,
                         f"the first row of {stream} at a consumer")
        reply = reply if isinstance(reply, dict) else None
        first = time.monotonic()
        for at in times:
            while reply is None and time.monotonic() - first < at:
                reply = feeder.answered(answer)
                time.sleep(0.02)
            if reply is not None:
                break                       # the feed ended before this fault: not injected
            now = round(time.monotonic() - first, 2)
            fault = inject(kind, rng, broker, consumers, feeder, stream, where)
            if fault:
                fault.update(planned_s=round(at, 2), at_s=now)
                run.faults.append(fault)
                ctx.log(f"  faults: {stream} at {fault['at_s']:.1f} s: {fault['what']}")
        reply = reply or wait_for(lambda: feeder.answered(answer), plan.timeout, f"the feed of {stream}")
        run.seconds, run.answered_s = time.monotonic() - started, round(time.monotonic() - first, 1)
        if reply["ok"]:
            run.outcome = "completed"
            unfinished = consumers.finish(plan.timeout)
            if unfinished:
                run.error = f"consumers {unfinished} did not end the epoch within {plan.timeout:g} s"
        else:
            run.outcome, run.error = f"failed: {reply['type']}", reply["error"].strip().splitlines()[0][:300]
            consumers.finish(2.0)          # what the consumers had yielded by then is what they trained
        try:
            if not where.get("broker"):
                run.broker = {k: v for k, v in broker.stats(5.0)["streams"].get(stream, {}).get("epochs", {})
                              .get("0", {}).items() if k in ("batches_in", "duplicates", "redelivered",
                                                              "given_twice", "acked", "superseded")}
        except Exception:
            pass
    finally:
        consumers.finish(0)
        ctx.children.discard(broker)
        if "rig" in where:
            run.held = where["rig"].release_held()
    count(run, consumers.ids(), plan.rows, consumers.ids("dropped"))
    ctx.log(f"  faults: {stream}: {run.outcome}, {len(run.faults)}/{run.planned} faults, {run.yielded:,} rows yielded "
            f"of {run.rows_fed:,}: {run.lost:,} lost, {run.twice:,} twice ({run.seconds:.1f} s)")
    return run


def inject(kind: str, rng: random.Random, broker: BrokerProcess, consumers: Consumers, feeder: DriverProcess,
           stream: str, where: dict) -> dict | None:
    """Inject one fault of ``kind`` now; what was done (None if nothing could be)."""
    began = time.monotonic()
    if kind.startswith("broker"):
        pid = broker.proc.pid
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait(10)
        broker.restart(30)
        return {"what": f"broker pid {pid} SIGKILLed, restarted in {time.monotonic() - began:.2f} s",
                "seconds": round(time.monotonic() - began, 2)}
    if kind.startswith("rank"):
        victim = rng.choice(sorted(consumers.running))
        rank = consumers.rank_of.get(victim)
        consumers.kill(victim)
        fresh = consumers.start(rank)
        number = f" (rank {rank})" if rank is not None else ""
        return {"what": f"{victim}{number} SIGKILLed, {fresh} started{number}",
                "seconds": round(time.monotonic() - began, 2)}
    if kind == "executor":
        try:
            pids = feeder.running_tasks(stream) or wait_for(lambda: feeder.running_tasks(stream), 5.0,
                                                            "a running task", interval=0.05)
        except TimeoutError:
            return None
        pid = rng.choice(pids)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        return {"what": f"Python worker pid {pid} (of {len(pids)} running tasks) SIGKILLed", "seconds": 0.0}
    if kind in CLUSTER_KINDS:
        rig, port = where["rig"], int(broker.feed.rsplit(":", 1)[1])
        try:        # an executor lost a moment ago may not be back (or warm) yet: wait for one that streams
            hosts = rig.streaming_hosts(port) or wait_for(lambda: rig.streaming_hosts(port), 15.0,
                                                          "an executor streaming a partition", interval=0.05)
        except TimeoutError:
            return None
        host = rng.choice(hosts)
        if kind.startswith("cluster_executor"):
            try:
                pid = rig.kill_executor(host)
            except LaunchError:        # it died on its own a moment ago
                return None
            what = f"executor JVM pid {pid} on {host} SIGKILLed ({len(hosts)} of {len(HOSTS)} executors streaming)"
        else:
            worker, pid = rig.kill_host(host)
            what = f"host {host} lost: its Worker JVM pid {worker} and executor JVM pid {pid} SIGKILLed"
        return {"what": what, "host": host, "seconds": round(time.monotonic() - began, 2)}
    if kind == "link":
        network, length = where["network"], rng.uniform(1.0, 4.0)
        network.cut("ranks")
        try:
            time.sleep(length)
        finally:
            network.restore("ranks")
        return {"what": f"consumers' link cut for {length:.1f} s", "seconds": round(length, 2)}
    return None


# ---- the section ------------------------------------------------------------------------------------------

def run(ctx: Context, plan: Plan, name: str = "faults") -> FaultTable:
    """Every kind of ``plan``; the table is in ``ctx.results[name]`` from the start, so that a failure part-way
    still reports the runs measured."""
    from sparkbus.launch import netns

    result = ctx.results[name] = FaultTable(plan)
    result.skipped.update(plan.skipped)
    rng = random.Random(plan.seed)
    started = time.monotonic()
    ctx.log(f"  faults: seed {plan.seed}, {plan.rows:,} rows in {plan.partitions} partitions a feed (~"
            f"{plan.feed_seconds:.0f} s), {plan.faults} fault(s) per kind: {', '.join(plan.kinds)}")
    network = None
    linked: DriverProcess | None = None
    if "link" in plan.kinds:
        ok, why = netns.available()
        if not ok:
            result.skipped["link"] = why
        else:
            try:
                network = netns.Network(["broker", "ranks"]).start()
            except netns.NetworkError as exc:      # what it had made is deleted
                result.skipped["link"] = f"the hosts could not be made: {exc}"
    # held by the children: stopping it ends its processes and deletes the namespaces
    held = ctx.children.add(SimpleNamespace(name="fault network", stop=network.close)) if network else None
    if network is not None:
        # its Spark driver starts meanwhile: it runs on the broker's host (only the consumers' link is cut)
        linked = DriverProcess(ctx.children, ctx.work / "faults" / "driver-link", "faults-driver-link", DRIVER,
                               prefix=["ip", "netns", "exec", network.namespace("broker")],
                               env={"SPARKBUS_INSECURE": "1"})
    feeder = DriverProcess(ctx.children, ctx.work / "faults" / "driver", "faults-driver", DRIVER)
    rig: ClusterRig | None = None
    try:
        feeder.ready(120)
        for position, kind in enumerate(plan.kinds):
            if kind in result.skipped:
                continue
            if kind in CLUSTER_KINDS:
                rig = rig or start_rig(ctx, result)
                if rig is not None:
                    cluster_runs(ctx, plan, kind, rng, rig, result)
                    if not any(k in CLUSTER_KINDS and k not in result.skipped for k in plan.kinds[position + 1:]):
                        ctx.children.discard(rig)       # its JVMs are not needed for the kinds left
                        rig = None
            elif kind == "link":
                assert network is not None and linked is not None
                linked.ready(120)
                where = {"network": network, "host": network.address("broker"), "env": {"SPARKBUS_INSECURE": "1"},
                         "broker": ["ip", "netns", "exec", network.namespace("broker")],
                         "ranks": ["ip", "netns", "exec", network.namespace("ranks")]}
                times = fault_times(rng, plan.faults, plan.feed_seconds)
                result.runs.append(one_run(ctx, plan, kind, times, rng, 0, linked, where))
            else:
                times = [] if kind == "none" else fault_times(rng, plan.faults, plan.feed_seconds)
                result.runs.append(one_run(ctx, plan, kind, times, rng, 0, feeder, {}))
    finally:
        feeder.stop()
        if rig is not None:
            ctx.children.discard(rig)
        if linked is not None:
            linked.stop()
        if held is not None:
            ctx.children.discard(held)      # its processes ended, the namespaces deleted
    result.seconds = time.monotonic() - started
    return result


def start_rig(ctx: Context, result: FaultTable) -> ClusterRig | None:
    """The standalone cluster and its driver; None, with the cluster kinds skipped and why, if they cannot start."""
    began = time.monotonic()
    ctx.log(f"  faults: a standalone cluster (Workers on {', '.join(HOSTS)}, one core each) and its driver starting")
    rig = None
    try:
        rig = ClusterRig(ctx.children, ctx.work / "faults" / "cluster")
        rig.ready(180)
    except (BenchError, LaunchError, OSError) as exc:
        if rig is not None:
            ctx.children.discard(rig)
        for kind in CLUSTER_KINDS:
            result.skipped.setdefault(kind, f"the standalone cluster did not start: {str(exc).splitlines()[0][:200]}")
        ctx.log(f"  faults: the standalone cluster did not start: {exc}")
        return None
    ctx.log(f"  faults: the cluster and its driver up, both executors warm, in {time.monotonic() - began:.1f} s")
    return rig


def cluster_runs(ctx: Context, plan: Plan, kind: str, rng: random.Random, rig: ClusterRig,
                 result: FaultTable) -> None:
    """The runs of a cluster kind, into ``result``: the feed reads a DataFrame made in the executors' JVMs.

    An executor killed: one feed with ``plan.faults`` faults (the Master starts a new executor each time). A host
    lost: ``plan.faults`` feeds of one fault each, since a second host lost would leave no executor; its Worker is
    started again before the next feed (of this kind or the next), never during one."""
    where = {"rig": rig, "request": {"source": "dataframe", "width": WIDTH,
                                     "delivery": "atomic" if kind.endswith("_atomic") else "stream"}}
    feeds = plan.faults if kind.startswith("cluster_host") else 1
    for index in range(feeds):
        began = time.monotonic()
        restored = rig.restore()            # a host lost in the feed before: its Worker back
        if restored:
            ctx.log(f"  faults: a Worker started again on {', '.join(restored)}")
        rig.warm()
        ctx.log(f"  faults: both executors registered and warm ({time.monotonic() - began:.1f} s)")
        times = fault_times(rng, 1 if kind.startswith("cluster_host") else plan.faults, plan.feed_seconds)
        run = one_run(ctx, plan, kind, times, rng, index, rig.feeder, where)
        result.runs.append(run)
        if run.held:
            ctx.log(f"  faults: {run.held} Python worker(s) of lost executors still ran after the feed: killed")


class FaultsSection(Section[FaultTable]):
    """Figure 11: rows lost and rows trained twice per fault kind (no target: a report)."""

    name, title, quick = "faults", "11. a fault table", False

    def measure(self, ctx: Context) -> FaultTable:
        plan = plan_of(ctx.quick, min(ctx.sizes.timeout * 2, 120.0))
        return run(ctx, plan, self.name)

    def figures(self, run: Run, result: FaultTable) -> list[Figure]:
        """Per kind of fault measured: the faults injected; the rows yielded, lost, trained twice and dropped to keep
        a group's steps equal, against the rows fed."""
        out = []
        for row in result.rows():
            if "skipped" not in row:
                fed = figure("faults", f"{row['kind']}: rows fed", [row["rows_fed"]], "rows")
                out += [figure("faults", f"{row['kind']}: faults injected", [row["faults"]], "faults"), fed,
                        *(figure("faults", f"{row['kind']}: rows {what}", [row[key]], "rows", fed)
                          for key, what in (("yielded", "yielded"), ("lost", "lost"), ("twice", "trained twice"),
                                            ("dropped", "dropped")))]
        return out

    def json(self, run: Run, result: FaultTable) -> dict:
        return {"faults": {"plan": asdict(result.plan), "table": result.rows(), "skipped": result.skipped,
                           "runs": [asdict(r) for r in result.runs], "seconds": result.seconds}}
