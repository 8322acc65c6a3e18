"""A benchmark's figures as records, their targets, and the one report that renders them.

Every measurement is a :class:`Figure`: one JSON line (``section``, ``name``, ``value``, ``unit``, and the
``anchor`` it is a ratio against with that ``ratio``, both measured in the same run). The report reads only these
records: ``RESULTS.md`` (a table per section, then the targets with PASS/MISS), ``results.json`` (the machine, every
figure, every verdict) and, when matplotlib is installed, ``ratios.png``. ``benchmarks/`` (the peer comparisons of a
source checkout) writes the same records and is rendered by the same functions.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from .targets import TARGETS, Target


@dataclass(frozen=True)
class Figure:
    """One measured figure: the median of its repetitions, and its ratio to the anchor measured beside it."""

    section: str
    name: str
    value: float
    unit: str
    anchor: str | None = None          # the name of the figure of the same section this one is compared with
    ratio: float | None = None         # value / the anchor's value
    reps: tuple[float, ...] = ()

    def line(self) -> str:
        return json.dumps(asdict(self))


def figure(section: str, name: str, reps: Sequence[float], unit: str,
           anchor: Figure | None = None) -> Figure:
    """The median of ``reps`` as a :class:`Figure`, with its ratio to ``anchor`` (a figure of the same run)."""
    value = statistics.median(reps)
    ratio = value / anchor.value if anchor is not None and anchor.value else None
    return Figure(section, name, value, unit, anchor.name if anchor else None, ratio, tuple(reps))


def load(lines: Iterable[str]) -> list[Figure]:
    """Parse JSON lines back into figures (blank lines skipped)."""
    out = []
    for line in lines:
        if line.strip():
            record = json.loads(line)
            out.append(Figure(**{**record, "reps": tuple(record.get("reps", ()))}))
    return out


class Recorder:
    """Writes each figure as a JSON line the moment it is measured, and keeps them for the report."""

    def __init__(self, path: Path | None, echo: IO[str] | None = sys.stdout):
        self.figures: list[Figure] = []
        self.notes: list[str] = []
        self.path, self.echo = path, echo
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def add(self, *figures: Figure) -> None:
        for f in figures:
            self.figures.append(f)
            if self.path is not None:
                with self.path.open("a") as out:
                    out.write(f.line() + "\n")
            if self.echo is not None:
                ratio = f" ({f.ratio:.2f} x {f.anchor})" if f.ratio is not None else ""
                print(f"  {f.section}: {f.name} = {cell(f.value)} {f.unit}{ratio}", file=self.echo, flush=True)


# ---- verdicts ---------------------------------------------------------------------------------------------------

def verdicts(figures: Sequence[Figure], targets: Sequence[Target] = TARGETS) -> list[dict[str, Any]]:
    """Each target whose figure was measured in this run, with the measured number and PASS or MISS."""
    by_key = {(f.section, f.name): f for f in figures}
    out = []
    for t in targets:
        f = by_key.get((t.section, t.name))
        if f is None:
            continue
        measured = f.ratio if t.of == "ratio" else f.value
        ok = measured is not None and (measured >= t.goal if t.at_least else measured <= t.goal)
        out.append({"what": t.what, "section": t.section, "name": t.name, "of": t.of, "goal": t.goal_text(),
                    "measured": measured, "verdict": "PASS" if ok else "MISS"})
    return out


# ---- rendering ----------------------------------------------------------------------------------------------------

def cell(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"


def machine() -> dict[str, Any]:
    """Where the figures were measured: cores, load, Python, the versions of what the path runs through."""
    from importlib import metadata

    versions = {}
    for dist in ("sparkbus", "pyzmq", "pyarrow", "numpy", "pyspark"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return {"nproc": os.cpu_count(), "load": os.getloadavg(), "platform": platform.platform(),
            "python": platform.python_version(), "versions": versions,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def markdown(figures: Sequence[Figure], titles: dict[str, str], about: dict[str, Any],
             notes: Sequence[str] = ()) -> str:
    """RESULTS.md: the machine, the targets with their verdicts, then a table per section in run order."""
    lines = ["# sparkbus benchmark", "", f"Measured {about.get('date', '')} on {about.get('nproc')} cores "
             f"(load {', '.join(f'{x:.1f}' for x in about.get('load', ()))}), Python {about.get('python')}, "
             + ", ".join(f"{k} {v}" for k, v in about.get("versions", {}).items()) + ".", ""]
    lines += target_lines(figures)
    for section in dict.fromkeys(f.section for f in figures):
        lines += [f"## {titles.get(section, section)}", "", *figure_lines([f for f in figures if f.section == section])]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def target_lines(figures: Sequence[Figure]) -> list[str]:
    """The targets judged in this run, as a Markdown table (nothing when none was)."""
    judged = verdicts(figures)
    if not judged:
        return []
    return ["## Targets", "", "| target | goal | measured | verdict |", "|---|---|---|---|",
            *(f"| {v['what']} | {v['goal']} | {cell(v['measured'])} | **{v['verdict']}** |" for v in judged), ""]


def figure_lines(figures: Sequence[Figure]) -> list[str]:
    """Figures as a Markdown table: each beside the anchor it is a ratio against."""
    return ["| figure | value | unit | vs | ratio |", "|---|---|---|---|---|",
            *(f"| {f.name} | {cell(f.value)} | {f.unit} | {f.anchor or '-'} | {cell(f.ratio)} |" for f in figures), ""]


def write_report(out: Path, figures: Sequence[Figure], titles: dict[str, str], about: dict[str, Any],
                 notes: Sequence[str] = (), extra: dict[str, Any] | None = None) -> str:
    """Write RESULTS.md, results.json and (with matplotlib) ratios.png into ``out``; return the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(figures, titles, about, notes)
    (out / "RESULTS.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"machine": about, "figures": [asdict(f) for f in figures], "targets": verdicts(figures),
         "notes": list(notes), **(extra or {})}, indent=1, default=str))
    _plot(out / "ratios.png", figures, titles)
    return text


def _plot(path: Path, figures: Sequence[Figure], titles: dict[str, str]) -> None:
    """A panel per section: each figure's ratio to its anchor (1.0 = as fast as the anchor)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    sections = [s for s in dict.fromkeys(f.section for f in figures)
                if any(f.ratio is not None for f in figures if f.section == s)]
    if not sections:
        return
    fig, axes = plt.subplots(len(sections), 1, figsize=(9, 2.2 * len(sections) + 0.5), squeeze=False)
    for ax, section in zip(axes[:, 0], sections):
        shown = [f for f in figures if f.section == section and f.ratio is not None]
        ax.barh([f.name for f in shown], [f.ratio or 0 for f in shown])
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_title(titles.get(section, section), fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
