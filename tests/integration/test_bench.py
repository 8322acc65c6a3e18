"""The benchmark command at its quick size: it runs and writes its report. Its figures are not asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)
SPARKBUS = Path(sys.executable).parent / "sparkbus"


def test_the_quick_benchmark_runs_and_writes_its_report(tmp_path):
    # Every section; of the Spark set-ups only local[2]: the standalone ones start a cluster and a driver per
    # set-up, minutes on 2 cores (test_the_standalone_spark_setups_run).
    result = subprocess.run([str(SPARKBUS), "bench", "--quick", "--spark-configs", "local", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "RESULTS.md").read_text()
    for target in ("sparkbus broker throughput at 64 KiB batches", "sparkbus broker throughput at 1 MiB batches",
                   "sparkbus broker at 1 KiB batches, delivered to the training loop",
                   "end to end from the cached DataFrame", "end to end vs Parquet staging",
                   "data-wait (even=True)", "4 ranks vs 1 rank on one broker", "broker peak RSS"):
        assert target in report
    assert report.count("steps agreed over MPI (beside the broker's grants)") == 2     # data-wait, 4 ranks vs 1
    assert "not run" not in report                  # every section produced its figure
    for section in ("### What CURVE costs (`--auth`)", "## 5. Several brokers", "## 6. Spark configurations"):
        assert section in report
    # the CURVE rows (a cost, not a target): 64 KiB and 1 MiB with and without --auth, and their ratio
    curve = report.split("### What CURVE costs")[1].split("\n## ")[0]
    for row in ("| 64 KiB |", "| 1 MiB |"):
        assert any(line.startswith(row) for line in curve.splitlines())
    assert "Diagnostic (a cost, not a target): CURVE ran at" in report
    assert "CURVE" not in "".join(line for line in report.splitlines() if "**PASS**" in line or "**MISS**" in line)
    figures = json.loads((tmp_path / "results.json").read_text())
    assert {h["size"] for h in figures["hop"]} >= {1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20}
    assert {(h["mode"], h["size"]) for h in figures["hop"] if h["runs"]} >= {
        ("sparkbus, CURVE", 64 << 10), ("sparkbus, CURVE", 1 << 20)}
    assert [c["size"] for c in figures["curve"]] == [64 << 10, 1 << 20]
    assert all(c["curve_mb_per_s"] > 0 and c["plain_mb_per_s"] > 0 and c["ratio"] > 0 for c in figures["curve"])
    assert sorted(figures["brokers"]["runs"]) == ["1", "2", "4"]
    assert {(p["config"], p["partitions"]) for p in figures["spark"]["points"]} == {("local", 4), ("local", 16)}
    # the cluster-shaped runs (2b): Spark's Python workers on one CPU, the ranks on the other, this tree's sparkbus
    cluster = figures["cluster"]
    assert cluster["where"]["affinity"] == cluster["cpus"]["spark"] != cluster["cpus"]["bus"]
    assert Path(cluster["where"]["feeder"]).resolve() == (Path(__file__).parents[2] / "feeder").resolve()
    fixed = {p["batch_bytes"]: p for p in cluster["points"] if p["kind"] == "fixed"}
    assert sorted(fixed) == [64 << 10, 1 << 20] and all(p["limit"] and p["sparkbus"] for p in fixed.values())
    assert all(run["rank_affinity"] == cluster["cpus"]["bus"] for p in fixed.values() for run in p["sparkbus"])
    assert "## 2b. End to end, cluster-shaped" in report
    assert "feeder CPU-s per GB above the Arrow hand-off" in report
    # variable-length columns (7): both comparisons with the fixed-width path, every byte seen, and the padding share
    varlen = figures["varlen"]
    assert not varlen["refused"] and sorted(varlen["pairs"]) == ["binary", "varints"]
    for pair in varlen["pairs"].values():
        assert pair["baseline"] and pair["compared"]
        assert all(run["touched_bytes"] >= run["payload_bytes"] for run in pair["compared"] if not run["dropped_rows"])
    assert 0 <= varlen["padding"]["bucketed"] < varlen["padding"]["plain"]
    assert "## 7. Variable-length columns" in report and "not measured" not in report
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
    assert "images" not in figures and "## 8. Images" not in report     # not in --quick's default sections


@pytest.mark.skipif(not os.environ.get("SPARKBUS_TEST_STANDALONE_BENCH"),
                    reason="a standalone cluster and a driver: about a minute on an idle 2-core machine; "
                           "set SPARKBUS_TEST_STANDALONE_BENCH=1")
@pytest.mark.timeout(420)
def test_the_standalone_spark_setups_run(tmp_path):
    result = subprocess.run([str(SPARKBUS), "bench", "--quick", "--only", "spark", "--spark-configs", "2x1",
                             "--spark-partitions", "4", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "results.json").read_text())
    (point,) = figures["spark"]["points"]
    assert (point["config"], point["partitions"]) == ("2x1", 4) and point["runs"]
    # two executors, one on each Worker's host
    assert sorted(e["host"] for e in figures["spark"]["configs"]["2x1"]["executors"]) == ["127.0.0.1", "127.0.0.2"]
