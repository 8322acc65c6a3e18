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
from pathlib import Path
from typing import Any

import end_to_end
import spark_data
from common import Children, Sizes
from end_to_end import Series

BROKERS = (1, 2, 4)
MAX_BUFFER = "256MiB"


def cores() -> int:
    """Cores this process may run on (what the brokers, Spark and the ranks share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def run(children: Children, df: Any, rows: int, sizes: Sizes, work: Path, log=print) -> dict:
    """``{"series": {brokers: Series}, "cores": n, "ranks": 2, "partitions": p}``; repetitions interleaved."""
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
    return {"series": series, "cores": cores(), "ranks": end_to_end.RANKS,
            "partitions": df.rdd.getNumPartitions()}
