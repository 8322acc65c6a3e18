"""The fault table of the benchmark (figure 11, ``--only faults``) at its quick size: it runs and writes its table.

Its figures are a report, not asserted: only that every kind has its row, and that each row's figures are numbers
(or, for the link cut where this machine does not allow network namespaces, the reason it was skipped). The rows
of a standalone cluster (an executor's JVM killed, a Worker host lost) are not in ``--quick``: listed as skipped,
with the reason.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)
SPARKBUS = Path(sys.executable).parent / "sparkbus"
LABELS = ("no fault (baseline)", "broker SIGKILL, `--journal`, restart",
          "the same, the consumers a group of 2 (granted steps)",
          "broker SIGKILL, no journal, restart (recomputed from lineage)",
          "no journal, the consumers a group of 2 (granted steps)",
          "consumer SIGKILL, a new one started", "a rank of a group of 2 SIGKILLed, a new process takes its number",
          "Spark Python worker SIGKILL mid-partition",
          "consumers' link cut 1-4 s (namespaces)")
CLUSTER_LABELS = ("executor JVM SIGKILL mid-partition (standalone cluster; the Worker starts a new one)",
                  "a Worker host lost mid-partition (Worker and executor JVMs SIGKILLed; one a feed)")


def test_the_fault_table_runs_at_its_quick_size(tmp_path):
    result = subprocess.run([str(SPARKBUS), "bench", "--quick", "--only", "faults", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=190,
                            env={**os.environ, "SPARKBUS_BENCH_FAULTS_SEED": "18"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "RESULTS.md").read_text()
    assert "## 11. A fault table" in report and "Seed **18**" in report
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in report.split("## 11. A fault table")[1].splitlines() if line.startswith("| ")}
    for label in LABELS:
        assert label in rows, f"no row {label!r} in the fault table: {sorted(rows)}"
        cells = rows[label]
        if cells[0] == "skipped":
            assert label.endswith("(namespaces)") and any(cells[5:]), "only the link cut may be skipped, with a reason"
            continue
        for cell in cells[1:6]:           # rows fed, yielded, lost, trained twice, dropped for equal steps
            assert cell.strip("*").replace(",", "").isdigit(), f"{label}: {cell!r} is not a number"
    for label in CLUSTER_LABELS:
        assert label in rows, f"no row {label!r} in the fault table: {sorted(rows)}"
        assert rows[label][0] == "skipped" and "--quick" in rows[label][6], rows[label]
    figures = json.loads((tmp_path / "results.json").read_text())["faults"]
    assert figures["plan"]["seed"] == 18
    for row in figures["table"]:
        if "skipped" not in row:
            assert all(isinstance(row[k], int) for k in ("rows_fed", "yielded", "lost", "twice", "dropped")), row
