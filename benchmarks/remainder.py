"""The epoch's remainder: what sharing the left-over batches out by rows (``remainder="split"``, the default) costs
at an epoch's end, against dropping them (``"drop"``, sparkbus 0.2's rule), measured in the same run.

One broker (its CLI), ranks as threads of one process (``BatchStream(rank=, size=)``, one ZeroMQ context), a feed
without Spark (``stream_partition``) of ``size * 4 + size - 1`` batches: the worst case, ``size - 1`` left over.
Per rank: the time from the end of its last full step (step ``share``) to the end of its epoch, the last step
included; the rows it trained; the pieces the broker sent at the end and the bytes they carried (each piece is its
whole batch's frames, cut by the rank). Printed per group size as ratios split / drop.

    sparkbus bench --only remainder          (a section of the benchmark; --quick: 2 and 16 ranks)
    python -m benchmarks.remainder [--ranks 2 16 128] [--rows 64] [--row-bytes 1024]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from sparkbus.bench.figures import Figure, figure
from sparkbus.broker.client import ControlClient
from sparkbus.feeder.task import stream_partition
from sparkbus.launch.broker import BrokerProcess
from sparkbus.wire.protocol import Kind
from sparkbus.worker import BatchStream

from .sections import Context, Run, Section, Table

PARTITIONS = 4
FULL_STEPS = 4            # steps every rank takes before the remainder
_streams = itertools.count()


@dataclass
class EndOfEpoch:
    """One epoch's end for one group: per rank, the seconds from its last full step to the epoch's end."""

    ranks: int
    remainder: str
    end_seconds: list[float]
    rows_trained: int
    rows_fed: int
    steps: int
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
        client.request(Kind.EPOCH_OPEN, stream=stream, epoch=0, partitions=PARTITIONS, delivery="stream")
        for part in range(PARTITIONS):
            mine = range(part, batches, PARTITIONS)
            data = [{"id": np.arange(b * rows, (b + 1) * rows, dtype=np.int64),
                     "x": np.zeros((rows, width), np.float32)} for b in mine]
            stream_partition(data, broker.feed, broker.control, stream, 0, part, 0, timeout, pack_bytes=0)
        client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=PARTITIONS)
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
    return EndOfEpoch(ranks, remainder, [ended - times[FULL_STEPS - 1] for times, ended, _, _ in results.values()],
                      sum(r for _, _, _, r in results.values()), batches * rows, steps.pop(),
                      int(epoch_figures.get("pieces", 0)),
                      int(epoch_figures.get("pieces", 0)) * int(epoch_figures["bytes_in"]) // batches)


def measure(broker: BrokerProcess, ranks: list[int], repeat: int, rows: int = 64,
            row_bytes: int = 1024) -> dict[int, dict[str, list[EndOfEpoch]]]:
    """Per group size, ``repeat`` runs of each remainder, the anchor (``"drop"``) first."""
    return {n: {mode: [run_group(broker, n, mode, rows, row_bytes) for _ in range(repeat)]
                for mode in ("drop", "split")} for n in ranks}


def _median_end(runs: list[EndOfEpoch]) -> float:
    return statistics.median(statistics.median(r.end_seconds) for r in runs)


class RemainderSection(Section[dict]):
    """The epoch's remainder shared out by rows, against dropping it: the epoch's end at 2, 16 and 128 ranks."""

    name, title, figure = "remainder", "12. the epoch's remainder (no row dropped)", "12"
    quick = False          # 128 rank threads: a full run only (`--only remainder` runs it with --quick)

    def measure(self, ctx: Context) -> dict:
        ranks = [2, 16] if ctx.args.quick else [2, 16, 128]
        broker = BrokerProcess(ctx.work / "remainder-broker.log", "--log-level", "WARNING").start()
        try:
            return measure(broker, ranks, ctx.sizes.reps)
        finally:
            broker.stop()

    def figures(self, run: Run, result: dict) -> list[Figure]:
        """Per number of ranks: the time from a rank's last full step to its epoch's end, split against drop."""
        out = []
        for n, runs in result.items():
            drop = figure("remainder", f"{n} ranks, drop", [statistics.median(r.end_seconds) * 1e3
                                                             for r in runs["drop"]], "ms")
            out += [drop, figure("remainder", f"{n} ranks, split", [statistics.median(r.end_seconds) * 1e3
                                                                    for r in runs["split"]], "ms", drop)]
        return out

    def tables(self, run: Run, result: dict) -> list[Table]:
        rows = []
        for n, runs in result.items():
            anchor = _median_end(runs["drop"])
            for mode in ("drop", "split"):
                last = runs[mode][-1]
                rows.append([n, mode, last.steps, f"{last.rows_trained:,} / {last.rows_fed:,}",
                             _median_end(runs[mode]) * 1e3, last.pieces, last.wire_bytes / 1e6,
                             _median_end(runs[mode]) / anchor])
        return [Table(f"The epoch's end, {FULL_STEPS} full steps a rank and size - 1 batches of 64 rows left over: "
                      "from a rank's last full step to its epoch's end", ["ranks", "remainder", "steps",
                      "rows trained / fed", "end ms (median)", "pieces", "MB in pieces", "end / drop's"], rows,
                      ["drop: sparkbus 0.2's rule, the anchor measured in the same run"])]

    def json(self, run: Run, result: dict) -> dict:
        return {"remainder": {str(n): {mode: [{"end_seconds": r.end_seconds, "rows_trained": r.rows_trained,
                                                "rows_fed": r.rows_fed, "steps": r.steps, "pieces": r.pieces}
                                               for r in rs] for mode, rs in runs.items()}
                              for n, runs in result.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remainder", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 16, 128])
    parser.add_argument("--rows", type=int, default=64, help="rows per batch (default 64)")
    parser.add_argument("--row-bytes", type=int, default=1024, help="bytes per row (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (default 3; the median is shown)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        broker = BrokerProcess(Path(tmp) / "broker.log", "--log-level", "WARNING").start()
        try:
            print(f"{'ranks':>5} {'remainder':>9} {'steps':>5} {'rows trained/fed':>17} {'end ms (median)':>15} "
                  f"{'end ms (max)':>12} {'pieces':>6} {'MB in pieces':>12} {'end split/drop':>14}")
            for ranks, runs in measure(broker, args.ranks, args.repeat, args.rows, args.row_bytes).items():
                medians = {mode: _median_end(rs) for mode, rs in runs.items()}
                for mode, rs in runs.items():
                    last = rs[-1]
                    ratio = f"{medians['split'] / medians['drop']:.2f}x" if mode == "split" else "anchor"
                    print(f"{ranks:>5} {mode:>9} {last.steps:>5} {last.rows_trained:>8}/{last.rows_fed:<8} "
                          f"{medians[mode] * 1e3:>15.1f} "
                          f"{statistics.median(max(r.end_seconds) for r in rs) * 1e3:>12.1f} "
                          f"{last.pieces:>6} {last.wire_bytes / 1e6:>12.2f} {ratio:>14}")
        finally:
            broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
