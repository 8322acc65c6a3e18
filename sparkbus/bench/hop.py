"""The hop: one batch size at a time, a sender process through a broker to a receiver process over loopback TCP,
sparkbus's broker against ``zmq.proxy`` (the C broker, the most a hop can do), both measured in the same run."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path

from .agents import Agent, proxy, receiver, sender
from .figures import Figure, figure

SIZES = (1 << 10, 64 << 10, 1 << 20)
_streams = itertools.count()


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def _one(way: str, size: int, feed: str, ranks: str, control: str, seconds: float, timeout: float) -> dict:
    """One run: (MB/s, batches/s) from the sender's first send to the receiver's last receive."""
    from sparkbus.broker.client import ControlClient
    from sparkbus.wire.protocol import Kind

    stream = f"hop-{next(_streams)}"
    rx = Agent(receiver, way, ranks, stream, size, timeout)
    tx = None
    try:
        rx.get(timeout, f"the {way} receiver")
        with ControlClient(control, timeout) as client:
            if way == "sparkbus":
                client.request(Kind.EPOCH_OPEN, stream=stream, epoch=0, partitions=1, delivery="stream")
            tx = Agent(sender, way, feed, control, stream, size, seconds, 50 if seconds >= 0.5 else 16, timeout)
            sent = tx.get(timeout + seconds, f"the {way} sender")
            if way == "sparkbus":
                client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=1)
        got = rx.get(timeout, f"the {way} receiver")
    finally:
        for agent in (tx, rx):
            if agent is not None:
                agent.stop()
    if got["received"] != sent["sent"] or not got["last"]:
        raise RuntimeError(f"{way} at {label(size)}: {sent['sent']} batches sent, {got['received']} received")
    seconds_taken = got["last"] - sent["first"]
    return {"mb": got["received"] * size / seconds_taken / 1e6, "batches": got["received"] / seconds_taken}


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


def measure(work: Path, reps: int, seconds: float, timeout: float = 60.0,
            sizes: Sequence[int] = SIZES) -> list[Figure]:
    """Per size, the MB/s of ``zmq.proxy`` (the anchor) and of sparkbus (and its ratio); at the smallest size also
    the batches/s delivered to the training loop. Repetitions interleave the two ways."""
    from sparkbus.launch.broker import BrokerProcess

    broker = BrokerProcess(work / "hop-broker.log", "--max-buffer", "256MiB")
    anchor = Agent(proxy)
    figures: list[Figure] = []
    try:
        ends = anchor.get(timeout, "zmq.proxy")
        broker.start(timeout)
        for size in sizes:
            runs: dict[str, list[dict]] = {"zmq.proxy": [], "sparkbus": []}
            for rep in range(reps):
                for way in (("zmq.proxy", "sparkbus") if rep % 2 == 0 else ("sparkbus", "zmq.proxy")):
                    if way == "zmq.proxy":
                        runs[way].append(_one("zmq", size, ends["front"], ends["back"], broker.control, seconds,
                                              timeout))
                    else:
                        runs[way].append(_one("sparkbus", size, broker.feed, broker.ranks, broker.control, seconds,
                                              timeout))
            raw = figure("hop", f"zmq.proxy {label(size)}", [r["mb"] for r in runs["zmq.proxy"]], "MB/s")
            ours = figure("hop", f"sparkbus {label(size)}", [r["mb"] for r in runs["sparkbus"]], "MB/s", raw)
            figures += [raw, ours]
            if size == 64 << 10:
                figures += recording_cost(ours)
            if size == min(sizes):
                raw_b = figure("hop", f"zmq.proxy {label(size)} batches/s",
                               [r["batches"] for r in runs["zmq.proxy"]], "batches/s")
                figures += [raw_b, figure("hop", f"sparkbus {label(size)} batches/s",
                                          [r["batches"] for r in runs["sparkbus"]], "batches/s", raw_b)]
    finally:
        broker.stop()
        anchor.stop()
    return figures
