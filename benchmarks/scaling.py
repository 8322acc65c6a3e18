"""Figure 3, scaling over ranks and feeding tasks (steps granted by the broker, and 4 ranks with their steps agreed
over MPI), against 1 rank fed by as many tasks as partitions; and 3b, the broker's peak RSS while far more than its
``--max-buffer`` flows through it, against its bound."""

from __future__ import annotations

import itertools

from sparkbus.bench.agents import Agent, receiver, sender
from sparkbus.bench.figures import Figure, figure
from sparkbus.broker.client import ControlClient
from sparkbus.launch.broker import BrokerProcess
from sparkbus.wire.protocol import Kind

from . import spark_data
from .common import BenchError, MiB, RssSampler, open_epoch
from .end_to_end import RANKS as BASE_RANKS
from .end_to_end import Series, run_sparkbus
from .sections import Context, Section

RANKS = (1, 2, 4)
TASKS = (1, 2, 4)
RSS_BATCH = 1 * MiB
RSS_FEEDERS = 2
_streams = itertools.count()


class ScalingSection(Section[list]):
    """Figure 3: rows/s of every point (ranks, feeding tasks); repetitions interleaved."""

    name, title, spark = "scaling", "3. scaling over ranks and feeding tasks", "frame"

    def measure(self, ctx: Context) -> list[Figure]:
        base = ctx.sizes.partitions
        points = sorted({(r, base, "broker") for r in RANKS} | {(BASE_RANKS, t, "broker") for t in TASKS}
                        | {(max(RANKS), base, "mpi")})
        series = {p: Series(f"{p[0]} ranks, {p[1]} tasks" + (", steps over MPI" if p[2] == "mpi" else ""))
                  for p in points}
        frames = {t: (ctx.df if t == base else ctx.df.coalesce(t)) for t in TASKS}
        broker = ctx.children.broker("256MiB")
        try:
            spark_data.warm_up_feed(ctx.df, ctx.rows, broker.feed, "warm-up")     # Python workers started first
            for rep in range(ctx.sizes.reps):
                for ranks, tasks, steps in (points if rep % 2 == 0 else points[::-1]):     # none always first
                    s = series[ranks, tasks, steps]
                    s.runs.append(run_sparkbus(ctx.children, broker, frames[tasks], ctx.rows, ranks, ctx.work,
                                               ctx.sizes.timeout, steps=steps))
                    ctx.log(f"  scaling {s.name}: {s.runs[-1]['rows_per_s']:,.0f} rows/s")
        finally:
            ctx.children.discard(broker)
        anchor = series.pop((1, base, "broker")).figure("scaling", f"1 rank, {base} tasks", "rows_per_s", "rows/s")
        return [anchor, *(s.figure("scaling", s.name, "rows_per_s", "rows/s", anchor)
                          for _, s in sorted(series.items()))]


class RssSection(Section[list]):
    """Figure 3b: the broker's peak RSS with ``--max-buffer sizes.rss_max_buffer`` while ``sizes.rss_bytes`` flow
    through, against its bound, ``--max-buffer`` + 100 MiB."""

    name, title = "rss", "3b. broker peak RSS"

    def measure(self, ctx: Context) -> list[Figure]:
        sizes = ctx.sizes
        per_feeder = max(1, sizes.rss_bytes // RSS_BATCH // RSS_FEEDERS)
        timeout = max(60.0, sizes.timeout)
        peaks, through = [], []
        for rep in range(sizes.reps):
            stream = f"rss-{next(_streams)}"
            broker = BrokerProcess(ctx.work / f"{stream}-broker.log", "--max-buffer",
                                   str(sizes.rss_max_buffer)).start(timeout)
            sampler = RssSampler(broker.pid)
            agents: list[Agent] = []
            try:
                with ControlClient(broker.control, timeout) as client:
                    open_epoch(client, stream, 0, RSS_FEEDERS)
                    agents.append(Agent(receiver, "sparkbus", broker.ranks, stream, RSS_BATCH, timeout))
                    agents[0].get(timeout, "the RSS consumer")
                    agents += [Agent(sender, "sparkbus", broker.feed, broker.control, stream, RSS_BATCH, 0.0,
                                     per_feeder, timeout, part) for part in range(RSS_FEEDERS)]
                    sent = sum(a.get(timeout + sizes.rss_bytes / (20 * MiB), "an RSS feeder")["sent"]
                               for a in agents[1:])
                    client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=RSS_FEEDERS)
                got = agents[0].get(timeout, "the RSS consumer")["received"]
            finally:
                peaks.append(sampler.stop() / MiB)
                for agent in agents:
                    agent.stop()
                broker.stop()
            if got != sent:
                raise BenchError(f"RSS run: sent {sent} batches, received {got}")
            through.append(got * RSS_BATCH / MiB)
            ctx.log(f"  broker RSS rep {rep + 1}/{sizes.reps}: {through[-1]:,.0f} MiB through, peak "
                    f"{peaks[-1]:.0f} MiB")
        bound = figure("rss", "bound: --max-buffer + 100 MiB", [sizes.rss_max_buffer / MiB + 100], "MiB")
        return [bound, figure("rss", "broker peak RSS", peaks, "MiB", bound),
                figure("rss", "bytes through", through, "MiB", bound)]
