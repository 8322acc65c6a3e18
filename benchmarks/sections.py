"""What a section of the benchmark is: one figure that measures and judges its results, and lays them out as tables.

``bench.py`` runs the sections it is given, in order, each with a :class:`Context`; every section's figures are
records (``sparkbus.bench.figures.Figure``, written as JSON lines, judged against ``sparkbus.bench.targets``);
``report.py`` renders them with the section's :class:`Table` records as Markdown, JSON and a plot. A
section's result is a typed record of its own, kept in :attr:`Run.results` under the section's name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from sparkbus.bench.figures import Figure

from .common import Children, Sizes

R = TypeVar("R")


@dataclass
class Table:
    """One table of a figure. Cells: ``str``, ``int``, ``float`` (``report.cell`` formats them) or None (``-``).

    ``plot``: the columns drawn against the first one as a panel of ``throughput.png`` (``log``: on a log axis).
    """

    title: str
    header: list[str]
    rows: list[list[Any]]
    notes: list[str] = field(default_factory=list)
    plot: tuple[str, ...] = ()
    log: bool = False


def per(value: float, anchor: float) -> float:
    """``value / anchor``, NaN where the anchor is 0 (a ratio the report prints as ``-``)."""
    return value / anchor if anchor else math.nan


@dataclass
class Dataset:
    """The cached DataFrame of sections 2-5: its size and how Spark stores it."""

    rows: int
    partitions: int
    payload_bytes: int
    build_seconds: float
    cached_memory_bytes: int = 0
    cached_disk_bytes: int = 0

    @classmethod
    def of(cls, info: dict[str, Any]) -> Dataset:
        return cls(**{k: info.get(k, 0) for k in cls.__dataclass_fields__})


@dataclass
class Context:
    """What :meth:`Section.measure` is given: the run's children and sizes, Spark, and the results so far."""

    children: Children
    sizes: Sizes
    work: Path
    log: Callable[[str], None]
    args: argparse.Namespace
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    spark: Any = None                     # the benchmark's local[2] SparkSession, if a section needs one
    df: Any = None                        # the cached DataFrame of sections 2-5, if a section needs it
    dataset: Dataset | None = None
    session_seconds: float | None = None  # the session's start-up, where it overlapped other sections


@dataclass
class Run:
    """One run of the benchmark: the machine, each section's result, the targets and notes."""

    sizes: Sizes
    machine: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    dataset: Dataset | None = None
    seconds: float = 0.0
    figures: list[Figure] = field(default_factory=list)      # every section's, as recorded (figures.jsonl)

    @property
    def quick(self) -> bool:
        return self.sizes.name.startswith("quick")


class Section(Generic[R]):
    """A figure of the benchmark. Subclasses set the class attributes and implement the methods they need.

    Attributes:
        name: the key of ``--only`` and of :attr:`Run.results`.
        title: the heading of its log line, e.g. ``"1. broker hop"``.
        figure: its place in the report (the targets, the Markdown and the plot panels are sorted by it).
        spark: ``""`` (no Spark), ``"session"`` (the benchmark's local[2] session) or ``"frame"`` (also the cached
            DataFrame of sections 2-5).
        quick: whether ``--quick`` runs it by default.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    figure: ClassVar[str]
    spark: ClassVar[str] = ""
    quick: ClassVar[bool] = True

    def needs(self, args: argparse.Namespace) -> str:
        """What it needs of Spark in a run with these flags (default: :attr:`spark`)."""
        return self.spark

    def measure(self, ctx: Context) -> R:
        """Measure the figure and return its record. A section whose record fills as it goes (cluster, varlen,
        spark) puts it in ``ctx.results`` first, so that a failure part-way still reports what was measured."""
        raise NotImplementedError

    def figures(self, run: Run, result: R) -> list[Figure]:
        """Its figures as records (one JSON line each), each with the anchor measured beside it; the targets
        (sparkbus/bench/targets.py) are judged on these."""
        return []

    def tables(self, run: Run, result: R) -> list[Table]:
        """Its part of the report: each figure beside the anchor it is a ratio of, measured in the same run."""
        return []

    def json(self, run: Run, result: R) -> dict[str, Any]:
        """Its keys of ``results.json`` (every repetition)."""
        return {}
