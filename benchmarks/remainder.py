"""Figure 12, the epoch's remainder: what sharing the left-over batches out by rows (``remainder="split"``, the
default) costs at an epoch's end, against dropping them (``"drop"``), in the same run: one broker, ranks as threads
of one process (``BatchStream(rank=, size=)``), a feed without Spark of ``size * 4 + size - 1`` batches (the worst
case). Per rank: the time from the end of its last full step to the end of its epoch; the rows it trained; the
pieces the broker sent at the end and the bytes they carried (each piece is its whole batch's frames).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import zmq

from sparkbus.bench.figures import Figure, figure
from sparkbus.broker.client import ControlClient
from sparkbus.launch.broker import BrokerProcess
from sparkbus.wire.protocol import Kind
from sparkbus.worker import BatchStream

from .common import feed_parts
from .sections import Context, Run, Section

PARTITIONS = 4
FULL_STEPS = 4            # steps every rank takes before the remainder
_streams = itertools.count()


@dataclass
class EndOfEpoch:
    """One epoch's end for one group: per rank, the seconds from its last full step to the epoch's end."""

    end_seconds: list[float]
    rows_trained: int
    rows_fed: int
    pieces: int
    wire_bytes: int           # what the pieces carried: each is its whole batch's frames


def run_group(broker: BrokerProcess, ranks: int, remainder: str, rows: int, row_bytes: int,
              timeout: float = 120.0) -> EndOfEpoch:
    """Feed one epoch of ``ranks * FULL_STEPS + ranks - 1`` batches to ``ranks`` rank threads."""
    stream = f"remainder-{remainder}-{ranks}-{next(_streams)}"
    batches = ranks * FULL_STEPS + ranks - 1
    width = max(row_bytes // 4, 1)
    context = zmq.Context()
    results: dict[int, tuple[list[float], float, int, int]] = {}
    errors: list[BaseException] = []

    def rank_loop(rank: int) -> None:
        try:
            with BatchStream(broker.ranks, rank=rank, size=ranks, stream=stream, context=context,
                             remainder=remainder, prefetch=2, prefetch_bytes=0, timeout=timeout) as s:
                steps = []
                for _ in s.epoch():
                    steps.append(time.perf_counter())
                ended = time.perf_counter()
                ep = s.stats.epochs[-1]
                results[rank] = (steps, ended, ep.batches, ep.rows)
        except BaseException as error:       # reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=rank_loop, args=(r,), daemon=True) for r in range(ranks)]
    for thread in threads:
        thread.start()
    client = ControlClient(broker.control, timeout)
    try:
        feed_parts(client, broker, stream, 0, [[{"id": np.arange(b * rows, (b + 1) * rows, dtype=np.int64),
                                                 "x": np.zeros((rows, width), np.float32)}
                                                for b in range(part, batches, PARTITIONS)]
                                               for part in range(PARTITIONS)], timeout, pack_bytes=0)
        for thread in threads:
            thread.join(timeout)
        figures = client.request(Kind.STATS_REQUEST)
    finally:
        client.close()
        context.term()
    if errors or len(results) != ranks:
        raise RuntimeError(f"{ranks} ranks, remainder {remainder!r}: {errors or 'a rank did not finish'}")
    steps = {count for _, _, count, _ in results.values()}
    if len(steps) != 1:
        raise RuntimeError(f"unequal steps with {ranks} ranks, remainder {remainder!r}: {sorted(steps)}")
    epoch = figures["stats"]["streams"][stream]
    epoch_figures = (epoch["epochs"] or {}).get("0") or epoch["earlier"]
    return EndOfEpoch([ended - times[FULL_STEPS - 1] for times, ended, _, _ in results.values()],
                      sum(r for _, _, _, r in results.values()), batches * rows, int(epoch_figures.get("pieces", 0)),
                      int(epoch_figures.get("pieces", 0)) * int(epoch_figures["bytes_in"]) // batches)


def measure(broker: BrokerProcess, ranks: list[int], repeat: int, rows: int = 64,
            row_bytes: int = 1024) -> dict[int, dict[str, list[EndOfEpoch]]]:
    """Per group size, ``repeat`` runs of each remainder, the anchor (``"drop"``) first."""
    return {n: {mode: [run_group(broker, n, mode, rows, row_bytes) for _ in range(repeat)]
                for mode in ("drop", "split")} for n in ranks}


class RemainderSection(Section[dict]):
    """The epoch's remainder shared out by rows, against dropping it: the epoch's end at 2, 16 and 128 ranks (128
    rank threads: a full run only; ``--only remainder`` runs it with ``--quick``)."""

    name, title, quick = "remainder", "12. the epoch's remainder (no row dropped)", False

    def measure(self, ctx: Context) -> dict:
        ranks = [2, 16] if ctx.quick else [2, 16, 128]
        broker = BrokerProcess(ctx.work / "remainder-broker.log", "--log-level", "WARNING").start()
        try:
            return measure(broker, ranks, ctx.sizes.reps)
        finally:
            broker.stop()

    def figures(self, run: Run, result: dict) -> list[Figure]:
        """Per number of ranks: the time from a rank's last full step to its epoch's end, split against drop; the
        rows trained of those fed, and the pieces and their MB at the end (none with drop)."""
        out = []
        for n, runs in result.items():
            drop = figure("remainder", f"{n} ranks, drop", [statistics.median(r.end_seconds) * 1e3
                                                             for r in runs["drop"]], "ms")
            out += [drop, figure("remainder", f"{n} ranks, split", [statistics.median(r.end_seconds) * 1e3
                                                                    for r in runs["split"]], "ms", drop)]
            split = runs["split"]
            fed = figure("remainder", f"{n} ranks, rows fed", [r.rows_fed for r in split], "rows")
            out += [fed, *(figure("remainder", f"{n} ranks, {mode}, rows trained", [r.rows_trained for r in rs], "rows",
                                  fed) for mode, rs in runs.items()),
                    figure("remainder", f"{n} ranks, split, pieces", [r.pieces for r in split], "pieces"),
                    figure("remainder", f"{n} ranks, split, MB in pieces", [r.wire_bytes / 1e6 for r in split], "MB")]
        return out
