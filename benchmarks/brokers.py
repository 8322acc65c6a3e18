"""Figure 5, several brokers: 1, 2 and 4 brokers serving one stream of the cached DataFrame to 2 ranks, which
consume from every broker (``feed(df, [feed_1, ..., feed_n])``, ``BatchStream("ranks_1,...")``); repetitions
interleaved, each first in turn. On one machine the brokers share its cores: not a scaling figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparkbus.bench.e2e import hand_off
from sparkbus.bench.figures import Figure

from . import end_to_end, spark_data
from .common import Children, Sizes
from .end_to_end import Series
from .sections import Context, Section

BROKERS = (1, 2, 4)
MAX_BUFFER = "256MiB"


def run(children: Children, df: Any, rows: int, sizes: Sizes, work: Path, log=print) -> list[Figure]:
    """Rows/s delivered to the ranks over 1, 2 and 4 brokers, against 1 broker; repetitions interleaved."""
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
                    f"{'/'.join(map(str, r['brokers']))}: {r['rows_per_s']:,.0f} rows/s")
    finally:
        for broker in reversed(started):
            children.discard(broker)
    one = series[1].figure("brokers", "1 broker", "rows_per_s", "rows/s")
    return [one, *(series[n].figure("brokers", series[n].name, "rows_per_s", "rows/s", one) for n in BROKERS[1:])]


class BrokersSection(Section[list]):
    """Figure 5: 1, 2 and 4 brokers serving one stream (no target: it compares set-ups)."""

    name, title, spark = "brokers", "5. several brokers", "frame"

    def measure(self, ctx: Context) -> list:
        return run(ctx.children, ctx.df, ctx.rows, ctx.sizes, ctx.work, ctx.log)
