"""Figure 10, soak: hundreds of epochs through one broker (its CLI), a Spark-free feeder (this process) and one rank
(an agent process), the broker's RSS, the size of its status reply and its Prometheus
series recorded at checkpoints (issue 18 §2). A report, not an assertion: they should be flat."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

from sparkbus.bench.agents import Agent
from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.processes import wait_for

from .common import MiB, feed_parts
from .sections import Context, Run, Section

EPOCHS, QUICK_EPOCHS = 1000, 100
PARTITIONS, ROWS, BATCH_ROWS = 2, 2048, 256
KEEP_EPOCHS = 64               # the broker's default --keep-epochs (the checkpoint where its list is full)
STREAM = "soak"


def _sample(broker: Any, epoch: int) -> dict:
    import msgpack
    import psutil

    from sparkbus.broker.client import fetch_stats

    figures = fetch_stats(broker.control, 10.0)
    with urllib.request.urlopen(figures["broker"]["endpoints"]["metrics"], timeout=10) as response:
        lines = response.read().decode().splitlines()
    series = [line for line in lines if line.startswith("sparkbus_")]
    stream = figures["streams"].get(STREAM, {})
    return {"epoch": epoch, "rss_bytes": psutil.Process(broker.pid).memory_info().rss,
            "status_bytes": len(msgpack.packb(figures)), "series": len(series),
            "epochs_listed": len(stream.get("epochs", {})),
            "delivered": stream.get("delivered", 0)}


def _feed_epoch(broker: Any, client: Any, epoch: int, timeout: float) -> None:
    import numpy as np

    def part(first: int) -> Any:
        ids = np.arange(first, first + ROWS, dtype=np.int64)
        return ({"id": ids[i:i + BATCH_ROWS], "x": np.ones((len(ids[i:i + BATCH_ROWS]), 8), np.float32)}
                for i in range(0, ROWS, BATCH_ROWS))

    feed_parts(client, broker, STREAM, epoch, [part((epoch * PARTITIONS + p) * ROWS) for p in range(PARTITIONS)],
               timeout)


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


class SoakSection(Section[list]):
    """Figure 10: a broker's RSS, status size and series count over several hundred epochs (no target)."""

    name, title, quick = "soak", "10. soak, hundreds of epochs", False

    def measure(self, ctx: Context) -> list[dict]:
        """The samples at each checkpoint: the start (10 epochs), the figures' list just full (``--keep-epochs``),
        then every quarter to the end; filled into ``ctx.results`` as they are taken."""
        from sparkbus.broker.client import ControlClient, fetch_stats

        epochs, timeout = QUICK_EPOCHS if ctx.quick else EPOCHS, min(ctx.sizes.timeout, 120.0)
        samples: list[dict] = ctx.results.setdefault(self.name, [])
        checkpoints = {9, KEEP_EPOCHS, *range(epochs // 4 - 1, epochs, max(epochs // 4, 1)), epochs - 1}
        broker = ctx.children.broker("64MiB", 20.0, "--metrics-port", "0", "--heartbeat", "0.2")
        release = ctx.work / "soak-rank.release"
        rank = Agent(soak_rank, broker.ranks, epochs, str(release), timeout)
        try:
            with ControlClient(broker.control, timeout) as client:
                for epoch in range(epochs):
                    _feed_epoch(broker, client, epoch, timeout)
                    if epoch in checkpoints:
                        wait_for(lambda n=epoch + 1: fetch_stats(broker.control, 10.0)["streams"].get(STREAM, {})
                                 .get("delivered", 0) >= n, timeout, f"the soak rank to take {epoch + 1} epochs")
                        time.sleep(0.5)         # the exporter's snapshot is a heartbeat (0.2 s) old at most
                        samples.append(s := _sample(broker, epoch + 1))
                        ctx.log(f"  soak: {s['epoch']} epochs, broker RSS {s['rss_bytes'] / MiB:.1f} MiB, status "
                                f"{s['status_bytes']:,} bytes, {s['series']} series")
            release.write_text("")                  # sampled with the rank still connected: it may leave
            rank.get(timeout, "the soak rank")
        finally:
            rank.stop()
            ctx.children.discard(broker)
        return samples

    def figures(self, run: Run, samples: list[dict]) -> list[Figure]:
        """The broker's RSS, status size and series at the end, against once its list of epochs is full."""
        full = next((s for s in samples if s["epoch"] > KEEP_EPOCHS), samples[0])
        last, out = samples[-1], []
        for key, name, unit, scale in (("rss_bytes", "broker RSS", "MiB", 1 / MiB), ("status_bytes", "status size",
                                       "bytes", 1), ("series", "metric series", "series", 1)):
            anchor = figure("soak", f"{name} at epoch {full['epoch']}", [full[key] * scale], unit)
            out += [anchor, figure("soak", f"{name} at epoch {last['epoch']}", [last[key] * scale], unit, anchor)]
        return out
