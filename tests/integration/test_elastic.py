"""torchrun elastic: examples/train_elastic.py under ``python -m torch.distributed.run --nnodes=1:1
--max-restarts=N`` (gloo on CPU), fed by ``feed_elastic`` over a checkpoint directory from Spark local mode, through
a broker started by its CLI.

- A rank SIGKILLs itself mid-epoch (3 steps after a checkpoint, on torchrun's first attempt only); torchrun restarts
  the group, which resumes from the checkpoint, and the feed, told by the group's request, re-feeds the epoch: the
  rows in the checkpointed model and those trained after the resume are every row once, with equal steps.
- N→M: a job of 2 ranks dies after a checkpoint; a second job of 3 ranks started on the same directory resumes from
  it: the same, the rest shared over 3 ranks.

Every wait is bounded: torchrun and its ranks are children of the test (killed with all they started at its end),
the example's collectives and streams time out, and the feed's loop has an idle timeout.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from harness import Children

pytestmark = pytest.mark.timeout(200)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "train_elastic.py"
sys.path.insert(0, str(EXAMPLES))
ROWS, PARTITIONS, BATCH = 4_000, 2, 100      # 40 batches an epoch
EPOCHS = 2
FEATURES = 8
RUN_SECONDS = 120.0

# torch 2.13's c10d rendezvous shares its TCP store with the workers across restarts: a restarted group's gloo
# then reads the old group's addresses from it (connectFullMesh: connection refused). A store of each round's own:
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

pytest.importorskip("torch")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for torchrun's rendezvous store."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ElasticFeed:
    """``feed_elastic`` in a thread of the test (Spark's session is the test's); its reports or its error."""

    def __init__(self, spark, broker, checkpoints: Path, stream: str) -> None:
        from train_torch import synthetic_frame

        from sparkbus import feed_elastic

        frame = synthetic_frame(spark, ROWS, FEATURES, 4, 7, PARTITIONS)
        self.reports: list = []
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.reports = feed_elastic(frame, broker.feed, checkpoints, EPOCHS, stream=stream, shuffle_seed=7,
                                            key=["id"], partitions=PARTITIONS, batch_size=BATCH, timeout=30,
                                            pack_bytes=0, poll=0.2, idle_timeout=RUN_SECONDS)
            except BaseException as exc:        # checked by the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def finish(self) -> list:
        self.thread.join(60)
        assert not self.thread.is_alive(), "feed_elastic did not return after the ranks were done"
        assert self.error is None, repr(self.error)
        return self.reports


def torchrun(children: Children, broker, checkpoints: Path, out: Path, stream: str, ranks: int, restarts: int,
             *flags: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", f"--nproc-per-node={ranks}",
               f"--max-restarts={restarts}", "--monitor-interval=0.2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={stream}-{ranks}", EXAMPLE,
               "--ranks", broker.ranks, "--checkpoints", checkpoints,
               "--stream", stream, "--epochs", str(EPOCHS), "--features", str(FEATURES), "--timeout", "30",
               "--checkpoint-every", "5", "--out", out, *flags]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "torchrun.log", "w") as log:      # the ranks' output, read when the job fails
        return children.spawn(command, stdout=log, stderr=subprocess.STDOUT, env=TORCHRUN_ENV)


def finish(job: subprocess.Popen, out: Path, what: str) -> int:
    """torchrun's exit status once it ended within ``RUN_SECONDS`` (else it is killed and the test fails)."""
    try:
        Children.finish(job, RUN_SECONDS, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{(out / 'torchrun.log').read_text()[-8000:]}") from None
    return job.returncode


def ids(path: Path) -> np.ndarray:
    with np.load(path) as data:
        return data["id"]


def assert_every_row_once(trained: np.ndarray) -> None:
    values, counts = np.unique(trained, return_counts=True)
    twice, lost = values[counts > 1], np.setdiff1d(np.arange(ROWS), values)
    assert not len(twice) and not len(lost), (f"{len(twice)} rows trained twice (e.g. {twice[:10].tolist()}), "
                                              f"{len(lost)} lost (e.g. {lost[:10].tolist()})")
    assert len(trained) == ROWS


def check_resumed(old: Path, old_ranks: int, new: Path, new_ranks: int) -> str:
    """The rows the old group had trained at the checkpoint the new group resumed from, plus those the new group
    trained of that epoch, are every row once; every later epoch is every row once; the new group's steps are equal
    per epoch. Returns the checkpoint's name."""
    figures = [json.loads((new / f"rank{r}.json").read_text()) for r in range(new_ranks)]
    checkpoint = figures[0]["resumed_from"]
    assert checkpoint and {f["resumed_from"] for f in figures} == {checkpoint}
    assert checkpoint.endswith("-e0-s5"), checkpoint          # epoch 0, after 5 steps a rank
    before = [ids(old / f"rank{r}-{checkpoint}.npz") for r in range(old_ranks)]
    assert [len(b) for b in before] == [5 * BATCH] * old_ranks
    after = [ids(new / f"rank{r}-epoch0.npz") for r in range(new_ranks)]
    assert_every_row_once(np.concatenate([*before, *after]))
    for epoch in range(1, EPOCHS):
        assert_every_row_once(np.concatenate([ids(new / f"rank{r}-epoch{epoch}.npz") for r in range(new_ranks)]))
    for epoch in range(EPOCHS):
        steps = [f["epochs"][epoch]["batches"] for f in figures]
        assert len(set(steps)) == 1 and steps[0] > 0, (epoch, steps)
    assert [f["epochs"][0]["resumed_batches"] for f in figures] == [5] * new_ranks
    return checkpoint


def served(checkpoints: Path, stream: str) -> list[dict]:
    """The groups' requests, in order, once the feed of ``stream`` has served every one."""
    requests = sorted((checkpoints / "requests").glob("*.json"))
    assert all(p.with_name(f"{p.stem}.{stream}.served").exists() for p in requests)
    return [json.loads(p.read_text()) for p in requests]


def test_a_rank_killed_mid_epoch_is_restarted_by_torchrun_and_every_row_is_trained_once(spark, start_broker_process,
                                                                                        children, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="sparkbus.feeder")
    # a broker buffer of ~10 batches: the feed of epoch 0 is still running, held back, when the rank dies, and the
    # resume cancels it
    broker = start_broker_process("--heartbeat", "200ms", "--dead-after", "2s", "--max-buffer", "48KiB")
    checkpoints, out = tmp_path / "checkpoints", tmp_path / "out"
    feed = ElasticFeed(spark, broker, checkpoints, "elastic-restart")
    job = torchrun(children, broker, checkpoints, out, "elastic-restart", 2, 1, "--kill-rank", "1",
                   "--kill-after", "8")
    assert finish(job, out, "torchrun") == 0, (out / "torchrun.log").read_text()[-8000:]
    reports = feed.finish()
    assert not (out / "attempt0" / "rank1.json").exists()       # the first attempt died
    check_resumed(out / "attempt0", 2, out / "attempt1", 2)
    requests = served(checkpoints, "elastic-restart")
    assert [(r["ranks"], r["checkpoint"] is None) for r in requests] == [(2, True), (2, False)], requests
    assert [r.rows for r in reports][-EPOCHS:] == [ROWS] * EPOCHS      # the resumed epoch and the next, fed whole
    assert "cancelling the running feed" in caplog.text        # the first feed was still held back by the broker


def test_a_checkpoint_of_two_ranks_resumes_on_three_under_torchrun(spark, start_broker_process, children, tmp_path):
    broker = start_broker_process("--heartbeat", "200ms", "--dead-after", "2s")
    checkpoints = tmp_path / "checkpoints"
    feed = ElasticFeed(spark, broker, checkpoints, "elastic-resize")
    first = torchrun(children, broker, checkpoints, tmp_path / "two", "elastic-resize", 2, 0, "--kill-rank", "1",
                     "--kill-after", "8")
    assert finish(first, tmp_path / "two", "torchrun of 2 ranks") != 0, "the first job should have lost a rank"
    second = torchrun(children, broker, checkpoints, tmp_path / "three", "elastic-resize", 3, 0)
    assert finish(second, tmp_path / "three", "torchrun of 3 ranks") == 0, \
        (tmp_path / "three" / "torchrun.log").read_text()[-8000:]
    reports = feed.finish()
    check_resumed(tmp_path / "two" / "attempt0", 2, tmp_path / "three" / "attempt0", 3)
    requests = served(checkpoints, "elastic-resize")
    assert [(r["ranks"], r["checkpoint"] is None) for r in requests] == [(2, True), (3, False)], requests
    assert [r.rows for r in reports][-EPOCHS:] == [ROWS] * EPOCHS


# ---- the checkpoint directory alone (no broker, no Spark, no torch): what each start of a group asks for ----------

class FakeStream:
    """Stands in for a BatchStream: its name and a state_dict() at ``epoch`` after ``steps`` steps."""

    def __init__(self, stream: str, rank: int, size: int, epoch: int, steps: int) -> None:
        self.stream = stream
        self.state = {"format": 2, "stream": stream, "rank": rank, "size": size, "epoch": epoch, "steps": steps,
                      "used": [[0, s, 0, 1, s] for s in range(steps)], "cuts": []}

    def state_dict(self) -> dict:
        return dict(self.state)


def test_each_start_of_a_group_asks_for_what_it_resumes_from(tmp_path):
    from sparkbus import ElasticCheckpoints
    from sparkbus.worker.checkpoint import latest, mark_served, pending_request

    first = ElasticCheckpoints(tmp_path, rank=0, size=1)
    assert first.resume("train") is None and first.load_payload() is None
    first.joined()
    request = pending_request(tmp_path, "train")
    assert request is not None and request.resumes == {"train": None} and request.ranks == 1
    mark_served(request, "train")
    assert pending_request(tmp_path, "train") is None
    assert pending_request(tmp_path, "val") is not None          # another stream's feed serves it too

    # restarted before any checkpoint: the first epoch again, nothing used
    early = ElasticCheckpoints(tmp_path, rank=0, size=1)
    assert early.resume("train", first_epoch=2) == [{"format": 2, "stream": "train", "rank": 0, "size": 1,
                                                     "epoch": 2, "steps": 0, "used": [], "cuts": []}]
    early.joined()
    assert pending_request(tmp_path, "train").resumes == {"train": 2}

    # two ranks' states saved (as rank 0 gathers them), resumed by a group of three
    others = [FakeStream("train", 1, 2, 0, 5).state_dict()]
    two = ElasticCheckpoints(tmp_path, rank=0, size=2, gather=lambda obj: [obj, *(json.dumps({"train": o})
                                                                                   for o in others)])
    name = two.save([FakeStream("train", 0, 2, 0, 5)])
    assert latest(tmp_path) == name and name.endswith("-e0-s5")
    three = ElasticCheckpoints(tmp_path, rank=0, size=3)
    states = three.resume("train")
    assert [(s["rank"], s["size"], s["steps"]) for s in states] == [(0, 2, 5), (1, 2, 5)]
    three.joined()
    newest = pending_request(tmp_path, "train")               # the early restart's request: superseded
    assert newest.ranks == 3 and newest.checkpoint == name and newest.resumes["train"] == states
    with pytest.raises(ValueError, match="no state of stream 'val'"):
        three.resume("val")


def test_only_the_newest_checkpoints_are_kept_and_a_payload_travels_with_its_positions(tmp_path):
    torch = pytest.importorskip("torch")
    from sparkbus import ElasticCheckpoints

    ckpt = ElasticCheckpoints(tmp_path, rank=0, size=1, keep=2)
    names = [ckpt.save([FakeStream("train", 0, 1, 0, steps)], {"w": torch.full((2,), float(steps))})
             for steps in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == names[1:]
    resumed = ElasticCheckpoints(tmp_path, rank=0, size=1)
    assert resumed.resume("train") is None                   # no group started here: a first start
    ckpt.joined()
    again = ElasticCheckpoints(tmp_path, rank=0, size=1)
    assert again.resume("train")[0]["steps"] == 3 and again.checkpoint == names[-1]
    assert again.load_payload()["w"].tolist() == [3.0, 3.0]
