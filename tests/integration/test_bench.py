"""The benchmark command at its quick size: it runs, and its report holds every figure with its ratio to the anchor
it was measured against. The figures' values are not judged (no timing in tests); their structure is."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)
SPARKBUS = Path(sys.executable).parent / "sparkbus"
TARGETS = {"sparkbus broker throughput at 64 KiB batches", "sparkbus broker throughput at 1 MiB batches",
           "sparkbus broker at 1 KiB batches, delivered to the training loop",
           "end to end from the cached DataFrame, rows/s", "end to end vs Parquet staging",
           "ranks' data-wait (even=True) while the feed outpaces compute",
           "... the same with the steps agreed over MPI (beside the broker's grants)",
           "4 ranks vs 1 rank on one broker, same data, rows/s",
           "... 4 ranks with their steps agreed over MPI (beside the broker's grants)",
           "broker peak RSS with 200 MiB through it",
           *(f"cluster-shaped end to end, {kind}, {size} batches" for kind in
             ("fixed-width", "variable-length (int arrays, mean 64)") for size in ("1 MiB", "64 KiB")),
           *(f"feeder CPU-s per GB above the Arrow hand-off (Spark's Python workers), {kind}, {size} batches, "
             "cluster-shaped" for kind in ("fixed-width", "variable-length (int arrays, mean 64)")
             for size in ("1 MiB", "64 KiB")),
           "binary rows of 64 KiB, end to end, vs the fixed-width path at the same bytes",
           "variable-length int arrays averaging 64 KiB, end to end, vs the fixed-width path",
           "padding share with length bucketing (bucket_by, window 64) vs Spark's order, batches of 64"}
SECTIONS = ("1. broker hop", "2. end to end", "2b. end to end, cluster-shaped", "3. scaling", "3b. broker peak RSS",
            "4. data-wait", "5. several brokers", "6. Spark configurations", "7. variable-length columns")


def report_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """RESULTS.md's tables: title -> rows as {column: cell}; every row has a cell for every column."""
    tables: dict[str, list[dict[str, str]]] = {}
    title, header = None, None
    for line in text.splitlines():
        if line.startswith("### "):
            title, header = line[4:], None
        elif line.startswith("| ") and title is not None:
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            if header is None:
                header = cells
                tables[title] = []
            else:
                assert len(cells) == len(header), (title, line)
                tables[title].append(dict(zip(header, cells)))
    return tables


def number(cell: str) -> float:
    return float(cell.replace(",", "").replace("**", ""))


def ratio_columns(rows: list[dict[str, str]]) -> list[str]:
    """The columns of a table that are ratios: "a / b", "vs ..."."""
    return [c for c in rows[0] if (" / " in c and "CPU-s:" not in c and not c.endswith("(s)")) or c.startswith("vs ")]


def test_the_quick_benchmark_runs_and_reports_every_figure_against_its_anchor(tmp_path):
    # Every section; of the Spark set-ups only local[2]: the standalone ones start a cluster and a driver per
    # set-up, minutes on 2 cores (test_the_standalone_spark_setups_run).
    result = subprocess.run([str(SPARKBUS), "bench", "--quick", "--spark-configs", "local", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads((tmp_path / "results.json").read_text())
    assert {t["what"] for t in figures["targets"]} == TARGETS
    assert all(t["verdict"] in ("PASS", "MISS") or t["goal"] == "printed (no target)" and t["measured"][0].isdigit()
               for t in figures["targets"]), figures["targets"]
    report = (tmp_path / "RESULTS.md").read_text()
    headings = [line[3:] for line in report.splitlines() if line.startswith("## ")]
    assert len(headings) >= len(SECTIONS) and all(h.startswith(s) for h, s in zip(headings, SECTIONS)), headings
    tables = report_tables(report)
    ratios = 0
    for title, rows in tables.items():
        for column in ratio_columns(rows) if rows else ():
            values = [number(row[column]) for row in rows if row[column] != "-"]
            assert values and all(math.isfinite(v) and v >= 0 for v in values), (title, column)
            ratios += 1
    assert ratios >= 15, sorted(tables)
    # the broker hop: every size three ways, their MB/s, and the CURVE rows (64 KiB and 1 MiB) against the plain hop
    assert {h["size"] for h in figures["hop"]} >= {1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20}
    assert all(h["mb_per_s"] > 0 and h["batches_per_s"] > 0 for h in figures["hop"])
    assert {(h["mode"], h["size"]) for h in figures["hop"] if h["runs"]} >= {
        ("sparkbus, CURVE", 64 << 10), ("sparkbus, CURVE", 1 << 20)}
    assert [c["size"] for c in figures["curve"]] == [64 << 10, 1 << 20]
    assert all(c["curve_mb_per_s"] > 0 and c["plain_mb_per_s"] > 0 and
               c["ratio"] == pytest.approx(c["curve_mb_per_s"] / c["plain_mb_per_s"]) for c in figures["curve"])
    assert sorted(figures["e2e"]) == ["limit", "parquet", "sparkbus"]
    assert all(run["rows"] == figures["dataset"]["rows"] for runs in figures["e2e"].values() for run in runs)
    assert {(s["ranks"], s["tasks"], s["steps"]) for s in figures["scaling"]} == {
        (1, 4, "broker"), (2, 4, "broker"), (4, 4, "broker"), (2, 1, "broker"), (2, 2, "broker"), (4, 4, "mpi")}
    assert figures["rss"] and all(r["peak_rss"] >= r["idle_rss"] > 0 for r in figures["rss"])
    assert figures["datawait"]["runs"] and figures["datawait"]["agreed_over_mpi"]
    assert sorted(figures["brokers"]["runs"]) == ["1", "2", "4"]
    assert {(p["config"], p["partitions"]) for p in figures["spark"]["points"]} == {("local", 4), ("local", 16)}
    # the cluster-shaped runs (2b): Spark's Python workers on one CPU, the ranks on the other, this tree's sparkbus
    cluster = figures["cluster"]
    assert cluster["where"]["affinity"] == cluster["cpus"]["spark"] != cluster["cpus"]["bus"]
    assert Path(cluster["where"]["feeder"]).resolve() == (Path(__file__).parents[2] / "feeder").resolve()
    fixed = {p["batch_bytes"]: p for p in cluster["points"] if p["kind"] == "fixed"}
    assert sorted(fixed) == [64 << 10, 1 << 20] and all(p["limit"] and p["sparkbus"] for p in fixed.values())
    assert all(run["rank_affinity"] == cluster["cpus"]["bus"] for p in fixed.values() for run in p["sparkbus"])
    # variable-length columns (7): both comparisons with the fixed-width path, every byte seen, and the padding share
    varlen = figures["varlen"]
    assert not varlen["refused"] and sorted(varlen["pairs"]) == ["binary", "varints"]
    for pair in varlen["pairs"].values():
        assert pair["baseline"] and pair["compared"]
        assert all(run["touched_bytes"] >= run["payload_bytes"] for run in pair["compared"] if not run["dropped_rows"])
    assert 0 <= varlen["padding"]["bucketed"] < varlen["padding"]["plain"]
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
    assert "images" not in figures                  # not in --quick's default sections


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
