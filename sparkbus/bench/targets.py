"""The targets: the ratio (or value) each figure must reach. The one table, for ``sparkbus bench`` and for the peer
comparisons of ``benchmarks/``; a figure is named by its section and its name, as :class:`figures.Figure` has them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    section: str
    name: str
    of: str              # "ratio": the figure's ratio to its anchor; "value": the figure itself
    goal: float
    what: str
    at_least: bool = True

    def goal_text(self) -> str:
        sign = ">=" if self.at_least else "<="
        return f"{sign} {self.goal:g} x" if self.of == "ratio" else f"{sign} {self.goal:,g}"


TARGETS: tuple[Target, ...] = (
    Target("hop", "sparkbus 64 KiB", "ratio", 0.8, "sparkbus broker throughput at 64 KiB batches vs zmq.proxy"),
    Target("hop", "sparkbus 1 MiB", "ratio", 0.95, "sparkbus broker throughput at 1 MiB batches vs zmq.proxy"),
    Target("hop", "sparkbus 1 KiB batches/s", "value", 100_000,
           "sparkbus broker at 1 KiB batches, delivered to the training loop (batches/s)"),
    Target("e2e", "sparkbus rows/s", "ratio", 0.9, "end to end from the cached DataFrame vs the Arrow hand-off"),
    Target("e2e", "Parquet staging seconds to last batch", "ratio", 2.5,
           "end to end vs Parquet staging: staging's time to the last batch / sparkbus's"),
    Target("e2e", "sparkbus first batch", "ratio", 0.05,
           "end to end: first batch vs Parquet staging's first batch", at_least=False),
)
