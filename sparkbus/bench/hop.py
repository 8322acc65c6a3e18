"""The hop: one batch size at a time, a sender process through a broker to a receiver process over loopback TCP,
sparkbus's broker against ``zmq.proxy`` (the C broker, the most a hop can do), both measured in the same run."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .agents import Agent, proxy, receiver, sender
from .figures import Figure, figure

SIZES = (1 << 10, 64 << 10, 1 << 20)
_streams = itertools.count()


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


@dataclass(frozen=True)
class Ends:
    """Where a hop's sender and receiver connect, and the process in the middle (the broker or the proxy)."""

    feed: str
    ranks: str
    control: str
    pid: int | None


@dataclass(frozen=True)
class Variant:
    """The sparkbus hop again at one size with one thing changed, against the plain hop of that size: ``send`` and
    ``receive``, more arguments of the feeder's ``stream_partition`` and of ``BatchStream``; ``broker``, its flags."""

    name: str
    size: int
    send: dict = field(default_factory=dict)
    receive: dict = field(default_factory=dict)
    broker: tuple[str, ...] = ()


def _cpu(pids: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds (user + system) of each process so far; nothing without psutil."""
    try:
        import psutil
    except ImportError:
        return {}
    times = {role: psutil.Process(pid).cpu_times() for role, pid in pids.items() if pid}
    return {role: t.user + t.system for role, t in times.items()}


def _one(way: str, size: int, ends: Ends, seconds: float, timeout: float, send: dict | None = None,
         receive: dict | None = None) -> dict:
    """One run: MB/s, batches/s from the sender's first send to the receiver's last receive, and the CPU-s per GB
    of the sender, the middle and the receiver."""
    from sparkbus.broker.client import ControlClient
    from sparkbus.wire.protocol import Kind

    stream = f"hop-{next(_streams)}"
    rx = Agent(receiver, way, ends.ranks, stream, size, timeout, receive)
    tx = None
    keys = {k: v for k, v in (send or {}).items() if k in ("key", "broker_key")}
    try:
        rx.get(timeout, f"the {way} receiver")
        with ControlClient(ends.control, timeout, **keys) as client:
            if way == "sparkbus":
                client.request(Kind.EPOCH_OPEN, stream=stream, epoch=0, partitions=1, delivery="stream")
            tx = Agent(sender, way, ends.feed, ends.control, stream, size, seconds, 50 if seconds >= 0.5 else 16,
                       timeout, 0, send)
            pids = {"sender": tx.proc.pid, "middle": ends.pid, "receiver": rx.proc.pid}
            cpu = _cpu(pids)
            sent = tx.get(timeout + seconds, f"the {way} sender")
            if way == "sparkbus":
                client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=1)
        got = rx.get(timeout, f"the {way} receiver")
        cpu = {role: used - cpu[role] for role, used in _cpu(pids).items()}
        cpu |= {"sender": sent["cpu"]} if cpu else {}      # the sender's own, without its start-up
    finally:
        for agent in (tx, rx):
            if agent is not None:
                agent.stop()
    if got["received"] != sent["sent"] or not got["last"]:
        raise RuntimeError(f"{way} at {label(size)}: {sent['sent']} batches sent, {got['received']} received")
    seconds_taken, gb = got["last"] - sent["first"], got["received"] * size / 1e9
    return {"mb": gb * 1e3 / seconds_taken, "batches": got["received"] / seconds_taken,
            "cpu": {role: used / gb for role, used in cpu.items()}}


def _cpu_figures(runs: dict[str, list[dict]], size: int) -> list[Figure]:
    """CPU-s per GB of payload in all three processes, sparkbus's against the proxy's; and each of sparkbus's."""
    if not all(r["cpu"] for rs in runs.values() for r in rs):
        return []
    raw = figure("hop", f"zmq.proxy {label(size)} CPU-s per GB", [sum(r["cpu"].values()) for r in runs["zmq.proxy"]],
                 "CPU-s/GB")
    return [raw, figure("hop", f"sparkbus {label(size)} CPU-s per GB", [sum(r["cpu"].values())
                                                                        for r in runs["sparkbus"]], "CPU-s/GB", raw),
            *(figure("hop", f"sparkbus {label(size)} CPU-s per GB, {name}", [r["cpu"][role] for r in runs["sparkbus"]],
                     "CPU-s/GB") for role, name in (("sender", "feeder"), ("middle", "broker"), ("receiver", "rank")))]


def recording_cost(hop: Figure, messages: int = 200_000) -> list[Figure]:
    """What recording why training waits costs per 64 KiB batch against the hop's own time per batch (``hop``, MB/s
    at 64 KiB, of this run). The feed's task times each send and the rank each step: a ``perf_counter`` pair and a
    sum in each process, so a batch pays one pair on each stage of the pipeline; measured as a loop of them less
    the same loop empty."""
    costs = []
    for _ in range(3):
        total, started = 0.0, time.perf_counter()
        for _ in range(messages):
            before = time.perf_counter()
            total += time.perf_counter() - before
        timed = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(messages):
            total += 0.0
        empty = time.perf_counter() - started
        costs.append(max(timed - empty, 1e-9) / messages * 1e6)
    per_batch = figure("hop", "sparkbus 64 KiB, time per batch", [(64 << 10) / r for r in hop.reps], "us")
    return [per_batch, figure("hop", "recording why training waits, per 64 KiB batch", costs, "us", per_batch)]


def _size(size: int, proxied: Ends, brokers: dict[tuple[str, ...], Ends], reps: int, seconds: float,
          timeout: float, variants: Sequence[Variant], smallest: int) -> list[Figure]:
    """The figures of one size: repetitions interleave the two ways, each variant after them."""
    runs: dict[str, list[dict]] = {"zmq.proxy": [], "sparkbus": []}
    extra: dict[str, list[dict]] = {v.name: [] for v in variants}
    for rep in range(reps):
        for way in (("zmq.proxy", "sparkbus") if rep % 2 == 0 else ("sparkbus", "zmq.proxy")):
            runs[way].append(_one(way.split(".")[0], size, proxied if way == "zmq.proxy" else brokers[()], seconds,
                                  timeout))
        for v in variants:
            extra[v.name].append(_one("sparkbus", size, brokers[v.broker], seconds, timeout, v.send, v.receive))
    raw = figure("hop", f"zmq.proxy {label(size)}", [r["mb"] for r in runs["zmq.proxy"]], "MB/s")
    ours = figure("hop", f"sparkbus {label(size)}", [r["mb"] for r in runs["sparkbus"]], "MB/s", raw)
    figures = [raw, ours]
    if size == 64 << 10:
        figures += recording_cost(ours)
    if size == 1 << 20:
        figures += _cpu_figures(runs, size)
    if size == smallest:
        raw_b = figure("hop", f"zmq.proxy {label(size)} batches/s", [r["batches"] for r in runs["zmq.proxy"]],
                       "batches/s")
        figures += [raw_b, figure("hop", f"sparkbus {label(size)} batches/s", [r["batches"] for r in runs["sparkbus"]],
                                  "batches/s", raw_b)]
    return figures + [figure("hop", f"{name} {label(size)}", [r["mb"] for r in done], "MB/s", ours)
                      for name, done in extra.items()]


def measure(work: Path, reps: int, seconds: float, timeout: float = 60.0, sizes: Sequence[int] = SIZES,
            variants: Sequence[Variant] = ()) -> list[Figure]:
    """Per size, the MB/s of ``zmq.proxy`` (the anchor, a process of its own per size) and of sparkbus (and its
    ratio); at the smallest size also the batches/s delivered to the training loop; at 1 MiB the CPU-s per GB; then
    each of ``variants`` against the plain hop of its size. Repetitions interleave the ways."""
    from sparkbus.launch.broker import BrokerProcess

    started: list[BrokerProcess] = []
    brokers: dict[tuple[str, ...], Ends] = {}
    figures: list[Figure] = []
    try:
        for flags in dict.fromkeys([(), *(v.broker for v in variants)]):
            broker = BrokerProcess(work / f"hop-broker-{len(started)}.log", "--max-buffer", "256MiB", *flags)
            started.append(broker.start(timeout))
            brokers[flags] = Ends(broker.feed, broker.ranks, broker.control, broker.pid)
        for size in sizes:
            anchor = Agent(proxy, size)
            try:
                ends = anchor.get(timeout, "zmq.proxy")
                proxied = Ends(ends["front"], ends["back"], brokers[()].control, anchor.proc.pid)
                mine = [v for v in variants if v.size == size]
                figures += _size(size, proxied, brokers, reps, seconds, timeout, mine, min(sizes))
            finally:
                anchor.stop()
    finally:
        for broker in started:
            broker.stop()
    return figures
