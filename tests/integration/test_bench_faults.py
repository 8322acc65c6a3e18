"""The fault table of the benchmark (figure 11, ``--only faults``) at its quick size: every kind has its row.

Its figures are a report, not asserted: only that every kind has its row, each with counts that add up (or, for
the link cut where this machine does not allow network namespaces, the reason it was skipped), and that its figures
have, per kind, the rows lost and trained twice against the rows fed. The rows of a standalone cluster (an
executor's JVM killed, a Worker host lost) are not in ``--quick``: listed as skipped, with the reason.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(200)
BENCH = [sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks" / "bench.py")]
KINDS = ("none", "broker_journal", "broker_journal_group", "broker_no_journal", "broker_no_journal_group", "rank",
         "rank_group", "executor", "link")
CLUSTER_KINDS = ("cluster_executor", "cluster_executor_atomic", "cluster_host", "cluster_host_atomic")


def test_the_fault_table_runs_at_its_quick_size(tmp_path):
    result = subprocess.run([*BENCH, "--quick", "--only", "faults", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=190,
                            env={**os.environ, "SPARKBUS_BENCH_FAULTS_SEED": "18"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "results.json").read_text())["faults"]
    assert figures["plan"]["seed"] == 18
    rows = {row["kind"]: row for row in figures["table"]}
    assert sorted(rows) == sorted(KINDS + CLUSTER_KINDS)
    for kind in KINDS:
        row = rows[kind]
        if "skipped" in row:
            assert kind == "link" and row["skipped"], "only the link cut may be skipped, with a reason"
            continue
        assert all(isinstance(row[k], int) for k in ("rows_fed", "yielded", "lost", "twice", "dropped")), row
        assert row["rows_fed"] == row["runs"] * figures["plan"]["rows"] and row["yielded"] > 0, row
        assert sum(row["outcomes"].values()) == row["runs"] >= 1, row
    assert rows["none"]["faults"] == 0
    for kind in CLUSTER_KINDS:
        assert "--quick" in rows[kind]["skipped"], rows[kind]
    # its figures: per kind measured, the rows fed, and the rows lost and trained twice against them
    figures = {f["name"]: f for f in map(json.loads, (tmp_path / "figures.jsonl").read_text().splitlines())}
    for kind, row in rows.items():
        if "skipped" not in row:
            assert figures[f"{kind}: rows fed"]["value"] == row["rows_fed"]
            for what in ("lost", "trained twice"):
                assert figures[f"{kind}: rows {what}"]["anchor"] == f"{kind}: rows fed"
