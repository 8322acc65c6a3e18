"""The files through which a benchmark rank and the benchmark meet, and a rank's way of failing.

A rank (``rank_consumer.py``, ``images_rank.py``, run under mpiexec) touches ``OUT/ready-<rank>`` once it
can start, waits for the go file if it was given one, and writes its figures to ``OUT/rank<rank>.json``; the
benchmark (``common.run_ranks``) waits for every ready file, starts the clock, and reads the figures.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkbus.launch.processes import wait_for


def ready_path(out: Path, rank: int) -> Path:
    return out / f"ready-{rank}"


def figures_path(out: Path, rank: int) -> Path:
    return out / f"rank{rank}.json"


def wait_for_go(go: str | Path, timeout: float) -> None:
    """Return once the file ``go`` exists; :class:`launch.processes.WaitTimeout` after ``timeout`` seconds."""
    wait_for(lambda: os.path.exists(go), timeout, f"{go} to appear", interval=0.002)


def write_figures(out: Path, rank: int, figures: dict) -> None:
    """Write ``figures`` to ``rank<rank>.json`` at once (never half a file for the benchmark to read)."""
    tmp = figures_path(out, rank).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(figures))
    os.replace(tmp, figures_path(out, rank))


def run_or_abort(main: Callable[[], Any], comm: Any) -> None:
    """Run ``main``; if it raises, print the traceback and abort the MPI job (never leave the other ranks
    waiting in a collective)."""
    try:
        main()
    except BaseException:
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
