"""What a section of the benchmark is: one figure that measures, judges, describes and draws its own results.

``bench.py`` runs the sections it is given, in order, each with a :class:`Context` (the run's children, sizes,
Spark and the results so far); ``report.py`` then asks every section for its targets, its Markdown, its JSON and
its plot panel, and only lays them out. A section's result is a typed record of its own (``HopResults``,
``EndToEnd``, ...), kept in :attr:`Run.results` under the section's name.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from .common import Children, Sizes

R = TypeVar("R")


@dataclass
class Target:
    """One goal of a figure and what this run measured against it."""

    what: str
    goal: str
    measured: str
    passed: bool | None      # None: not measured in this run (or a figure printed without a goal)

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else ("PASS" if self.passed else "MISS")


def _measured(value: float | None) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def at_least(value: float | None, goal: float) -> bool | None:
    """The verdict of ``value >= goal``: None where nothing was measured (None or NaN)."""
    return bool(value >= goal) if value is not None and _measured(value) else None


def at_most(value: float | None, goal: float) -> bool | None:
    """The verdict of ``value <= goal``: None where nothing was measured (None or NaN)."""
    return bool(value <= goal) if value is not None and _measured(value) else None


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
    targets: list[Target] = field(default_factory=list)

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

    def targets(self, run: Run, result: R | None) -> list[Target]:
        """Its targets; ``result`` is None when the section did not run (then each target says "not run")."""
        return []

    def markdown(self, run: Run, result: R) -> list[str]:
        """Its part of ``RESULTS.md``, as lines (each section starts with an empty line and its heading)."""
        return []

    def console(self, run: Run, result: R) -> list[str]:
        """Lines printed under the targets on the terminal (costs, not targets)."""
        return []

    def json(self, run: Run, result: R) -> dict[str, Any]:
        """Its keys of ``results.json`` (every repetition)."""
        return {}

    def plots(self, result: R) -> bool:
        """Whether it has a panel in ``throughput.png`` for this result."""
        return False

    def plot(self, ax: Any, run: Run, result: R) -> None:
        """Draw its panel on the matplotlib axes ``ax``."""
