"""Data-parallel training with PyTorch DistributedDataParallel on batches streamed through a sparkbus broker,
the ranks started by torchrun: no MPI, no mpi4py.

Ranks (gloo on CPU here; NCCL on GPUs works the same way):

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        examples/train_ddp.py --ranks tcp://127.0.0.1:5556 --epochs 3

Feed, in any order with the ranks. With Spark (local mode here; the synthetic set of examples/train_torch.py,
reshuffled every epoch):

    python examples/train_ddp.py --feed tcp://127.0.0.1:5555 --epochs 3 --rows 200000

or without Spark, for a quick try (numpy batches pushed by the feeder's task code, as a Spark task would):

    python examples/train_ddp.py --feed tcp://127.0.0.1:5555 --epochs 3 --no-spark

Each rank reads ``BatchStream(address, rank="auto")``: rank and size come from the initialised
``torch.distributed`` group, and the broker grants every rank the same number of steps each epoch, so DDP's
allreduce never waits for a rank that ran out of data. Rank 0 prints per epoch (``epoch 0 (1 of 3)``, numbered
as the API numbers epochs) the steps of every rank, the loss over all ranks' rows, every rank's start-up (its wait
for the epoch's first batch: in the first epoch, Spark's) and its data wait after the first batch; at the end it
checks that the weights are identical on every rank. ``--out DIR`` has every rank write its figures to
``DIR/rank<r>.json`` (and, with ``--record-ids``, the ids it trained on and those dropped to keep the ranks even,
per epoch, to ``DIR/rank<r>-epoch<e>.npz``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.cli_help import HelpFormatter
from sparkbus.progress import EpochTimes, epoch_label, fed_lines
from sparkbus.worker import BatchStream


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--ranks", help="train: the broker's ranks address (run under torchrun)")
    side.add_argument("--feed", help="feed: the broker's feed address")
    parser.add_argument("--control", help="the broker's control address (default: the feed port + 2)")
    parser.add_argument("--stream", default="ddp-example",
                        help="the stream (the same on both sides; each example has its own, so that two on one broker "
                             "never take each other's batches)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (the same on both sides)")
    parser.add_argument("--features", type=int, default=32, help="float32 features per row")
    parser.add_argument("--classes", type=int, default=4, help="classes of the synthetic set")
    parser.add_argument("--seed", type=int, default=7, help="data and shuffle seed (feed), weights seed (ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    train = parser.add_argument_group("training (--ranks)")
    train.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    train.add_argument("--lr", type=float, default=0.05, help="learning rate")
    train.add_argument("--prefetch", type=int, default=4, help="batches in flight to each rank")
    train.add_argument("--shuffle-buffer", type=int, default=0, help="mix rows across this many batches per rank")
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    train.add_argument("--out", type=Path, help="every rank writes its figures here (rank<r>.json)")
    train.add_argument("--record-ids", action="store_true",
                       help="with --out: also the ids trained on and dropped, per epoch (rank<r>-epoch<e>.npz)")
    train.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-seconds every step")
    train.add_argument("--slow-seconds", type=float, default=0.0, help="see --slow-rank")
    feeding = parser.add_argument_group("feeding (--feed)")
    feeding.add_argument("--rows", type=int, default=100_000, help="rows of the synthetic set")
    feeding.add_argument("--batch-size", type=int, default=256, help="rows per batch")
    feeding.add_argument("--partitions", type=int, default=4, help="Spark partitions of each epoch")
    feeding.add_argument("--no-spark", action="store_true",
                         help="feed numpy batches through the feeder's task code instead of a Spark job")
    feeding.add_argument("--pack-bytes", type=int, default=None,
                         help="pack consecutive small batches up to this many bytes (default: the feeder's)")
    feeding.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"),
                         help="Spark master (SPARK_MASTER)")
    return parser.parse_args(argv)


# ---- the feed side ------------------------------------------------------------------------------------------

def run_feed(args: argparse.Namespace) -> int:
    """Feed ``--epochs`` epochs of the synthetic set, reshuffled every epoch, with Spark or without."""
    cutting = {} if args.pack_bytes is None else {"pack_bytes": args.pack_bytes}
    if args.no_spark:
        for epoch in range(args.epochs):
            rows, batches, seconds = feed_numpy_epoch(args.feed, args.control, args.stream, epoch, args.rows,
                                                      args.features, args.classes, args.seed, args.partitions,
                                                      args.batch_size, args.timeout, **cutting)
            print(f"fed {epoch_label(epoch, args.epochs)}: {rows:,} rows in {batches} batches in {seconds:.1f} s",
                  flush=True)
        return 0
    if __package__:     # python -m sparkbus.examples.train_ddp (installed)
        from sparkbus.examples.train_torch import example_spark, synthetic_frame
    else:               # python examples/train_ddp.py: examples/train_torch.py, beside this file
        from train_torch import example_spark, synthetic_frame

    from sparkbus.feeder import feed_epochs

    with example_spark(args.master, "sparkbus-train-ddp-feed") as spark:
        train = synthetic_frame(spark, args.rows, args.features, args.classes, args.seed, args.partitions).cache()
        train.count()
        feed_epochs(train, args.feed, args.epochs, stream=args.stream, shuffle_seed=args.seed, key=["id"],
                    batch_size=args.batch_size, timeout=args.timeout, control=args.control,
                    on_epoch=lambda e, r: print(fed_lines(e, args.epochs, r), flush=True), **cutting)
    return 0


def synthetic_rows(rows: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features uniform in [-1, 1) and labels from a fixed random linear teacher (argmax of ``x @ W``): a target
    a small network learns. Row ``id`` is row ``id`` of these arrays."""
    x = np.random.default_rng([seed, 0]).uniform(-1, 1, (rows, features)).astype(np.float32)
    teacher = np.random.default_rng([seed, 1]).standard_normal((features, classes))
    return x, (x @ teacher).argmax(1).astype(np.int32)


def feed_numpy_epoch(address: str, control: str | None, stream: str, epoch: int, rows: int, features: int,
                     classes: int, seed: int, partitions: int, batch_size: int, timeout: float,
                     **cutting: Any) -> tuple[int, int, float]:
    """One epoch without Spark, as ``feeder.feed`` runs it: open the epoch with its partition count, push each
    partition's batches (ids reshuffled per epoch, ``id long, features float[features], label int``) and close.

    Returns:
        ``(rows, batches, seconds)`` fed.
    """
    from sparkbus.broker.client import ControlClient
    from sparkbus.feeder import stream_partition
    from sparkbus.wire.address import feed_and_control_addresses
    from sparkbus.wire.protocol import Kind

    started = time.monotonic()
    (feed,), (ctl,) = feed_and_control_addresses(address, control)
    x, y = synthetic_rows(rows, features, classes, seed)
    order = np.random.default_rng([seed, 2, epoch]).permutation(rows)
    batches = 0
    with ControlClient(ctl, timeout) as client:
        client.request(Kind.EPOCH_OPEN, stream=stream, epoch=epoch, partitions=partitions, delivery="stream")
        for part, ids in enumerate(np.array_split(order, partitions)):
            cut = [ids[i:i + batch_size] for i in range(0, len(ids), batch_size)]
            report = stream_partition(({"id": b.astype(np.int64), "features": x[b], "label": y[b]} for b in cut),
                                      feed, ctl, stream, epoch, part, attempt=0, timeout=timeout, **cutting)
            batches += report.batches
        client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=epoch, partitions=partitions)
    return rows, batches, time.monotonic() - started


# ---- the ranks ----------------------------------------------------------------------------------------------

def weights_digest(model: Any) -> str:
    """SHA-256 of every parameter's bytes, in order: equal on two ranks only if their weights are bit-identical."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_ranks(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    from sparkbus.worker.torch_data import StreamDataset

    torch.set_num_threads(args.threads)
    # A bounded collective timeout: a rank left alone in an allreduce fails instead of waiting for 30 minutes.
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, args.classes))
    model = DistributedDataParallel(net)            # broadcasts rank 0's weights, averages gradients every step
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dropped: list[np.ndarray] = []
    history = []
    started = time.monotonic()
    with BatchStream(args.ranks, rank="auto", stream=args.stream, prefetch=args.prefetch, timeout=args.timeout,
                     on_drop=lambda batch: dropped.append(np.array(batch["id"]))) as train:
        dataset = StreamDataset(train, transform=lambda b: (b["features"], b["label"].long(), b["id"]),
                                shuffle_buffer=args.shuffle_buffer, shuffle_seed=args.seed)
        loader = DataLoader(dataset, batch_size=None, num_workers=0)   # the socket lives in this process
        for epoch in range(args.epochs):
            dropped.clear()
            seen: list[np.ndarray] = []
            totals = torch.zeros(3, dtype=torch.float64)            # summed loss, correct, rows
            steps = 0
            for x, y, ids in loader:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                optimizer.zero_grad()
                loss.backward()                                      # DDP's allreduce of the gradients
                optimizer.step()
                totals += torch.tensor([float(loss.detach()) * len(y), float((logits.argmax(1) == y).sum()), len(y)],
                                       dtype=torch.float64)
                steps += 1
                if args.record_ids:
                    seen.append(ids.numpy().copy())
                if rank == args.slow_rank:
                    time.sleep(args.slow_seconds)
            ep = train.stats.epochs[-1]
            dist.all_reduce(totals)
            per_rank = torch.tensor([steps, ep.dropped_batches, ep.wait_seconds, ep.seconds, ep.first_batch_seconds],
                                    dtype=torch.float64)
            gathered = [torch.zeros_like(per_rank) for _ in range(size)]
            dist.all_gather(gathered, per_rank)
            result = {"epoch": epoch, "broker_epoch": ep.epoch, "steps": steps, "batches": ep.batches,
                      "rows": ep.rows, "dropped_batches": ep.dropped_batches, "dropped_rows": ep.dropped_rows,
                      "wait_seconds": ep.wait_seconds, "seconds": ep.seconds,
                      "first_batch_seconds": ep.first_batch_seconds,
                      "all_rows": int(totals[2]), "loss": float(totals[0] / max(float(totals[2]), 1.0)),
                      "accuracy": float(totals[1] / max(float(totals[2]), 1.0)),
                      "steps_per_rank": [int(g[0]) for g in gathered]}
            history.append(result)
            if args.out and args.record_ids:
                np.savez(args.out / f"rank{rank}-epoch{epoch}.npz",
                         id=np.concatenate(seen) if seen else np.zeros(0, np.int64),
                         dropped_id=np.concatenate(dropped) if dropped else np.zeros(0, np.int64))
            if rank == 0:     # each rank's wait for its first batch (start-up), then its data wait after it
                times = [EpochTimes.split(float(g[2]), float(g[4]), float(g[3])) for g in gathered]
                start_up = ", ".join(f"r{r} {t.start_up:.2f} s" for r, t in enumerate(times))
                waits = ", ".join(f"r{r} {t.waited:.2f} s of {t.streaming:.2f} s" for r, t in enumerate(times))
                print(f"{epoch_label(epoch, args.epochs)}: steps {result['steps_per_rank']}, {result['all_rows']:,} "
                      f"rows, {int(sum(g[1] for g in gathered))} dropped, loss {result['loss']:.4f} acc "
                      f"{result['accuracy']:.1%} | start-up {start_up} | data wait {waits}", flush=True)
        first_batch = train.stats.first_batch_seconds
    digest = weights_digest(net)
    digests: list[Any] = [None] * size
    dist.all_gather_object(digests, digest)
    if args.out:
        figures = {"rank": rank, "size": size, "epochs": history, "weights_sha256": digest,
                   "first_batch_seconds": first_batch, "seconds": time.monotonic() - started}
        tmp = args.out / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, args.out / f"rank{rank}.json")
    dist.destroy_process_group()
    if rank == 0:
        same = len(set(digests)) == 1
        print(f"trained {len(history)} epochs on {size} ranks in {time.monotonic() - started:.1f} s: weights "
              f"{'identical on every rank' if same else 'DIFFER between ranks'} (sha256 {digest[:16]})", flush=True)
        if not same:
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.feed:
        return run_feed(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    status = run_ranks(args)    # an exception ends this rank; torchrun then stops the others
    # Everything is written and the process group destroyed. torch 2.13's gloo can still abort the interpreter's
    # exit ("terminate called without an active exception", SIGABRT) in a C++ destructor: measured here in 1 to 3
    # of 12 runs of a DDP script without sparkbus, barrier or not. torchrun would then report a job that trained
    # to its end as failed, so the rank leaves without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
