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
    Target("hop", "recording why training waits, per 64 KiB batch", "ratio", 0.01,
           "recording why training waits (a timer pair per send and per step) vs the hop's time per 64 KiB batch",
           at_least=False),
    Target("e2e", "sparkbus rows/s", "ratio", 0.9, "end to end from the cached DataFrame vs the Arrow hand-off"),
    Target("e2e", "Parquet staging seconds to last batch", "ratio", 2.5,
           "end to end vs Parquet staging: staging's time to the last batch / sparkbus's"),
    Target("e2e", "sparkbus first batch", "ratio", 0.05,
           "end to end: first batch vs Parquet staging's first batch", at_least=False),
    # the peer comparisons of a source checkout's benchmarks/ (make bench)
    *(Target("scaling", f"4 ranks, 4 tasks{steps}", "ratio", 1.0, f"4 ranks vs 1 rank on one broker, same data{what}")
      for steps, what in (("", ""), (", steps over MPI", ", steps agreed over MPI"))),
    Target("rss", "broker peak RSS", "ratio", 1.0, "broker peak RSS vs --max-buffer + 100 MiB", at_least=False),
    *(Target("wait", f"data-wait, steps {how}", "value", 2.0,
             f"ranks' data-wait (% of the epoch) while the feed outpaces compute, steps {how}", at_least=False)
      for how in ("granted", "agreed over MPI")),
    *(Target("cluster", f"sparkbus {kind}, {size} batches", "ratio", goal,
             f"cluster-shaped end to end, {kind}, {size} batches, vs the Arrow hand-off on the same core")
      for kind in ("fixed", "tokens") for size, goal in (("1 MiB", 0.95), ("64 KiB", 0.9))),
    *(Target("cluster", f"feeder CPU-s per GB above the hand-off, {kind}, 1 MiB batches", "value", 0.45,
             f"feeder CPU-s per GB in Spark's Python workers above the hand-off, {kind}, 1 MiB batches",
             at_least=False) for kind in ("fixed", "tokens")),
    Target("varlen", "binary", "ratio", 0.9, "binary rows of 64 KiB vs the fixed-width path at the same bytes"),
    Target("varlen", "varints", "ratio", 0.8, "variable-length int arrays averaging 64 KiB vs the fixed-width path"),
    Target("varlen", "padding share, bucket_by", "ratio", 0.3,
           "padding share with bucket_by (window 64) vs Spark's order, batches of 64", at_least=False),
    Target("lm", "padding share, batch_tokens + bucket_by", "ratio", 0.3,
           "language-model data: padding share with batch_tokens + bucket_by vs batch_size rows in Spark's order",
           at_least=False),
    Target("lm", "mixture ratio error per window", "value", 0.0,
           "language-model data: a 0.7/0.3 mixture's largest count error per window as the ranks received it (%)",
           at_least=False),
    Target("lm", "sparkbus first batch", "ratio", 0.5,
           "language-model data: first batch at the ranks vs Hugging Face datasets' Dataset.from_spark",
           at_least=False),
    Target("images", "sparkbus images/s", "ratio", 1.5,
           "images/s into decoding ranks vs Parquet staging + DataLoader, to the last image"),
    Target("images", "sparkbus first image", "ratio", 0.05,
           "first decoded image vs Parquet staging + DataLoader", at_least=False),
)
