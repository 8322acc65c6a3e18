"""Text end to end: examples/train_text.py under mpiexec -n 2 trains on token sequences Spark generated and
tokenized, fed ragged, padded per batch; every row once per epoch, tokens intact, bucketing cuts the padding."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparkbus.launch.mpi import loopback_env, mpiexec_python

from harness import steps_of

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

EPOCHS = 3                  # epoch 0 in Spark's order, 1 and 2 with bucket_by="tokens"
SHAPE = dict(classes=4, vocab=512, median_length=12.0, length_sigma=0.7, max_length=64)
DATA = dict(rows=2_000, val_rows=500, seed=5, partitions=2, batch_size=32, bucket_window=16, plain_epochs=1)


def lengths_by_partition(df):
    """The row lengths of ``df[tokens]``, partition by partition in Spark's order (one job)."""
    from pyspark.sql import functions as F

    return df.select(F.size("tokens").alias("n")).rdd.glom().map(lambda rows: [r.n for r in rows]).collect()


def test_text_trains_on_ragged_tokens_padded_per_batch_and_bucketing_cuts_the_padding(spark, start_broker_process,
                                                                                      children, tmp_path):
    from pyspark.sql import functions as F
    from train_text import feed_text_data, text_frame

    broker = start_broker_process()
    dump, summary_file = tmp_path / "dump", tmp_path / "summary.json"
    flags = ["--epochs", str(EPOCHS), "--plain-epochs", "1", "--seed", "5", "--classes", "4", "--vocab", "512",
             "--timeout", "60", "--summary", str(summary_file), "--dump", str(dump)]
    ranks = children.spawn(mpiexec_python(2, ROOT / "examples" / "train_text.py", "--ranks", broker.ranks, *flags),
                           env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fed = feed_text_data(spark, broker.feed, EPOCHS, timeout=60, **DATA, **SHAPE)
    out, err = children.finish(ranks, 90, "the ranks")
    assert ranks.returncode == 0, f"the ranks failed ({ranks.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
    summary = json.loads(summary_file.read_text())
    assert [f["bucketed"] for f in fed] == [False, True, True]
    assert [e["bucketed"] for e in summary["epochs"]] == [False, True, True]
    rows = DATA["rows"]

    # Every row once per epoch across the ranks (trained, or dropped to keep the ranks even, at most 1 batch).
    trained: dict[int, np.ndarray] = {}
    for epoch, e in enumerate(summary["epochs"]):
        parts = [dict(np.load(dump / f"rank{r}-epoch{epoch}.npz")) for r in range(2)]
        ids = np.concatenate([p["id"] for p in parts] + [p["dropped_id"] for p in parts])
        np.testing.assert_array_equal(np.sort(ids), np.arange(rows))
        assert e["batches"] == [steps_of(fed[epoch]["text-example"]["batches"], 2)] * 2    # equal steps, the
        assert sum(e["dropped_batches"]) == 0                                            # last one's rows shared
        assert e["rows"] == sum(len(p["id"]) for p in parts) and e["val_rows"] == DATA["val_rows"]
        # the wait for the first batch (in epoch 0, Spark's start-up) apart; rows/s and data wait after it
        firsts = e["first_batch_seconds"]
        assert all(0 < f <= w + 0.05 for f, w in zip(firsts, e["wait_seconds"]))
        assert e["start_up_seconds"] == max(firsts)
        assert e["waited_seconds"] == pytest.approx([max(w - f, 0) for w, f in zip(e["wait_seconds"], firsts)])
        assert e["rows_per_second"] == pytest.approx(e["rows"] / max(s - f for s, f in zip(e["seconds"], firsts)))
        for p in parts:                   # each row's tokens, read back from the padded tensors
            for kind in ("", "dropped_"):
                offsets, values = p[f"{kind}offsets"], p[f"{kind}values"]
                for i, row_id in enumerate(p[f"{kind}id"]):
                    seq = values[offsets[i]:offsets[i + 1]]
                    if row_id in trained:
                        np.testing.assert_array_equal(seq, trained[row_id])    # the same in every epoch
                    trained[int(row_id)] = seq

    # The token ids equal what Spark computes for those ids: the shortest, the longest and some others.
    lengths = {i: len(seq) for i, seq in trained.items()}
    chosen = sorted({min(lengths, key=lengths.get), max(lengths, key=lengths.get), 0, 1, 777, rows - 1})
    expected = {r.id: r.tokens for r in text_frame(spark, rows, DATA["seed"], 3, **SHAPE)
                .where(F.col("id").isin(chosen)).collect()}
    assert sorted(expected) == chosen
    for row_id in chosen:
        assert trained[row_id].dtype == np.int32
        assert trained[row_id].tolist() == expected[row_id]
    assert min(lengths.values()) < 6 and max(lengths.values()) > 40      # really of varying length
    assert all(1 <= t < SHAPE["vocab"] for t in trained[max(lengths, key=lengths.get)])

    # Learned: chance is 0.25; the ranks' models stayed identical.
    assert summary["final"]["val_accuracy"] > 0.6, summary["final"]
    assert summary["param_checksums"][0] == summary["param_checksums"][1]

    # Padding: every padded slot counted; bucketing cuts the share to under 0.3 of Spark's order.
    total_tokens = sum(lengths.values())
    for e in summary["epochs"]:
        assert e["tokens"] <= total_tokens and e["padded_slots"] >= e["tokens"]
    padding = summary["padding"]
    assert 0 <= padding["bucketed"] < padding["plain"] and padding["ratio"] <= 0.3, padding
    assert "padding share: plain" in out and "(bucket_by tokens)" in out and "(no bucketing)" in out


def benchmark_module(name):
    """benchmarks/NAME.py, loaded by path (benchmarks/ on sys.path would shadow other modules with its own)."""
    spec = importlib.util.spec_from_file_location(f"sparkbus_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # dataclasses look it up there
    spec.loader.exec_module(module)
    return module


def test_measure_reports_the_padding_share_with_and_without_bucketing(spark, start_broker_process):
    from train_text import text_frame

    padding = benchmark_module("padding")
    measure, padding_share = padding.measure, padding.padding_share

    broker = start_broker_process()
    df = text_frame(spark, 2_000, 5, 2, **SHAPE).cache()
    shares = measure(df, batch_size=32, bucket_window=16, feed_address=broker.feed, ranks_address=broker.ranks,
                     timeout=30)
    # In Spark's order a partition's batches are runs of 32 consecutive rows: the share follows from the lengths.
    batches = [part[i:i + 32] for part in lengths_by_partition(df) for i in range(0, len(part), 32)]
    assert shares.plain == pytest.approx(padding_share(batches))
    assert shares.rows == 2_000 and shares.batches[0] == len(batches)
    assert 0 <= shares.bucketed < shares.plain and shares.ratio <= 0.3, shares
