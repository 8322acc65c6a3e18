"""The run as text, shared by every section: the machine, tables, the targets' verdicts, the plot's grid, JSON.

Each section (``sections.Section``) knows its own tables, targets and text; this module lays them out. The same
Markdown is printed and written to ``RESULTS.md``; ``results.json`` keeps every repetition.
"""

from __future__ import annotations

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

from .common import ROOT, MiB
from .sections import Run, Section, Target

NAN = float("nan")


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

def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def num(value: float | None, fmt: str = ",.0f") -> str:
    """``value`` formatted, or ``-`` where nothing was measured (None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def mb(value: float | None) -> str:
    """MB/s: a decimal below 10 (a 1 KiB hop moves a few MB/s)."""
    return num(value, ",.1f" if value is not None and value < 10 else ",.0f")


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MiB:,.0f} MiB"


def _load(load: Any) -> str:
    return "-" if not load else ", ".join(f"{x:.2f}" for x in load)


def ordered(sections: Sequence[Section]) -> list[Section]:
    """The sections in the report's order (figure 1, 2, 2b, 3, ..., 9, 10, 11): by number, then suffix."""
    def key(section: Section) -> tuple[int, str]:
        digits = "".join(itertools.takewhile(str.isdigit, section.figure))
        return int(digits or 0), section.figure[len(digits):]

    return sorted(sections, key=key)


# ---- the run ------------------------------------------------------------------------------------------------

def targets(run: Run, sections: Sequence[Section]) -> list[Target]:
    """Every section's targets, in the report's order; a section that did not run says "not run"."""
    return [t for s in ordered(sections) for t in s.targets(run, run.results.get(s.name))]


def markdown(run: Run, sections: Sequence[Section]) -> str:
    sizes, m = run.sizes, run.machine
    parts = [f"# sparkbus benchmark ({sizes.name} size)", ""]
    parts.append(f"Measured {m['date']} by `benchmarks/bench.py{' --quick' if run.quick else ''}` "
                 f"in {run.seconds:.0f} s. Each figure is the median of {sizes.reps} repetition"
                 f"{'s' if sizes.reps > 1 else ''}. Nothing here is asserted: this is a report, not a test.")
    if run.quick:
        parts += ["", "**Quick run**: small sizes, one repetition, and Spark starting in the background during the "
                  "hop and RSS sections. It checks the harness; its figures and verdicts are indicative only."]
    parts += ["", "## Machine", "",
              table(["", ""], [
                  ["nproc", str(m["nproc"])], ["memory", f"{m['memory_gib']} GiB"], ["CPU", m["cpu"]],
                  ["OS", m["os"]], ["Python", m["python"]], ["Java", m["java"]],
                  ["libraries", ", ".join(f"{k} {v}" for k, v in m["versions"].items())],
                  ["sparkbus revision", f"`{m['revision']}`" + (f" (uncommitted changes in {', '.join(m['modified'])})"
                                                                if m["modified"] else "")],
                  ["load average (1, 5, 15 min)", f"start {_load(m['load_start'])}; end {_load(m.get('load_end'))}"],
              ]),
              "", "The machine may be shared: a load average above its core count means other work ran "
              "alongside and the figures are low and noisy."]
    parts += ["", "## Targets", "", table(["target", "goal", "measured", "verdict"],
                                           [[t.what, t.goal, t.measured, f"**{t.verdict}**"] for t in run.targets])]
    for section in ordered(sections):
        if section.name in run.results:
            parts += section.markdown(run, run.results[section.name])
    if run.notes:
        parts += ["", "## Notes", ""] + [f"- {n}" for n in run.notes]
    return "\n".join(parts) + "\n"


def console_targets(run: Run, sections: Sequence[Section]) -> str:
    """The targets as plain aligned text for the terminal, then the sections' own lines (costs, not targets)."""
    ts = run.targets
    w1 = max(len(t.what) for t in ts)
    w2 = max(len(t.goal) for t in ts)
    lines = [f"{'target'.ljust(w1)}  {'goal'.ljust(w2)}  verdict  measured"]
    lines += [f"{t.what.ljust(w1)}  {t.goal.ljust(w2)}  {t.verdict.ljust(7)}  {t.measured}" for t in ts]
    for section in ordered(sections):
        if section.name in run.results:
            lines += section.console(run, run.results[section.name])
    return "\n".join(lines)


def to_json(run: Run, sections: Sequence[Section]) -> dict[str, Any]:
    out: dict[str, Any] = {"sizes": run.sizes.__dict__, "machine": run.machine, "seconds": run.seconds,
                           "targets": [t.__dict__ | {"verdict": t.verdict} for t in run.targets]}
    for section in sections:
        if section.name in run.results:
            out |= section.json(run, run.results[section.name])
    return out


def plot(run: Run, sections: Sequence[Section], path: Path) -> None:
    """``throughput.png``: a grid of the sections' panels, three a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [s for s in ordered(sections) if s.name in run.results and s.plots(run.results[s.name])]
    columns = min(3, max(1, len(panels)))
    lines = max(1, math.ceil(len(panels) / columns))
    fig, grid = plt.subplots(lines, columns, figsize=(5.2 * columns, 4.2 * lines), squeeze=False)
    axes = [ax for line in grid for ax in line]
    if not panels:
        axes[0].text(0.5, 0.5, "nothing measured", ha="center")
    for ax in axes[len(panels):]:
        if panels:
            ax.set_visible(False)
    for ax, section in zip(axes, panels):
        section.plot(ax, run, run.results[section.name])
    fig.suptitle(f"sparkbus benchmark ({run.sizes.name}), {run.machine['nproc']} cores, {run.machine['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(run: Run, sections: Sequence[Section], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md = out / "RESULTS.md"
    png = out / "throughput.png"
    md.write_text(markdown(run, sections))
    plot(run, sections, png)
    (out / "results.json").write_text(json.dumps(to_json(run, sections), indent=1, default=str))
    return md, png


__all__ = ["machine", "table", "num", "mb", "gib", "targets", "markdown", "console_targets", "to_json", "plot",
           "write"]
