"""Figure 5, several brokers: 1, 2 and 4 brokers serving one stream of the cached DataFrame to 2 ranks, which
consume from every broker (``feed(df, [feed_1, ..., feed_n])``, ``BatchStream("ranks_1,...")``); repetitions
interleaved, each first in turn. On one machine the brokers share its cores: not a scaling figure."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkbus.bench.e2e import hand_off
from sparkbus.bench.figures import Figure

from . import end_to_end, spark_data
from .common import Children, Sizes
from .end_to_end import Series
from .sections import Context, Run, Section

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
        hand_off(df)
        spark_data.warm_up_feed(df, rows, started[0].feed, "warm-up")
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
        return run(ctx.children, ctx.df, ctx.rows, ctx.sizes, ctx.work, ctx.log)

    def figures(self, run: Run, result: Brokers) -> list[Figure]:
        """Rows/s delivered to the ranks over n brokers, against 1 broker."""
        one = result.series.get(1)
        anchor = one.figure("brokers", "1 broker", "rows_per_s", "rows/s") if one and one.runs else None
        return ([anchor] if anchor else []) + [s.figure("brokers", f"{n} brokers", "rows_per_s", "rows/s", anchor)
                                               for n, s in sorted(result.series.items()) if s is not one and s.runs]
