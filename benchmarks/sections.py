"""What a section of the benchmark is: it measures, and emits its figures (``sparkbus.bench.figures.Figure``, one
JSON line each, each beside the anchor it is a ratio of). ``bench.py`` runs the sections with a :class:`Context`;
``sparkbus.bench.figures.write_report`` renders every section's figures and judges the targets.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from sparkbus.bench.figures import Figure

from .common import Children, Sizes

R = TypeVar("R")


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
    df: Any = None                        # the cached DataFrame (id + 64 float32 features), if a section needs it
    rows: int = 0                         # its rows
    session_seconds: float | None = None  # the session's start-up

    @property
    def quick(self) -> bool:
        return self.sizes.name.startswith("quick")


@dataclass
class Run:
    """One run of the benchmark: its sizes, each section's result and the figures recorded so far."""

    sizes: Sizes
    results: dict[str, Any] = field(default_factory=dict)
    figures: list[Figure] = field(default_factory=list)


class Section(Generic[R]):
    """A figure of the benchmark: ``name`` (the key of ``--only``, of the results and the figures' ``section``),
    ``title`` (its heading in the report), ``spark`` (``""``: no Spark; ``"session"``: the benchmark's local[2]
    session; ``"frame"``: also the cached DataFrame), ``quick`` (whether ``--quick`` runs it by default)."""

    name: ClassVar[str]
    title: ClassVar[str]
    spark: ClassVar[str] = ""
    quick: ClassVar[bool] = True

    def needs(self, args: argparse.Namespace) -> str:
        return self.spark

    def measure(self, ctx: Context) -> R:
        """Measure; return the figures, or a record that :meth:`figures` turns into them. A section whose record
        fills as it goes puts it in ``ctx.results`` first, so that a failure part-way still reports it."""
        raise NotImplementedError

    def figures(self, run: Run, result: R) -> list[Figure]:
        return list(result) if isinstance(result, list) else []

    def json(self, run: Run, result: R) -> dict[str, Any]:
        """Its keys of ``results.json`` beside the figures (what a test checks beyond them)."""
        return {}
