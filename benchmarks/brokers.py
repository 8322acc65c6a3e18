"""Figure 5, several brokers: 1, 2 and 4 brokers serving one stream of the cached DataFrame to 2 ranks, which
consume from every broker (``feed(df, [feed_1, ..., feed_n])``, ``BatchStream("ranks_1,...")``); repetitions
interleaved, each first in turn. On one machine the brokers share its cores: not a scaling figure."""

from __future__ import annotations

from sparkbus.bench.e2e import hand_off
from sparkbus.bench.figures import Figure

from . import spark_data
from .end_to_end import RANKS, Series, run_sparkbus
from .sections import Context, Section

BROKERS = (1, 2, 4)


class BrokersSection(Section[list]):
    """Figure 5: rows/s delivered to the ranks over 1, 2 and 4 brokers, against 1 broker (no target)."""

    name, title, spark = "brokers", "5. several brokers", "frame"

    def measure(self, ctx: Context) -> list[Figure]:
        series = {n: Series(f"{n} broker{'s' if n > 1 else ''}") for n in BROKERS}
        started = [ctx.children.broker("256MiB") for _ in range(max(BROKERS))]
        try:
            # Unrecorded: the first full scan of the cache, and the Python workers' first feed (imports), in case
            # no other section has run them yet.
            hand_off(ctx.df)
            spark_data.warm_up_feed(ctx.df, ctx.rows, started[0].feed, "warm-up")
            for rep in range(ctx.sizes.reps):
                for n in BROKERS[rep % len(BROKERS):] + BROKERS[:rep % len(BROKERS)]:     # each first in turn
                    r = run_sparkbus(ctx.children, started[:n], ctx.df, ctx.rows, RANKS, ctx.work, ctx.sizes.timeout)
                    series[n].runs.append(r)
                    ctx.log(f"  brokers rep {rep + 1}/{ctx.sizes.reps}: {n} broker(s), partitions per broker "
                            f"{'/'.join(map(str, r['brokers']))}: {r['rows_per_s']:,.0f} rows/s")
        finally:
            for broker in reversed(started):
                ctx.children.discard(broker)
        one = series[1].figure("brokers", "1 broker", "rows_per_s", "rows/s")
        return [one, *(series[n].figure("brokers", series[n].name, "rows_per_s", "rows/s", one) for n in BROKERS[1:])]
