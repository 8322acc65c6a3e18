"""Figure 5, several brokers: 1, 2 and 4 brokers serving one stream of the same cached DataFrame to 2 ranks.

``feeder.feed(df, [feed_1, ..., feed_n])`` spreads the DataFrame's partitions over the brokers (each partition
streams through one of them) and ``mpiexec -n 2 rank_consumer.py --ranks ranks_1,...,ranks_n`` ranks consume
from every broker (``BatchStream`` with a comma-separated address list); an epoch ends when every broker has
ended it. The figure is the aggregate rate: all rows / time from the call of ``feed`` to the last batch at any
rank, as in the end-to-end section (the 1-broker point is that run again, not reused, so that all three points
are measured the same way; repetitions interleave the three, each of them first in turn).

The brokers are started once for the section and each run uses a new stream. On a machine with fewer cores than
processes (the brokers, Spark's JVM and its Python workers, the ranks), more brokers bring no more CPU, so this is
not a scaling figure: it shows what spreading one stream over several broker processes costs or saves on one
machine. The table prints the core count beside the figures for that reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import end_to_end, spark_data
from .common import Children, Sizes
from .end_to_end import Series
from .report import num, table
from .sections import Context, Run, Section
from .spark_data import ROW_BYTES

BROKERS = (1, 2, 4)
MAX_BUFFER = "256MiB"


@dataclass
class Brokers:
    """Figure 5: the repetitions per number of brokers, and what they shared."""

    series: dict[int, Series]       # brokers -> repetitions
    cores: int
    ranks: int
    partitions: int


def cores() -> int:
    """Cores this process may run on (what the brokers, Spark and the ranks share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(children: Children, df: Any, rows: int, sizes: Sizes, work: Path, log=print) -> Brokers:
    """The runs of 1, 2 and 4 brokers; repetitions interleaved."""
    series = {n: Series(f"{n} broker{'s' if n > 1 else ''}") for n in BROKERS}
    started = [children.broker(MAX_BUFFER) for _ in range(max(BROKERS))]
    try:
        # Unrecorded: the first full scan of the cache, and the Python workers' first feed (imports), in case no
        # other section has run them yet.
        spark_data.arrow_limit(df)
        end_to_end.warm_up_feed(df, started[0])
        for rep in range(sizes.reps):
            for n in BROKERS[rep % len(BROKERS):] + BROKERS[:rep % len(BROKERS)]:     # each first in turn
                series[n].runs.append(end_to_end.run_sparkbus(children, started[:n], df, rows, end_to_end.RANKS,
                                                              work, sizes.timeout))
                r = series[n].runs[-1]
                log(f"  brokers rep {rep + 1}/{sizes.reps}: {n} broker(s), partitions per broker "
                    f"{'/'.join(map(str, r['brokers']))}: {r['rows_per_s']:,.0f} rows/s, first batch "
                    f"{r['first']:.2f} s, last {r['last']:.2f} s ({cores()} cores)")
    finally:
        for broker in reversed(started):
            children.discard(broker)
    return Brokers(series, cores(), end_to_end.RANKS, df.rdd.getNumPartitions())


# ---- the section ------------------------------------------------------------------------------------------

class BrokersSection(Section[Brokers]):
    """Figure 5: 1, 2 and 4 brokers serving one stream (no target: it compares set-ups)."""

    name, title, figure, spark = "brokers", "5. several brokers", "5", "frame"

    def measure(self, ctx: Context) -> Brokers:
        assert ctx.dataset is not None
        return run(ctx.children, ctx.df, ctx.dataset.rows, ctx.sizes, ctx.work, ctx.log)

    def markdown(self, run: Run, result: Brokers) -> list[str]:
        b, series = result, result.series
        one = series[1].med("rows_per_s") if 1 in series else float("nan")
        cores = b.cores
        parts = ["", "## 5. Several brokers for one stream", "",
                 f"The cached DataFrame of section 2 ({run.dataset.rows if run.dataset else 0:,} rows, "
                 f"{b.partitions} partitions, Spark local[2]) fed by `feeder.feed(df, [feed_1, ..., feed_n])`, which "
                 f"spreads its partitions over the brokers, to {b.ranks} ranks that each consume from every broker "
                 "(`BatchStream(\"ranks_1,...,ranks_n\")`). rows/s = all rows / time from the call of `feed` to the "
                 "last batch at any rank: the aggregate delivered to the ranks.", ""]
        rows = []
        for n, s in sorted(series.items()):
            shares = s.runs[-1].get("brokers") if s.runs else None
            rows.append([str(n), "/".join(map(str, shares)) if shares else "-", num(s.med("rows_per_s")),
                         num(s.med("rows_per_s") * ROW_BYTES / 1e6), num(s.med("first"), ".2f"),
                         num(s.med("last"), ".2f"),
                         num(s.med("wait_share") * 100, ".0f"), num(s.med("rows_per_s") / one, ".2f"), str(cores)])
        parts.append(table(["brokers", "partitions per broker", "rows/s", "MB/s", "first batch (s)", "last batch (s)",
                             "ranks idle (% of epoch)", "vs 1 broker", "cores on this machine"], rows))
        ratios = ", ".join(f"{n} brokers {s.med('rows_per_s') / one:.2f} x" for n, s in sorted(series.items()) if n > 1)
        parts += ["", f"**What this shows on {cores} cores** (here: {ratios} the rows/s of 1 broker): the brokers, "
                  f"Spark's JVM and its Python workers, and the ranks all share the same {cores} cores, so a second or "
                  "fourth broker brings no CPU of its own and this is not a scaling figure. It shows what spreading "
                  "one stream over several broker processes costs or saves on one machine: each broker is one Python "
                  "thread, so several overlap their per-batch work and their waits for credits (a gain where one "
                  "broker's loop, not the CPU, sets the pace), and they add processes, sockets and context switches (a "
                  "loss where the cores are saturated). On a machine shared with other work, more processes also take "
                  "a larger share of its CPU, which flatters the figure. Brokers scale out when each has cores and a "
                  "network link of its own, on other hosts."]
        return parts

    def json(self, run: Run, result: Brokers) -> dict:
        return {"brokers": {"cores": result.cores, "ranks": result.ranks, "partitions": result.partitions,
                            "runs": {str(n): s.runs for n, s in sorted(result.series.items())}}}

    def plots(self, result: Brokers) -> bool:
        return True

    def plot(self, ax, run: Run, result: Brokers) -> None:
        items = sorted(result.series.items())
        ax.bar([str(n) for n, _ in items], [s.med("rows_per_s") / 1e3 for _, s in items], color="#2ca02c")
        ax.set_xlabel("brokers serving the stream")
        ax.set_ylabel("thousand rows/s to the ranks")
        ax.set_title(f"Several brokers, {result.ranks} ranks, on {result.cores} cores")
