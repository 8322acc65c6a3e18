"""The benchmarks at their quick size produce valid figures: the records parse, every expected figure is there, its
value finite and positive, its ratio computed against an anchor of the same run. No figure's value is judged (no
timing in tests), nor the report's prose.

``sparkbus bench`` (the package's: the hop, end to end, the user's own data) and ``benchmarks/bench.py`` (the
checkout's peer comparisons) write the same records (``sparkbus.bench.figures.Figure``, one JSON line each).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbus.bench.figures import load
from sparkbus.bench.targets import TARGETS

pytestmark = pytest.mark.timeout(400)
ROOT = Path(__file__).resolve().parents[2]
SPARKBUS = Path(sys.executable).parent / "sparkbus"
SIZES = ("1 KiB", "64 KiB", "1 MiB")
HOP = {f"{way} {size}" for way in ("zmq.proxy", "sparkbus") for size in SIZES} | {
    "zmq.proxy 1 KiB batches/s", "sparkbus 1 KiB batches/s"}
E2E = {"Arrow hand-off rows/s", "sparkbus rows/s", "sparkbus seconds to last batch", "sparkbus first batch",
       "Parquet staging rows/s", "Parquet staging seconds to last batch", "Parquet staging first batch"}


def valid_figures(path: Path) -> dict[str, dict[str, object]]:
    """The run's figures by section and name, each checked: finite and positive, its anchor a figure of the same
    section of this run, its ratio that figure's value divided into its own."""
    figures = load(path.read_text().splitlines())
    by_section: dict[str, dict[str, object]] = {}
    for f in figures:
        assert f.name not in by_section.setdefault(f.section, {}), f"{f.section}: {f.name} twice"
        by_section[f.section][f.name] = f
    for f in figures:
        assert math.isfinite(f.value) and f.value > 0 and f.unit, f
        assert f.reps and all(math.isfinite(r) for r in f.reps), f
        if f.anchor is not None:
            anchor = by_section[f.section].get(f.anchor)
            assert anchor is not None, f"{f.section}: {f.name}'s anchor {f.anchor} was not measured in this run"
            assert f.ratio == pytest.approx(f.value / anchor.value), f
    return by_section


def test_sparkbus_bench_help_says_what_it_measures():
    text = " ".join(subprocess.run([str(SPARKBUS), "bench", "--help"], capture_output=True, text=True,
                                   timeout=60, check=True).stdout.split())
    for measured in ("zmq.proxy", "end to end", "hand-off", "Parquet", "--parquet PATH", "figures.jsonl"):
        assert measured in text, measured
    assert ".py" not in text and "sparkbus.bench" not in text and "Section" not in text


def test_a_quick_sparkbus_bench_produces_every_figure_against_its_anchor(tmp_path):
    """The hop, end to end, and the user's own data (a Parquet directory) in one quick run."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "mine"
    data.mkdir()
    for part in range(2):
        ids = np.arange(part * 5000, (part + 1) * 5000)
        pq.write_table(pa.table({"id": ids, "x": np.random.default_rng(part).random(len(ids), dtype=np.float32)}),
                       data / f"part-{part}.parquet")
    out = tmp_path / "out"
    result = subprocess.run([str(SPARKBUS), "bench", "--quick", "--rows", "20000", "--hop-seconds", "0.05",
                             "--parquet", str(data), "--out", str(out)], capture_output=True, text=True, timeout=380)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = valid_figures(out / "figures.jsonl")
    assert set(figures) == {"hop", "e2e", "table"}
    assert set(figures["hop"]) == HOP and set(figures["e2e"]) == E2E | {"Arrow hand-off MB/s", "sparkbus MB/s"}
    assert set(figures["table"]) == E2E
    for size in SIZES:
        assert figures["hop"][f"sparkbus {size}"].anchor == f"zmq.proxy {size}"
    assert figures["e2e"]["sparkbus rows/s"].anchor == "Arrow hand-off rows/s"
    # every target of these sections judged, on the figure the targets table names
    report = json.loads((out / "results.json").read_text())
    judged = {(t["section"], t["name"]) for t in report["targets"]}
    assert judged == {(t.section, t.name) for t in TARGETS if t.section in ("hop", "e2e")}
    assert all(t["verdict"] in ("PASS", "MISS") and math.isfinite(t["measured"]) for t in report["targets"])
    assert len(report["figures"]) == sum(map(len, figures.values()))


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
