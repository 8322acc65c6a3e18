"""Figure 10, soak: hundreds of epochs through one broker (its CLI), a Spark-free feeder (this process) and one rank
(an agent process), the broker's RSS, the size of its status reply and its Prometheus
series recorded at checkpoints (issue 18 §2). A report, not an assertion: they should be flat."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkbus.bench.agents import Agent
from sparkbus.bench.figures import Figure, figure

from .common import BenchError, Children, KiB, MiB, open_epoch
from .sections import Context, Run, Section

EPOCHS, QUICK_EPOCHS = 1000, 100
PARTITIONS, ROWS, BATCH_ROWS = 2, 2048, 256
KEEP_EPOCHS = 64               # the broker's default --keep-epochs (the checkpoint where its list is full)
STREAM = "soak"


@dataclass
class Soak:
    epochs: int
    rows_per_epoch: int
    samples: list[dict] = field(default_factory=list)    # per checkpoint: epoch, rss_bytes, status_bytes, series
    seconds: float = 0.0
    rows_consumed: int = 0

    @property
    def first(self) -> dict:
        return self.samples[0]

    @property
    def last(self) -> dict:
        return self.samples[-1]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * KiB
    raise BenchError(f"no VmRSS for pid {pid}")


def _sample(broker: Any, epoch: int) -> dict:
    import msgpack

    from sparkbus.broker.client import fetch_stats

    figures = fetch_stats(broker.control, 10.0)
    with urllib.request.urlopen(figures["broker"]["endpoints"]["metrics"], timeout=10) as response:
        lines = response.read().decode().splitlines()
    series = [line for line in lines if line.startswith("sparkbus_")]
    stream = figures["streams"].get(STREAM, {})
    return {"epoch": epoch, "rss_bytes": _rss(broker.pid), "status_bytes": len(msgpack.packb(figures)),
            "series": len(series), "epochs_listed": len(stream.get("epochs", {})),
            "delivered": stream.get("delivered", 0)}


def _feed_epoch(broker: Any, client: Any, epoch: int, timeout: float) -> None:
    import numpy as np

    from sparkbus.feeder.task import stream_partition
    from sparkbus.wire.protocol import Kind

    open_epoch(client, STREAM, epoch, PARTITIONS)
    for part in range(PARTITIONS):
        first = (epoch * PARTITIONS + part) * ROWS
        ids = np.arange(first, first + ROWS, dtype=np.int64)
        batches = ({"id": ids[i:i + BATCH_ROWS], "x": np.ones((len(ids[i:i + BATCH_ROWS]), 8), np.float32)}
                   for i in range(0, ROWS, BATCH_ROWS))
        stream_partition(batches, broker.feed, broker.control, STREAM, epoch, part, 0, timeout)
    client.request(Kind.EPOCH_CLOSE, stream=STREAM, epoch=epoch, partitions=PARTITIONS)


def run(children: Children, epochs: int, work: Path, timeout: float, log=print) -> Soak:
    from sparkbus.broker.client import ControlClient

    result = Soak(epochs, PARTITIONS * ROWS)
    # the start (10 epochs), the figures' list just full (--keep-epochs), then every quarter to the end
    checkpoints = sorted({9, KEEP_EPOCHS, *range(epochs // 4 - 1, epochs, max(epochs // 4, 1)), epochs - 1})
    checkpoints = [c for c in checkpoints if c < epochs]
    broker = children.broker("64MiB", 20.0, "--metrics-port", "0", "--heartbeat", "0.2")
    release = work / "soak-rank.release"
    rank = Agent(soak_rank, broker.ranks, epochs, str(release), timeout)
    started = time.monotonic()
    try:
        with ControlClient(broker.control, timeout) as client:
            for epoch in range(epochs):
                _feed_epoch(broker, client, epoch, timeout)
                if epoch in checkpoints:
                    _wait_delivered(broker, epoch + 1, timeout)
                    time.sleep(0.5)         # the exporter's snapshot is a heartbeat (0.2 s) old at most
                    result.samples.append(_sample(broker, epoch + 1))
                    s = result.last
                    log(f"  soak: {s['epoch']} epochs, broker RSS {s['rss_bytes'] / MiB:.1f} MiB, status "
                        f"{s['status_bytes']:,} bytes, {s['series']} series")
        release.write_text("")                  # sampled with the rank still connected: it may leave
        result.rows_consumed = rank.get(timeout, "the soak rank")
    finally:
        rank.stop()
        children.discard(broker)
    result.seconds = time.monotonic() - started
    return result


def _wait_delivered(broker: Any, epochs: int, timeout: float) -> None:
    from sparkbus.broker.client import fetch_stats

    deadline = time.monotonic() + timeout
    while fetch_stats(broker.control, 10.0)["streams"].get(STREAM, {}).get("delivered", 0) < epochs:
        if time.monotonic() > deadline:
            raise BenchError(f"the soak rank did not take {epochs} epochs within {timeout:g} s")
        time.sleep(0.05)


def soak_rank(report: Any, ranks: str, epochs: int, release: str, timeout: float) -> None:
    """The rank (an agent process): every epoch of the stream; reports the rows it took once ``release`` exists
    (the broker is sampled with the rank still connected)."""
    from sparkbus.worker import BatchStream

    rows = 0
    with BatchStream(ranks, stream=STREAM, timeout=timeout) as stream:
        for _ in range(epochs):
            rows += sum(len(batch["id"]) for batch in stream.epoch())
        deadline = time.monotonic() + timeout
        while not Path(release).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    report(rows)


class SoakSection(Section[Soak]):
    """Figure 10: a broker's RSS, status size and series count over several hundred epochs (no target)."""

    name, title, figure = "soak", "10. soak, hundreds of epochs", "10"
    quick = False

    def measure(self, ctx: Context) -> Soak:
        epochs = QUICK_EPOCHS if ctx.sizes.name.startswith("quick") else EPOCHS
        return run(ctx.children, epochs, ctx.work, min(ctx.sizes.timeout, 120.0), ctx.log)

    def figures(self, run: Run, result: Soak) -> list[Figure]:
        """The broker's RSS, status size and series at the end, against once its list of epochs is full."""
        full = next((s for s in result.samples if s["epoch"] > KEEP_EPOCHS), result.first)
        last, out = result.samples[-1], []
        for key, name, unit, scale in (("rss_bytes", "broker RSS", "MiB", 1 / MiB), ("status_bytes", "status size",
                                       "bytes", 1), ("series", "metric series", "series", 1)):
            anchor = figure("soak", f"{name} at epoch {full['epoch']}", [full[key] * scale], unit)
            out += [anchor, figure("soak", f"{name} at epoch {last['epoch']}", [last[key] * scale], unit, anchor)]
        return out

