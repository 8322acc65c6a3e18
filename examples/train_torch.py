"""Data-parallel training of a small PyTorch MLP on batches Spark streams through a sparkbus broker.

Ranks (gradients averaged with a non-blocking MPI allreduce every step, validation on a second stream):

    mpiexec -n 2 python examples/train_torch.py --ranks tcp://127.0.0.1:5556 --val-stream torch-example-val --epochs 3

Feed (the Spark side, in any order with the ranks; a synthetic classification set, reshuffled every epoch):

    python examples/train_torch.py --feed tcp://127.0.0.1:5555 --val-stream torch-example-val --epochs 3 --rows 200000

Per epoch (``epoch 0 (1 of 3)``: numbered from 0, as the API numbers epochs) rank 0 prints loss and accuracy
(train and validation), every rank's start-up (its wait for the epoch's first batch: in the first epoch, Spark's)
and its data wait: the time its training loop waited for batches after the first, out of the epoch's time after
the first batch. ``--summary FILE`` writes all figures as JSON.

Checkpoints resume exactly. ``--checkpoint FILE`` saves, after every epoch (and every ``--checkpoint-every N``
steps of an epoch, without a shuffle buffer), the model, the optimizer and every rank's position: its
``BatchStream.state_dict()`` of the training and the validation stream, gathered to rank 0 as JSON bytes and
written with the model in one atomic file. After a crash, stop the old job (ranks and feed), then start both
with ``--resume-from FILE`` (the file readable by every rank and by the feed), whether the broker kept running or
restarted too:

    python examples/train_torch.py --feed tcp://127.0.0.1:5555 --val-stream torch-example-val --epochs 3 \
        --resume-from ckpt.pt
    mpiexec -n 2 python examples/train_torch.py --ranks tcp://127.0.0.1:5556 --val-stream torch-example-val \
        --epochs 3 --checkpoint ckpt.pt --resume-from ckpt.pt

The feed re-feeds the checkpoint's epoch (``feed_epochs(..., resume=state)``) and the brokers deliver only what
the checkpointed model has not trained; each rank starts from its own position (``BatchStream(...,
resume=state)``). The conditions are in docs/TRAINING.md, "Resuming".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.cli_help import HelpFormatter
from sparkbus.feeder import feed, feed_epochs  # none of these imports pyspark, torch or MPI
from sparkbus.progress import EpochTimes, epoch_label, waited_line
from sparkbus.worker import BatchStream
from sparkbus.worker.collectives import abort_on_error, allreduce, wait
from sparkbus.worker.torch_data import to_tensors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--ranks", help="train: the broker's ranks address (run under mpiexec)")
    side.add_argument("--feed", help="feed: the broker's feed address (runs the Spark job)")
    parser.add_argument("--stream", default="torch-example",
                        help="the training stream (the same on both sides; each example has its own, so that two "
                             "on one broker never take each other's batches)")
    parser.add_argument("--val-stream", help="the validation stream (default: no validation)")
    parser.add_argument("--epochs", type=int, default=3, help="total epochs of the run (resumed ones included)")
    parser.add_argument("--features", type=int, default=32, help="float32 features per row")
    parser.add_argument("--classes", type=int, default=4, help="classes of the synthetic set")
    parser.add_argument("--seed", type=int, default=7, help="data and shuffle seed (feed), weights seed (ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    parser.add_argument("--resume-from", metavar="FILE",
                        help="a --checkpoint file: the ranks restore the model and each its own position; the feed "
                             "feeds the checkpoint's epoch again (the brokers deliver only what the model has not "
                             "trained) and the epochs after it")
    train = parser.add_argument_group("training (--ranks)")
    train.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    train.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    train.add_argument("--prefetch", type=int, default=4, help="batches in flight to each rank")
    train.add_argument("--shuffle-buffer", type=int, default=0,
                       help="mix rows across this many batches per rank (above 1: checkpoints at epoch ends only)")
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    train.add_argument("--checkpoint", metavar="FILE",
                       help="after every epoch, rank 0 saves here the model, the optimizer and every rank's position")
    train.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                       help="also save every N steps of an epoch (0: at epoch ends only). Needs --shuffle-buffer 0 "
                            "or 1: a shuffle buffer holds rows the model has not trained, so a position mid-epoch "
                            "would not be exact")
    train.add_argument("--summary", help="rank 0 writes the run's figures here as JSON")
    feed = parser.add_argument_group("feeding (--feed)")
    feed.add_argument("--rows", type=int, default=100_000, help="training rows")
    feed.add_argument("--val-rows", type=int, default=10_000, help="validation rows (with --val-stream)")
    feed.add_argument("--batch-size", type=int, default=256, help="rows per batch")
    feed.add_argument("--partitions", type=int, default=4, help="Spark partitions of each epoch")
    feed.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"),
                      help="Spark master (SPARK_MASTER)")
    args = parser.parse_args(argv)
    if args.checkpoint_every and args.shuffle_buffer > 1:
        parser.error("--checkpoint-every needs --shuffle-buffer 0 or 1: a shuffle buffer holds rows the model has "
                     "not trained, so a position mid-epoch would not be exact (checkpoints at epoch ends are)")
    return args


# ---- the Spark side -------------------------------------------------------------------------------------------

def synthetic_frame(spark: Any, rows: int, features: int, classes: int, seed: int, partitions: int,
                    first_id: int = 0) -> Any:
    """``id long, features array<float>, label int``: uniform features in [-1, 1) hashed from (seed, id, j),
    labelled by a fixed random linear teacher (argmax of ``x @ W``). Pure Spark SQL: no Python on executors,
    and every value follows from its id, so the set is the same however it is partitioned."""
    from pyspark.sql import functions as F

    teacher = np.random.default_rng([seed, 1]).standard_normal((features, classes))
    unit = float(1 << 24)
    x = [(F.pmod(F.xxhash64(F.lit(seed), F.col("id"), F.lit(j)), F.lit(1 << 24)) / unit * 2 - 1).cast("float")
         for j in range(features)]
    base = spark.range(first_id, first_id + rows, numPartitions=partitions).select("id", F.array(*x).alias("x"))
    scores = F.array(*[sum(F.col("x")[j] * float(teacher[j, c]) for j in range(features)) for c in range(classes)])
    label = (F.array_position(scores, F.array_max(scores)) - 1).cast("int")
    return base.select("id", F.col("x").alias("features"), label.alias("label"))


def feed_training_data(spark: Any, address: str, epochs: int, *, stream: str = "torch-example",
                       val_stream: str | None = None, rows: int = 100_000, val_rows: int = 10_000,
                       features: int = 32, classes: int = 4, seed: int = 7, partitions: int = 4,
                       batch_size: int = 256, resume: Mapping[str, Any] | None = None,
                       timeout: float = 120.0) -> list[dict]:
    """Feed epochs up to ``epochs - 1``: the training set reshuffled per epoch, then the validation set.

    Training and validation epochs alternate (train e, val e, train e + 1, ...): the ranks validate after each
    epoch, so feeding validation in step keeps the shared broker buffer from filling with validation batches
    while the ranks wait for training ones.

    A resume starts at the checkpoint's epoch E. Training epoch E is fed through ``feed_epochs(...,
    resume=state)``: the brokers drop what they had of it, delivered or not, and deliver only what no rank's
    checkpointed position used. Validation epoch E is fed again through a reset too (``feed(..., resume=True)``),
    whole: the ranks saved their validation stream's position with the checkpoint, which is always between
    validation epochs (E next, nothing used; the ranks validate E after training it, and checkpoint after that),
    so the reset drops whatever the old job's feed had sent of it (maybe all, maybe part, maybe none, maybe
    delivered to the old ranks) and the resumed ranks see every validation row of E once. The same stream names
    stay, and neither side needs to know what the broker kept. The epochs after E are fed as usual.

    Args:
        spark: the SparkSession; address: the broker's feed address; epochs: feed up to this epoch, exclusive.
        stream, val_stream: stream names (no validation if ``val_stream`` is None).
        rows, val_rows, features, classes, seed: the synthetic set (see :func:`synthetic_frame`); the
            validation rows have other ids, hence other values, from the same teacher.
        partitions, batch_size: tasks per training epoch and rows per batch.
        resume: one rank's position from a checkpoint (an entry of :func:`load_positions`: ``{"train": state,
            "val": state or None}``): feed from its epoch on, as above. None: feed from epoch 0.
        timeout: passed to ``feed``: bounds every wait, a task blocked by backpressure included.
    Returns:
        One dict per epoch: the epoch number and the FeedReport (as a dict) of each stream.
    Raises:
        BrokerError, FeedError: as ``feeder.feed``. ValueError: a ``resume`` state of another stream.
    """
    train = synthetic_frame(spark, rows, features, classes, seed, partitions).cache()
    train.count()
    val = synthetic_frame(spark, val_rows, features, classes, seed, 1, first_id=1 << 40).cache() \
        if val_stream else None
    first = resume["train"]["epoch"] if resume else 0
    val_state = resume.get("val") if resume else None       # None: the checkpoint's run had no validation
    if val_state is not None and val_stream and val_state["stream"] != val_stream:
        raise ValueError(f"the checkpoint validated on stream {val_state['stream']!r}, not {val_stream!r}")
    val_again = val_state["epoch"] if val_state is not None else -1
    if resume:
        print(resumed_line("the feed", resume["train"], epochs), flush=True)
    fed = []
    for epoch in range(first, epochs):
        report = feed_epochs(train, address, 1, stream=stream, shuffle_seed=seed, first_epoch=epoch,
                             key=["id"], partitions=partitions, batch_size=batch_size, timeout=timeout,
                             resume=resume["train"] if resume and epoch == first else None)[0]
        entry = {"epoch": epoch, stream: report._asdict()}
        if val_stream:
            entry[val_stream] = feed(val, address, stream=val_stream, epoch=epoch, batch_size=batch_size,
                                     timeout=timeout, resume=epoch == val_again)._asdict()
        fed.append(entry)
        print(f"fed {epoch_label(epoch, epochs)}: {report.rows:,} rows in {report.batches} batches in "
              f"{report.seconds:.1f} s", flush=True)
        print(waited_line(epoch, epochs, report), flush=True)
    return fed


def resumed_line(who: str, state: Mapping[str, Any], epochs: int) -> str:
    """What a resumed side prints first: from which epoch (numbered as every epoch line) and after which step."""
    return (f"{who} resumed from a checkpoint: {epoch_label(state['epoch'], epochs)}, after its step {state['steps']} "
            f"(the brokers deliver only what the checkpointed model has not trained)")


def load_positions(path: str) -> list[dict]:
    """Every rank's position saved in a ``--checkpoint`` file, in rank order: ``{"train": state, "val": state or
    None}`` with ``state`` a ``BatchStream.state_dict()``. Plain data (``torch.load(weights_only=True)``: no
    objects are unpickled); the feed imports torch only to read it."""
    import torch

    return list(torch.load(path, weights_only=True)["positions"])


@contextmanager
def example_spark(master: str, app: str) -> Iterator[Any]:
    """The SparkSession of an example's feed (its Python workers run this interpreter), stopped on the way out."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName(app)
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    try:
        yield spark
    finally:
        spark.stop()


def run_feed(args: argparse.Namespace) -> int:
    with example_spark(args.master, "sparkbus-train-torch-feed") as spark:
        feed_training_data(spark, args.feed, args.epochs, stream=args.stream, val_stream=args.val_stream,
                           rows=args.rows, val_rows=args.val_rows, features=args.features, classes=args.classes,
                           seed=args.seed, partitions=args.partitions, batch_size=args.batch_size,
                           resume=load_positions(args.resume_from)[0] if args.resume_from else None,
                           timeout=args.timeout)
    return 0


# ---- the ranks ------------------------------------------------------------------------------------------------

class Trainer:
    """The model, its optimizer, and one flat buffer through which each step's gradients are summed over MPI."""

    def __init__(self, comm: Any, args: argparse.Namespace):
        import torch

        self.comm, self.args, self.torch = comm, args, torch
        torch.manual_seed(args.seed)                           # the same initial weights on every rank
        self.model = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(args.hidden, args.classes))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.params = list(self.model.parameters())
        self.size = sum(p.numel() for p in self.params)
        self.flat = np.zeros(self.size + 1, dtype=np.float32)    # gradients of the summed loss, then rows
        self.flat_t = torch.from_numpy(self.flat)

    def step(self, x: Any, y: Any) -> tuple[float, int]:
        """One data-parallel step; returns this rank's summed loss and correct predictions."""
        torch = self.torch
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        offset = 0
        for p in self.params:
            self.flat_t[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        self.flat[-1] = len(y)
        summed = self.torch.from_numpy(allreduce(self.comm, self.flat))   # Iallreduce + Test + sleep: no spinning
        total = float(summed[-1])
        offset = 0
        for p in self.params:                                   # the mean over every rank's rows of this step
            p.grad.copy_(summed[offset:offset + p.numel()].view_as(p)).div_(total)
            offset += p.numel()
        self.optimizer.step()
        return float(loss.detach()), int((logits.argmax(1) == y).sum())

    def evaluate(self, x: Any, y: Any) -> tuple[float, int]:
        torch = self.torch
        with torch.no_grad():
            logits = self.model(x)
            return (float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")),
                    int((logits.argmax(1) == y).sum()))

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.params))

    def save(self, path: str, positions: list[dict]) -> None:
        """Rank 0: the model, the optimizer and every rank's position, in one file written atomically."""
        tmp = f"{path}.tmp"
        train = positions[0]["train"]
        self.torch.save({"epoch": train["epoch"], "steps": train["steps"], "positions": positions,
                         "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, tmp)
        os.replace(tmp, path)                                   # a crash never leaves half a checkpoint

    def resume(self, path: str) -> dict:
        """Restore the weights and the optimizer from a checkpoint; returns this rank's position in it.

        Raises:
            SystemExit: the checkpoint was written by a group of another size (each rank's position is its own).
        """
        state = self.torch.load(path, weights_only=True)       # plain data and tensors only: nothing unpickled
        if len(state["positions"]) != self.comm.size:
            raise SystemExit(f"--resume-from {path}: written by {len(state['positions'])} ranks, resumed by "
                             f"{self.comm.size}: an exact resume needs the same group size")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return dict(state["positions"][self.comm.rank])


def gather(comm: Any, values: list[float]) -> np.ndarray:
    """Every rank's ``values`` as a ``[size, len(values)]`` array on every rank, without a busy-wait."""
    send = np.asarray(values, dtype=np.float64)
    recv = np.empty((comm.size, len(values)), dtype=np.float64)
    wait(comm.Iallgather(send, recv))
    return recv


def gather_bytes(comm: Any, data: bytes) -> list[bytes] | None:
    """Every rank's ``data`` on rank 0, in rank order (None on the others): raw bytes, never a pickle (mpi4py's
    lowercase ``gather`` pickles), without a busy-wait."""
    from mpi4py import MPI

    sizes = gather(comm, [len(data)])[:, 0].astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    recv = np.empty(int(sizes.sum()), dtype=np.uint8) if comm.rank == 0 else None
    spec = [recv, sizes.tolist(), offsets.tolist(), MPI.BYTE] if recv is not None else None
    wait(comm.Igatherv(np.frombuffer(data, dtype=np.uint8), spec, root=0))
    if recv is None:
        return None
    return [recv[o:o + n].tobytes() for o, n in zip(offsets, sizes)]


def checkpoint(trainer: Trainer, train: BatchStream, val: BatchStream | None) -> None:
    """Every rank (a collective, at the same step): gather each rank's position to rank 0, which saves it with
    the model. Positions travel as JSON: ``state_dict()`` is plain data, and the other ranks' bytes are not to be
    unpickled."""
    if not trainer.args.checkpoint:
        return
    mine = {"train": train.state_dict(), "val": val.state_dict() if val is not None else None}
    gathered = gather_bytes(trainer.comm, json.dumps(mine).encode())
    if gathered is not None:
        trainer.save(trainer.args.checkpoint, [json.loads(b) for b in gathered])


def train_epoch(trainer: Trainer, loader: Any, train: BatchStream, val: BatchStream | None, resumed: int) -> dict:
    """One pass over the loader: what the brokers deliver of the epoch (with a resume: what the checkpointed
    model has not trained; ``resumed`` steps were taken before the checkpoint). Checkpoints every
    ``--checkpoint-every`` steps of the epoch (counted with those ``resumed``): the state is taken between
    steps, so the batch just trained counts as used."""
    steps = 0
    every = trainer.args.checkpoint_every
    totals = np.zeros(3)                                        # summed loss, correct, rows on this rank
    for x, y in loader:
        loss, correct = trainer.step(x, y)
        totals += (loss, correct, len(y))
        steps += 1
        if every and (resumed + steps) % every == 0:
            checkpoint(trainer, train, val)
    loss, correct, rows = allreduce(trainer.comm, totals)
    return {"steps": steps, "resumed_steps": resumed, "rows": int(rows), "loss": loss / max(rows, 1),
            "accuracy": correct / max(rows, 1)}


def validate(trainer: Trainer, stream: Any) -> dict:
    """This rank's share of the validation epoch (uneven shares are fine: no per-batch collective)."""
    totals = np.zeros(3)
    for batch in stream.epoch():
        t = to_tensors(batch)                                   # zero-copy, read-only: evaluation only reads
        loss, correct = trainer.evaluate(t["features"], t["label"].long())
        totals += (loss, correct, len(batch["label"]))
    loss, correct, rows = allreduce(trainer.comm, totals)
    return {"val_rows": int(rows), "val_loss": loss / max(rows, 1), "val_accuracy": correct / max(rows, 1)}


def run_ranks(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI
    from torch.utils.data import DataLoader

    from sparkbus.worker.torch_data import StreamDataset

    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    trainer = Trainer(comm, args)
    position = trainer.resume(args.resume_from) if args.resume_from else None
    train_resume = position["train"] if position else None
    val_resume = position.get("val") if position and args.val_stream else None
    first_epoch = train_resume["epoch"] if train_resume else 0
    history, started = [], time.monotonic()
    if train_resume and comm.rank == 0:
        print(resumed_line(f"the ranks ({args.resume_from})", train_resume, args.epochs), flush=True)
    with ExitStack() as stack:
        train = stack.enter_context(BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch,
                                                timeout=args.timeout, resume=train_resume))
        val = stack.enter_context(BatchStream(args.ranks, comm=comm, stream=args.val_stream, even=False,
                                              prefetch=args.prefetch, timeout=args.timeout, resume=val_resume)) \
            if args.val_stream else None
        dataset = StreamDataset(train, transform=lambda b: (b["features"], b["label"].long()),
                                shuffle_buffer=args.shuffle_buffer, shuffle_seed=args.seed, epoch=first_epoch)
        loader = DataLoader(dataset, batch_size=None, num_workers=0)   # the socket lives in this process
        for epoch in range(first_epoch, args.epochs):
            resumed = train_resume["steps"] if train_resume and epoch == first_epoch else 0
            result = train_epoch(trainer, loader, train, val, resumed)
            ep = train.stats.epochs[-1]
            if val is not None:
                result.update(validate(trainer, val))
            checkpoint(trainer, train, val)                     # after validating: both streams between epochs
            per_rank = gather(comm, [ep.wait_seconds, ep.seconds, ep.batches, ep.dropped_batches, ep.epoch,
                                     ep.resumed_batches, ep.first_batch_seconds])
            result.update(epoch=epoch, broker_epoch=int(per_rank[0, 4]), wait_seconds=per_rank[:, 0].tolist(),
                          seconds=per_rank[:, 1].tolist(), batches=per_rank[:, 2].astype(int).tolist(),
                          dropped_batches=per_rank[:, 3].astype(int).tolist(),
                          resumed_batches=per_rank[:, 5].astype(int).tolist(),
                          first_batch_seconds=per_rank[:, 6].tolist())
            history.append(result)
            if comm.rank == 0:
                print(epoch_line(result, args.epochs), flush=True)
    checksums = gather(comm, [trainer.checksum()])[:, 0].tolist()
    if comm.rank == 0:
        resumed_from = [train_resume["epoch"], train_resume["steps"]] if train_resume else None
        summary = make_summary(history, checksums, comm.size, resumed_from, time.monotonic() - started)
        print(summary_lines(summary), flush=True)
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=2))
    return 0


def rank_times(r: dict) -> list[EpochTimes]:
    """Every rank's share of one epoch's figures (as :func:`run_ranks` gathers them), split at its first batch."""
    return [EpochTimes.split(*f) for f in zip(r["wait_seconds"], r["first_batch_seconds"], r["seconds"])]


def epoch_line(r: dict, epochs: int) -> str:
    """Rank 0's line for one epoch: the model's figures, every rank's start-up (its wait for the epoch's first batch:
    in the first epoch, Spark's) and its data wait after the first batch, out of the time after it."""
    times = rank_times(r)
    start_up = ", ".join(f"r{i} {t.start_up:.2f} s" for i, t in enumerate(times))
    waits = ", ".join(f"r{i} {t.waited:.2f} s of {t.streaming:.2f} s ({t.wait_share:.0%})" for i, t in enumerate(times))
    val = f" | val loss {r['val_loss']:.4f} acc {r['val_accuracy']:.1%}" if "val_accuracy" in r else ""
    resumed = f" (+{r['resumed_steps']} before the checkpoint)" if r["resumed_steps"] else ""
    return (f"{epoch_label(r['epoch'], epochs)}: {r['steps']} steps{resumed}, {r['rows']:,} rows, "
            f"loss {r['loss']:.4f} acc {r['accuracy']:.1%}{val} | start-up {start_up} | data wait {waits}")


def make_summary(history: list[dict], checksums: list[float], size: int, resumed: list[int] | None,
                 seconds: float) -> dict:
    """The run's figures; ``data_wait`` per rank over every epoch, after each epoch's first batch (its
    ``start_up_seconds`` apart)."""
    times = np.array([[(t.start_up, t.waited, t.streaming) for t in rank_times(h)] for h in history]) \
        if history else np.zeros((1, size, 3))
    start_up, waits, spans = times.sum(axis=0).T
    return {"ranks": size, "epochs": history, "resumed_from": resumed, "seconds": seconds,
            "data_wait": {"seconds": waits.tolist(), "of_seconds": spans.tolist(),
                          "share": (waits / np.maximum(spans, 1e-9)).tolist(),
                          "start_up_seconds": start_up.tolist()},
            "param_checksums": checksums,
            "final": {k: history[-1][k] for k in ("loss", "accuracy", "val_loss", "val_accuracy")
                      if history and k in history[-1]}}


def summary_lines(s: dict) -> str:
    waits = ", ".join(f"rank {r} {w:.2f} s of {t:.2f} s ({w / max(t, 1e-9):.0%})"
                      for r, (w, t) in enumerate(zip(s["data_wait"]["seconds"], s["data_wait"]["of_seconds"])))
    start_up = ", ".join(f"rank {r} {u:.2f} s" for r, u in enumerate(s["data_wait"]["start_up_seconds"]))
    final = ", ".join(f"{k} {v:.4f}" for k, v in s["final"].items())
    return f"trained {len(s['epochs'])} epochs on {s['ranks']} ranks in {s['seconds']:.1f} s: {final}\n" \
           f"data wait: {waits}, after each epoch's start-up ({start_up})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.feed:
        return run_feed(args)
    with abort_on_error():                             # never leave the other ranks waiting in a collective
        return run_ranks(args)


if __name__ == "__main__":
    sys.exit(main())
