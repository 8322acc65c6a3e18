"""Training for real: reshuffled epochs fed back to back (overlapping the ranks' training), the order guarantee
of the reshuffle, and examples/train_torch.py under mpiexec -n 2 learning through the broker, then resuming."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from feeder.epochs import epoch_order, feed_epochs
from launch.mpi import loopback_env, mpiexec_python

from helpers import wait_for

pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))


def frame_with_a_vector(spark, rows, partitions):
    """``id``, ``x`` array<float>[4] and ``v`` an ML vector, all derived from the id."""
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    df = spark.range(rows, numPartitions=partitions).select(
        "id", F.array(*[(F.col("id") * 10 + j).cast("float") for j in range(4)]).alias("x"),
        (F.col("id") / 4).alias("w"), (F.col("id") % 7).cast("double").alias("y"))
    return VectorAssembler(inputCols=["w", "y"], outputCol="v").transform(df)


def partition_ids(*frames):
    """The ids of each partition of each frame, in order, from one Spark job (a union keeps partitions apart)."""
    union = frames[0].select("id")
    for frame in frames[1:]:
        union = union.union(frame.select("id"))
    parts = union.rdd.glom().map(lambda rows: [r.id for r in rows]).collect()
    sizes = [frame.rdd.getNumPartitions() for frame in frames]
    return [parts[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(frames))]


def test_epoch_order_depends_on_seed_epoch_and_key_only(spark):
    from pyspark.sql import functions as F

    df = frame_with_a_vector(spark, rows=3_000, partitions=2)      # the default key hashes the vector too
    scrambled = df.repartition(3).sortWithinPartitions(F.desc("w"))   # same rows, other partitions and order
    first, again, other = partition_ids(epoch_order(df, epoch=1, seed=5, partitions=3),
                                        epoch_order(scrambled, epoch=1, seed=5, partitions=3),
                                        epoch_order(scrambled, epoch=2, seed=5, key=["id"], partitions=3))
    assert len(first) == 3
    assert sorted(sum(first, [])) == list(range(3_000))
    assert all(part != sorted(part) for part in first)
    assert again == first                                       # however the input was partitioned and ordered
    assert sorted(sum(other, [])) == list(range(3_000)) and other != first
    with pytest.raises(TypeError, match="nope"):
        epoch_order(df, epoch=0, seed=1, key=["nope"])


def test_next_epoch_is_fed_while_ranks_train_and_epochs_arrive_whole_in_order(spark, start_broker_process, start_ranks,
                                                                                tmp_path):
    from pyspark.sql import functions as F

    rows, epochs = 4_000, 3
    df = spark.range(rows, numPartitions=4).select(                # 260 bytes a row: about 1 MB an epoch
        "id", F.array(*[(F.col("id") + j).cast("float") for j in range(63)]).alias("x"))
    epoch_bytes = rows * 260
    broker = start_broker_process("--max-buffer", str(int(epoch_bytes * 2.5)))   # two epochs fit, three do not
    stall = tmp_path / "go"
    # a window of 4 batches (no byte window): the stalled ranks hold 8 of epoch 0's 20 batches, not all of them
    ranks = start_ranks(2, broker.ranks, "--stream", "ovl", "--epochs", str(epochs), "--stall-file", str(stall),
                        "--slow-rank", "1", "--slow-seconds", "0.01", "--prefetch-bytes", "0")
    fed, result = [], {}

    def on_epoch(epoch, report):
        fed.append((epoch, time.time(), any(ranks.out.glob("rank*-epoch0.npz"))))

    def run():
        try:
            result["reports"] = feed_epochs(df, broker.feed, epochs, stream="ovl", shuffle_seed=3, key=["id"],
                                            batch_size=200, timeout=60, on_epoch=on_epoch, pack_bytes=0)
        except BaseException as exc:         # reported by the assertions below
            result["error"] = exc

    feeding = threading.Thread(target=run)
    feeding.start()
    try:
        # Epochs 0 and 1 are fed in full while the ranks have not consumed a batch; epoch 2 is held back.
        stats = wait_for(lambda: (s := broker.stats())["broker"]["feed_paused"]
                         and s["streams"]["ovl"]["epochs"].get("2", {}).get("batches_in", 0) > 0 and s,
                         90, "epoch 2 to be held back by the full buffer")
        epochs_now = stats["streams"]["ovl"]["epochs"]
        assert [e for e, _, _ in fed] == [0, 1] and "error" not in result
        assert not any(done for _, _, done in fed), "a rank finished epoch 0 before the next epoch was fed"
        assert epochs_now["0"]["acked"] == 0 and not epochs_now["0"]["ended"]
        assert epochs_now["1"]["closed"] and epochs_now["1"]["rows_in"] == rows
        assert not epochs_now["2"]["closed"] and epochs_now["2"]["rows_in"] < rows
        assert feeding.is_alive()
    finally:
        stall.touch()                        # the ranks start; backpressure lets epoch 2 through as they consume
    feeding.join(120)
    assert not feeding.is_alive() and "error" not in result, result.get("error")
    summaries = ranks.wait()
    assert [r.rows for r in result["reports"]] == [rows] * epochs
    fed_epoch1_at = fed[1][1]
    assert all((ranks.out / f"rank{r}-epoch0.npz").stat().st_mtime >= fed_epoch1_at for r in range(2))
    for r in range(2):
        assert [e["epoch"] for e in summaries[r]["epochs"]] == [0, 1, 2]        # whole epochs, in order
    for epoch in range(epochs):
        assert summaries[0]["epochs"][epoch]["batches"] == summaries[1]["epochs"][epoch]["batches"]
        kept = [ranks.epoch(r, epoch)["id"] for r in range(2)]
        dropped = [ranks.epoch(r, epoch)["dropped_id"] for r in range(2)]
        np.testing.assert_array_equal(np.sort(np.concatenate(kept + dropped)), np.arange(rows))  # exactly once
    final = broker.stats()["streams"]["ovl"]["epochs"]
    assert [final[str(e)]["batches_in"] for e in range(epochs)] == [r.batches for r in result["reports"]]


# ---- examples/train_torch.py --------------------------------------------------------------------------------

@pytest.fixture
def start_training(tmp_path, children):
    """``start_training(ranks_address, *flags)``: examples/train_torch.py under ``mpiexec -n 2``."""
    running = []

    def start(address, *flags):
        summary = tmp_path / f"summary-{len(running)}.json"
        proc = children.spawn(mpiexec_python(2, EXAMPLES / "train_torch.py", "--ranks", address, "--summary",
                                             str(summary), "--timeout", "60", *flags),
                              env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        running.append(proc)

        def wait(timeout=120):
            out, err = children.finish(proc, timeout, "training")
            assert proc.returncode == 0, f"training failed ({proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
            return json.loads(summary.read_text()), out

        return wait

    return start


def test_train_torch_learns_through_the_broker_and_resumes_from_a_checkpoint(spark, start_broker_process,
                                                                              start_training, tmp_path):
    import torch
    from train_torch import feed_training_data

    broker = start_broker_process()
    checkpoint = tmp_path / "model.pt"
    data = dict(features=16, classes=4, rows=4_000, val_rows=1_000, batch_size=100, partitions=4, seed=11)
    common = ("--val-stream", "val", "--features", "16", "--classes", "4", "--seed", "11",
              "--checkpoint", str(checkpoint), "--shuffle-buffer", "4")

    # Run 1 trains epoch 0 and stops; its checkpoint says: next is epoch 1, from its first batch.
    first = start_training(broker.ranks, *common, "--epochs", "1")
    fed = feed_training_data(spark, broker.feed, 1, val_stream="val", **data)
    summary, out = first()
    assert [e["epoch"] for e in summary["epochs"]] == [0]
    assert "data wait r0" in out and "data wait: rank 0" in out
    state = torch.load(checkpoint, weights_only=True)
    assert (state["epoch"], state["batches"]) == (1, 0)

    # Pretend it died 3 steps into epoch 1: resume there. Epoch 1 was never fed, so the same stream takes it.
    state["batches"] = 3
    torch.save(state, checkpoint)
    second = start_training(broker.ranks, *common, "--epochs", "2", "--resume-from", str(checkpoint))
    fed += feed_training_data(spark, broker.feed, 2, val_stream="val", first_epoch=1, **data)
    resumed, _ = second()
    assert resumed["resumed_from"] == [1, 3]

    history = summary["epochs"] + resumed["epochs"]
    assert [(e["epoch"], e["broker_epoch"]) for e in history] == [(0, 0), (1, 1)]
    for e, f in zip(history, fed):
        assert e["batches"][0] == e["batches"][1]                               # equal steps on both ranks
        assert sum(e["batches"]) + sum(e["dropped_batches"]) == f["train"]["batches"]
        assert e["steps"] + e["skipped"] == e["batches"][0]
        assert e["val_rows"] == 1_000                                            # every validation row, once
        assert all(0 <= w <= s for w, s in zip(e["wait_seconds"], e["seconds"]))
    assert history[0]["skipped"] == 0 and history[1]["skipped"] == 3
    assert history[-1]["val_accuracy"] >= 0.8, history                          # chance is 0.25
    assert history[0]["loss"] > history[-1]["loss"]
    for run in (summary, resumed):
        assert run["param_checksums"][0] == run["param_checksums"][1]            # identical models
        assert len(run["data_wait"]["seconds"]) == 2
