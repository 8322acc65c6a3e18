"""Training for real: reshuffled epochs fed back to back (overlapping the ranks' training), the order guarantee
of the reshuffle, and examples/train_torch.py under mpiexec -n 2 learning through the broker, killed after a
mid-epoch checkpoint and resumed from it exactly."""

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sparkbus.feeder.epochs import epoch_order, feed_epochs
from sparkbus.launch.mpi import loopback_env, mpiexec_python

from harness import Children, steps_of, wait_for

pytestmark = pytest.mark.timeout(180)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STREAM = "torch-example"     # train_torch.py's training stream, fed and read by default
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

@dataclass
class Training:
    """One run of examples/train_torch.py under ``mpiexec -n 2``."""

    proc: subprocess.Popen
    summary: Path
    children: Children

    def wait(self, timeout: float = 120.0) -> tuple[dict, str]:
        out, err = self.children.finish(self.proc, timeout, "training")
        assert self.proc.returncode == 0, f"training failed ({self.proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
        return json.loads(self.summary.read_text()), out

    def kill(self) -> None:
        """SIGKILL mpiexec, its proxies and the ranks at once: a crash, nothing said to the broker."""
        Children.kill(self.proc)


@pytest.fixture
def start_training(tmp_path, children):
    """``start_training(ranks_address, *flags)``: a :class:`Training`; killed at the end of the test if still
    running."""
    started = []

    def start(address, *flags):
        summary = tmp_path / f"summary-{len(started)}.json"
        proc = children.spawn(mpiexec_python(2, EXAMPLES / "train_torch.py", "--ranks", address, "--summary",
                                             str(summary), "--timeout", "60", *flags),
                              env=loopback_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return Training(proc, summary, children)

    return start


def used_batches(position):
    """The batches a training ``state_dict()`` says were used: ``(part, seq, index)`` each."""
    return {(part, seq, i) for part, seq, first, stop, _ in position["train"]["used"] for i in range(first, stop)}


def test_train_torch_learns_through_the_broker_and_resumes_exactly_from_a_mid_epoch_checkpoint(
        spark, start_broker_process, start_training, tmp_path):
    import torch
    from train_torch import feed_training_data, load_positions

    broker = start_broker_process()
    checkpoint = tmp_path / "model.pt"
    data = dict(features=16, classes=4, rows=4_000, val_rows=1_000, batch_size=100, partitions=4, seed=11)
    common = ("--val-stream", "val", "--features", "16", "--classes", "4", "--seed", "11", "--epochs", "2",
              "--checkpoint", str(checkpoint))
    every = 8

    # Run 1 checkpoints every 8 steps of epoch 0 (at 8 and 16 of its 22: 21 and the last batch's rows), trains all
    # 22, then waits to validate: validation epoch 0 is not fed, so the epoch's end is never checkpointed. Killed
    # there, the model it saved at step 16 has not seen steps 17..22, which it trained.
    first = start_training(broker.ranks, *common, "--checkpoint-every", str(every))
    fed = feed_training_data(spark, broker.feed, 1, **data)     # training epoch 0 only
    share = steps_of(fed[0][STREAM]["batches"], 2)              # steps a rank takes of the epoch (43 batches: 22)
    last = share // every * every                               # run 1's last checkpoint (16)
    assert 0 < last < share

    def trained_whole_epoch():
        figures = broker.stats()["streams"][STREAM]["epochs"]["0"]
        return figures["ended"] and figures["acked"] == figures["batches_out"] and figures["queued"] == 0

    wait_for(lambda: checkpoint.exists() and torch.load(checkpoint, weights_only=True)["steps"] == last
             and trained_whole_epoch(), 90, f"run 1 to checkpoint at step {last} and train the whole epoch")
    first.kill()
    saved = torch.load(checkpoint, weights_only=True)
    positions = load_positions(str(checkpoint))
    assert (saved["epoch"], saved["steps"]) == (0, last)
    assert [(p["train"]["epoch"], p["train"]["steps"]) for p in positions] == [(0, last), (0, last)]
    assert [(p["val"]["epoch"], p["val"]["used"]) for p in positions] == [(0, []), (0, [])]
    used = [used_batches(p) for p in positions]
    assert len(used[0]) == len(used[1]) == last and not used[0] & used[1]   # each rank its own batches

    # Run 2 resumes both sides from the checkpoint (the broker kept running, and holds a delivered epoch 0): the
    # rest of epoch 0, 5 steps a rank, validation 0 whole, then epoch 1. With a shuffle buffer, as the resumed part
    # may: its checkpoints are at epoch ends only.
    second = start_training(broker.ranks, *common, "--shuffle-buffer", "4", "--resume-from", str(checkpoint))
    fed = feed_training_data(spark, broker.feed, 2, val_stream="val", resume=positions[0], **data)
    resumed, out = second.wait()
    assert "data wait r0" in out and "data wait: rank 0" in out
    assert resumed["resumed_from"] == [0, last]
    history = resumed["epochs"]
    assert [(e["epoch"], e["broker_epoch"]) for e in history] == [(0, 0), (1, 1)]
    for e, f in zip(history, fed):
        assert e["batches"][0] == e["batches"][1]                               # equal steps on both ranks
        assert e["steps"] == e["batches"][0] and e["resumed_batches"] == [e["resumed_steps"]] * 2
        assert [b + r for b, r in zip(e["batches"], e["resumed_batches"])] == [steps_of(f[STREAM]["batches"], 2)] * 2
        assert sum(e["dropped_batches"]) == 0                                    # the last step's rows shared out
        assert e["val_rows"] == 1_000                                            # every validation row, once
        assert all(0 <= w <= s for w, s in zip(e["wait_seconds"], e["seconds"]))
        assert all(0 < f <= w + 0.05 for f, w in zip(e["first_batch_seconds"], e["wait_seconds"]))   # start-up
    assert [(e["steps"], e["resumed_steps"]) for e in history] == \
        [(share - last, last), (steps_of(fed[1][STREAM]["batches"], 2), 0)]     # the rest of the epoch, exactly
    after = broker.stats()["streams"][STREAM]["epochs"]
    assert after["0"]["adopted"] == 2 * last               # the broker matched the checkpoint's batches, not sent
    assert history[-1]["val_accuracy"] >= 0.8, history                          # chance is 0.25
    assert history[0]["loss"] > history[-1]["loss"]
    assert resumed["param_checksums"][0] == resumed["param_checksums"][1]        # identical models
    assert len(resumed["data_wait"]["seconds"]) == len(resumed["data_wait"]["start_up_seconds"]) == 2
    final = load_positions(str(checkpoint))                                      # the last epoch's end
    assert [(p["train"]["epoch"], p["train"]["used"]) for p in final] == [(2, []), (2, [])]
