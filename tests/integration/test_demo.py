"""The main job at its quick size: ``sparkbus demo --quick`` trains a model on Spark data through the broker."""

import json
import sys
from pathlib import Path

import pytest

from harness import run_child

pytestmark = pytest.mark.timeout(300)


def test_the_quick_demo_trains_well_above_chance(tmp_path):
    sparkbus = Path(sys.executable).parent / "sparkbus"
    result = run_child([sparkbus, "demo", "--quick", "--out", tmp_path, "--timeout", "240"], timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    feed = json.loads((tmp_path / "feed-report.json").read_text())
    ranks = json.loads((tmp_path / "summary.json").read_text())
    assert len(feed["epochs"]) == len(ranks["epochs"]) == 2
    assert all(e["rows"] == 20_000 for e in feed["epochs"])
    for number in range(2):
        seen = sum(r["epochs"][number]["rows"] + r["epochs"][number]["dropped_rows"] for r in ranks["ranks"])
        assert seen == 20_000                         # every row reached a rank (or was a counted leftover)
    assert ranks["final_accuracy"] > 0.5              # 10 classes: chance is 0.1
    assert ranks["model_spread_across_ranks"] == 0.0  # allreduce kept the ranks' models identical
    assert "final accuracy" in result.stdout
