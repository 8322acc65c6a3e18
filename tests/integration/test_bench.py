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
BENCH = [sys.executable, str(ROOT / "benchmarks" / "bench.py")]
SIZES = ("1 KiB", "64 KiB", "1 MiB")
HOP = {f"{way} {size}" for way in ("zmq.proxy", "sparkbus") for size in SIZES} | {
    "zmq.proxy 1 KiB batches/s", "sparkbus 1 KiB batches/s", "sparkbus 64 KiB, time per batch",
    "recording why training waits, per 64 KiB batch", "zmq.proxy 1 MiB CPU-s per GB", "sparkbus 1 MiB CPU-s per GB",
    *(f"sparkbus 1 MiB CPU-s per GB, {p}" for p in ("feeder", "broker", "rank"))}
E2E = {"Arrow hand-off rows/s", "sparkbus rows/s", "sparkbus seconds to last batch", "sparkbus first batch",
       "Parquet staging rows/s", "Parquet staging seconds to last batch", "Parquet staging first batch"}


def valid_figures(path: Path, zero_allowed: tuple[str, ...] = ()) -> dict[str, dict[str, object]]:
    """The run's figures by section and name, each checked: finite and positive (or zero, in the units
    ``zero_allowed``: a share of waiting, rows lost), its anchor a figure of the same section of this run, its
    ratio that figure's value divided into its own."""
    figures = load(path.read_text().splitlines())
    by_section: dict[str, dict[str, object]] = {}
    for f in figures:
        assert f.name not in by_section.setdefault(f.section, {}), f"{f.section}: {f.name} twice"
        by_section[f.section][f.name] = f
    for f in figures:
        assert math.isfinite(f.value) and (f.value > 0 or f.value == 0 and f.unit in zero_allowed) and f.unit, f
        assert f.reps and all(math.isfinite(r) for r in f.reps), f
        if f.anchor is not None:
            anchor = by_section[f.section].get(f.anchor)
            assert anchor is not None, f"{f.section}: {f.name}'s anchor {f.anchor} was not measured in this run"
            assert f.ratio == (pytest.approx(f.value / anchor.value) if anchor.value else None), f
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



@pytest.mark.timeout(900)         # 3.7 min idle on 2 cores, 7 min at load 7: the bound leaves room for 10-16
def test_the_quick_peer_comparisons_produce_every_figure_against_its_anchor(tmp_path):
    """benchmarks/bench.py --quick: every section of its default, of the Spark set-ups only local[2] (the
    standalone ones start a cluster and a driver per set-up, minutes on 2 cores: the test below)."""
    result = subprocess.run([*BENCH, "--quick", "--spark-configs", "local", "--hop-seconds", "0.05",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=870)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = valid_figures(tmp_path / "figures.jsonl", zero_allowed=("%",))
    assert set(figures) == {"hop", "rss", "e2e", "cluster", "scaling", "wait", "brokers", "varlen", "lm", "spark",
                            "torchrun"}
    # the hop: every size against zmq.proxy, and each variant (CURVE, ...) against the plain hop of its size
    for size in ("1 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB"):
        assert figures["hop"][f"sparkbus {size}"].anchor == f"zmq.proxy {size}"
    assert figures["hop"]["recording why training waits, per 64 KiB batch"].anchor == "sparkbus 64 KiB, time per batch"
    for variant, size in (("CURVE", "64 KiB"), ("CURVE", "1 MiB"), ("unpacked", "1 KiB"), ("unpacked", "64 KiB"),
                          ("prefetch 64", "1 KiB"), ("verify=False", "1 MiB")):
        assert figures["hop"][f"sparkbus, {variant} {size}"].anchor == f"sparkbus {size}"
    assert HOP <= set(figures["hop"])
    # end to end, with the CPU of each process group against the hand-off's
    cpu = {"Arrow hand-off CPU-s per GB", "sparkbus CPU-s per GB",
           *(f"sparkbus CPU-s per GB, {group}" for group in ("jvm", "workers", "broker", "ranks"))}
    assert set(figures["e2e"]) == E2E | {"Arrow hand-off MB/s", "sparkbus MB/s"} | cpu
    assert {name for name in figures["scaling"]} == {"1 rank, 4 tasks", "2 ranks, 4 tasks", "4 ranks, 4 tasks",
                                                     "2 ranks, 1 tasks", "2 ranks, 2 tasks",
                                                     "4 ranks, 4 tasks, steps over MPI"}
    assert set(figures["brokers"]) == {"1 broker", "2 brokers", "4 brokers"}
    assert set(figures["spark"]) == {f"{way}, local, {n} partitions" for way in ("Spark alone", "to the ranks",
                                                                               "first batch") for n in (4, 16)} | {
        "session start, local"}
    assert {"binary", "varints", "padding share, bucket_by"} <= set(figures["varlen"])
    assert {f"sparkbus {kind}, {size} batches" for kind in ("fixed", "tokens") for size in ("1 MiB", "64 KiB")} \
        <= set(figures["cluster"])
    # language-model data (13): every batching mode against batch_size rows, the mixture, from_spark as the anchor
    modes = ("batch_size + bucket_by", "batch_size + bucket_bounds", "batch_tokens", "batch_tokens + bucket_by")
    assert set(figures["lm"]) == {f"{what}, {mode}" for what in ("real tokens/s", "padding share", "straggler ratio",
                                                                 "straggler ratio p90")
                                  for mode in ("batch_size", *modes)} | {
        "mixture ratio error per window", *(f"{way} {end} batch" for way in ("from_spark", "sparkbus")
                                            for end in ("first", "last"))}
    for what in ("real tokens/s", "padding share", "straggler ratio"):
        assert all(figures["lm"][f"{what}, {mode}"].anchor == f"{what}, batch_size" for mode in modes)
    for end in ("first", "last"):
        assert figures["lm"][f"sparkbus {end} batch"].anchor == f"from_spark {end} batch"
    report = json.loads((tmp_path / "results.json").read_text())
    assert {(t["section"], t["name"]) for t in report["targets"]} == {
        (t.section, t.name) for t in TARGETS if t.section not in ("images",)}
    # the mixture: every window of slots whole at the ranks, every slot once
    mixture = report["lm"]["mixture"]
    assert mixture["windows"] and mixture["slots_once"]
    assert (tmp_path / "ratios.png").stat().st_size > 10_000


@pytest.mark.skipif(not os.environ.get("SPARKBUS_TEST_STANDALONE_BENCH"),
                    reason="a standalone cluster and a driver: about a minute on an idle 2-core machine; "
                           "set SPARKBUS_TEST_STANDALONE_BENCH=1")
@pytest.mark.timeout(420)
def test_the_standalone_spark_setups_run(tmp_path):
    result = subprocess.run([*BENCH, "--quick", "--only", "spark", "--spark-configs", "2x1",
                             "--spark-partitions", "4", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = valid_figures(tmp_path / "figures.jsonl")
    assert set(figures["spark"]) == {f"{way}, 2x1, 4 partitions" for way in ("Spark alone", "to the ranks",
                                                                              "first batch")} | {"session start, 2x1"}
