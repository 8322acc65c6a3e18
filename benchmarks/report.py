"""The report, the same for every section: the machine, the targets judged on the run's figures (records of
``sparkbus.bench.figures``, also written as ``figures.jsonl``), each section's figures and tables, as Markdown
(``RESULTS.md``, also printed), JSON (``results.json``: every repetition) and one plot (``throughput.png``)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import platform
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sparkbus.bench import figures

from .common import ROOT, MiB
from .sections import Run, Section, Table

# ---- the machine --------------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """What the figures were measured on: cores, memory, CPU, versions, the code's revision, the date, load."""
    from importlib import metadata

    import psutil

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"

    cpu = "-"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import zmq
        libzmq = zmq.zmq_version()
    except ImportError:
        libzmq = "-"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "java": (_run(["java", "-version"], stderr=True).splitlines() or ["-"])[0],
        "versions": {name: version(name) for name in ("pyspark", "pyzmq", "numpy", "pyarrow", "mpi4py", "mpich",
                                                      "msgpack", "psutil", "matplotlib", "sparkbus")}
                    | {"libzmq": libzmq},
        "revision": _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]).strip() or "-",
        "modified": [line[3:] for line in _run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                                "broker", "feeder", "worker"]).splitlines()],
        "load_start": os.getloadavg(),
    }


def _run(command: list[str], stderr: bool = False) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stderr if stderr else done.stdout


# ---- cells and tables ----------------------------------------------------------------------------------------

def cell(value: Any) -> str:
    """A table cell: ``-`` where nothing was measured (None or NaN), thousands separated, three digits below 100."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MiB:,.0f} MiB"


def markdown_table(table: Table) -> list[str]:
    lines = ["", f"### {table.title}", "", "| " + " | ".join(table.header) + " |",
             "|" + "|".join("---" for _ in table.header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table.rows]
    return lines + ([""] + [f"- {note}" for note in table.notes] if table.notes else [])


def ordered(sections: Sequence[Section]) -> list[Section]:
    """The sections in the report's order (figure 1, 2, 2b, 3, ..., 9, 10, 11): by number, then suffix."""
    def key(section: Section) -> tuple[int, str]:
        digits = "".join(itertools.takewhile(str.isdigit, section.figure))
        return int(digits or 0), section.figure[len(digits):]

    return sorted(sections, key=key)


def _ran(run: Run, sections: Sequence[Section]) -> list[Section]:
    return [s for s in ordered(sections) if run.results.get(s.name) is not None]


# ---- the run ------------------------------------------------------------------------------------------------

def tables(run: Run, sections: Sequence[Section]) -> list[tuple[Section, list[Table]]]:
    return [(s, s.tables(run, run.results[s.name])) for s in _ran(run, sections)]


def markdown(run: Run, sections: Sequence[Section]) -> str:
    m = run.machine
    machine = Table("Machine", ["", ""], [
        ["nproc", m["nproc"]], ["memory", f"{m['memory_gib']} GiB"], ["CPU", m["cpu"]], ["OS", m["os"]],
        ["Python", m["python"]], ["Java", m["java"]],
        ["libraries", ", ".join(f"{k} {v}" for k, v in m["versions"].items())],
        ["sparkbus revision", f"`{m['revision']}`" + (f" (uncommitted changes in {', '.join(m['modified'])})"
                                                      if m["modified"] else "")],
        ["load average (1, 5, 15 min)", f"start {_load(m['load_start'])}; end {_load(m.get('load_end'))}"]],
        notes=["a load average above the core count means other work ran alongside: figures low and noisy"])
    parts = [f"# sparkbus benchmark ({run.sizes.name} size)", "",
             f"Measured {m['date']} by `benchmarks/bench.py{' --quick' if run.quick else ''}` in {run.seconds:.0f} s; "
             "each "
             f"figure the median of {run.sizes.reps} repetition(s), beside the anchor it is a ratio of, measured in "
             "the same run. What each figure means: benchmarks/README.md."]
    parts += markdown_table(machine) + ["", *figures.target_lines(run.figures)]
    for section, section_tables in tables(run, sections):
        parts += ["", f"## {section.title}", "", *figures.figure_lines([f for f in run.figures
                                                                        if f.section == section.name])]
        for table in section_tables:
            parts += markdown_table(table)
    if run.notes:
        parts += ["", "## Notes", ""] + [f"- {n}" for n in run.notes]
    return "\n".join(parts) + "\n"


def _load(load: Any) -> str:
    return "-" if not load else ", ".join(f"{x:.2f}" for x in load)


def to_json(run: Run, sections: Sequence[Section]) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": run.sizes.__dict__, "machine": run.machine, "seconds": run.seconds,
                           "dataset": run.dataset.__dict__ if run.dataset else None,
                           "figures": [dataclasses.asdict(f) for f in run.figures],
                           "targets": figures.verdicts(run.figures)}
    for section in _ran(run, sections):
        out |= section.json(run, run.results[section.name])
    return out


def _number(value: Any) -> float:
    try:
        return float(str(value).replace(",", "").rstrip(" x%"))
    except ValueError:
        return math.nan


def plot(run: Run, sections: Sequence[Section], path: Path) -> None:
    """``throughput.png``: a panel per table that names columns to plot, as bars against its first column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [t for _, ts in tables(run, sections) for t in ts if t.plot and t.rows]
    columns = min(3, max(1, len(panels)))
    fig, grid = plt.subplots(max(1, math.ceil(len(panels) / columns)), columns, figsize=(5.2 * columns, 4.2 *
                             max(1, math.ceil(len(panels) / columns))), squeeze=False)
    axes = [ax for line in grid for ax in line]
    for ax in axes[len(panels):]:
        ax.set_visible(not panels)
    for ax, table in zip(axes, panels):
        width = 0.8 / len(table.plot)
        for i, name in enumerate(table.plot):
            column = table.header.index(name)
            ax.bar([j + i * width for j in range(len(table.rows))], [_number(r[column]) for r in table.rows],
                   width, label=name)
        ax.set_xticks([j + width * (len(table.plot) - 1) / 2 for j in range(len(table.rows))],
                      [cell(r[0]) for r in table.rows], fontsize=7, rotation=20)
        if table.log:
            ax.set_yscale("log")
        ax.set_title(table.title, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"sparkbus benchmark ({run.sizes.name}), {run.machine['nproc']} cores, {run.machine['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(run: Run, sections: Sequence[Section], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md, png = out / "RESULTS.md", out / "throughput.png"
    md.write_text(markdown(run, sections))
    plot(run, sections, png)
    (out / "results.json").write_text(json.dumps(to_json(run, sections), indent=1, default=str))
    return md, png
