"""Elastic training under torchrun: a rank lost mid-epoch, the group restarted by torchrun, and training resumed from
the last checkpoint with every row reaching the model exactly once; or a job resumed on another number of ranks.

The ranks and the feed share one checkpoint directory (a shared filesystem across hosts). The ranks save the model
and every rank's stream position there (``ElasticCheckpoints.save``); each start of a group tells the feed what it
resumes from, and the feed (``feed_elastic``, beside Spark) re-feeds from there:

    python examples/train_elastic.py --feed tcp://127.0.0.1:5555 --checkpoints /shared/run1 --epochs 3

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:1 --nproc-per-node 2 --max-restarts 1 \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29500 \\
        examples/train_elastic.py --ranks tcp://127.0.0.1:5556 --checkpoints /shared/run1 --epochs 3 \\
        --checkpoint-every 10

(c10d rendezvous, each round with a store of its own: with torch 2.13, a group restarted on a store shared across
rounds reads the old group's gloo addresses; docs/TRAINING.md, "Elastic restarts").

To see a restart, add ``--kill-rank 1 --kill-after 14``: rank 1 SIGKILLs itself after 14 steps, on torchrun's
first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0); torchrun restarts the group, which resumes from the step-10
checkpoint. To resume on another number of ranks, stop a job and start another with ``--nproc-per-node 3`` on the
same directory: the feed keeps running and serves it.

``--out DIR`` has every rank write, per torchrun attempt (``DIR/attempt<a>/``), the ids it trained per epoch
(``rank<r>-epoch<e>.npz``), the ids it had trained of the epoch at each checkpoint (``rank<r>-<checkpoint>.npz``)
and its figures (``rank<r>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.cli_help import HelpFormatter
from sparkbus.progress import epoch_label, fed_lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--ranks", help="train: the broker's ranks address (run under torchrun)")
    side.add_argument("--feed", help="feed: the broker's feed address")
    parser.add_argument("--checkpoints", type=Path, required=True,
                        help="the run's checkpoint directory, the same for the ranks and the feed (a new one per run)")
    parser.add_argument("--stream", default="elastic-example", help="the stream (the same on both sides)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (the same on both sides)")
    parser.add_argument("--features", type=int, default=32, help="float32 features per row")
    parser.add_argument("--classes", type=int, default=4, help="classes of the synthetic set")
    parser.add_argument("--seed", type=int, default=7, help="data and shuffle seed (feed), weights seed (ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    train = parser.add_argument_group("training (--ranks)")
    train.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    train.add_argument("--lr", type=float, default=0.05, help="learning rate")
    train.add_argument("--checkpoint-every", type=int, default=100,
                       help="save a checkpoint every this many steps of an epoch (and after every epoch)")
    train.add_argument("--kill-rank", type=int, default=-1,
                       help="this rank SIGKILLs itself after --kill-after steps, on torchrun's first attempt only")
    train.add_argument("--kill-after", type=int, default=0, help="see --kill-rank (steps of the run, not of an epoch)")
    train.add_argument("--step-seconds", type=float, default=0.0, help="every rank sleeps this long a step")
    train.add_argument("--out", type=Path, help="every rank writes what it trained here (see above)")
    feeding = parser.add_argument_group("feeding (--feed)")
    feeding.add_argument("--rows", type=int, default=100_000, help="rows of the synthetic set")
    feeding.add_argument("--batch-size", type=int, default=256, help="rows per batch")
    feeding.add_argument("--partitions", type=int, default=4, help="Spark partitions of each epoch")
    feeding.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"),
                         help="Spark master (SPARK_MASTER)")
    return parser.parse_args(argv)


# ---- the feed side ------------------------------------------------------------------------------------------

def run_feed(args: argparse.Namespace) -> int:
    """Feed the synthetic set, reshuffled every epoch, as the ranks' starts ask (``feed_elastic``)."""
    if __package__:     # python -m sparkbus.examples.train_elastic (installed)
        from sparkbus.examples.train_torch import example_spark, synthetic_frame
    else:               # python examples/train_elastic.py: examples/train_torch.py, beside this file
        from train_torch import example_spark, synthetic_frame

    from sparkbus import feed_elastic

    with example_spark(args.master, "sparkbus-train-elastic-feed") as spark:
        data = synthetic_frame(spark, args.rows, args.features, args.classes, args.seed, args.partitions).cache()
        data.count()
        feed_elastic(data, args.feed, args.checkpoints, args.epochs, stream=args.stream, shuffle_seed=args.seed,
                     key=["id"], batch_size=args.batch_size, timeout=args.timeout,
                     on_epoch=lambda e, r: print(fed_lines(e, args.epochs, r), flush=True))
    return 0


# ---- the ranks ----------------------------------------------------------------------------------------------

def run_ranks(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkbus import BatchStream, ElasticCheckpoints

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = args.out / f"attempt{attempt}" if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    net = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(args.hidden, args.classes))
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    ckpt = ElasticCheckpoints(args.checkpoints)        # ranks and size: torch.distributed's
    resume = ckpt.resume(args.stream)                  # None: a first start; else every old rank's state
    history: list[dict[str, Any]] = []
    steps_run = 0
    with BatchStream(args.ranks, rank="auto", stream=args.stream, timeout=args.timeout, resume=resume) as stream:
        ckpt.joined()                                  # every rank joined: the feed may (re)feed now
        saved = ckpt.load_payload()
        if saved is not None:
            net.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        if rank == 0:
            print(f"attempt {attempt}: {size} ranks, "
                  f"{'resumed from ' + str(ckpt.checkpoint) if resume else 'started'}", flush=True)
        model = DistributedDataParallel(net)           # rank 0's weights (all loaded the same) to every rank
        first = resume[0]["epoch"] if resume else 0
        for epoch in range(first, args.epochs):
            seen: list[np.ndarray] = []
            for step, batch in enumerate(stream.epoch(), 1):
                x = torch.from_numpy(np.asarray(batch["features"], dtype=np.float32))
                y = torch.from_numpy(np.asarray(batch["label"], dtype=np.int64))
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()                        # DDP's allreduce: equal steps on every rank
                optimizer.step()
                seen.append(np.array(batch["id"]))
                steps_run += 1
                if args.step_seconds:
                    time.sleep(args.step_seconds)
                if step % args.checkpoint_every == 0:
                    save(ckpt, stream, net, optimizer, out, rank, seen)
                if rank == args.kill_rank and attempt == 0 and steps_run == args.kill_after:
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)     # as a lost node: no goodbye to anyone
            ep = stream.stats.epochs[-1]
            history.append({"epoch": epoch, "batches": ep.batches, "resumed_batches": ep.resumed_batches,
                            "rows": ep.rows, "loss": float(loss.detach()) if seen else None})
            if out:
                np.savez(out / f"rank{rank}-epoch{epoch}.npz", id=concat(seen))
            save(ckpt, stream, net, optimizer, None, rank, seen)      # between epochs: the next one, nothing used
            if rank == 0:
                print(f"{epoch_label(epoch, args.epochs)}: {ep.batches} steps a rank (and {ep.resumed_batches} "
                      f"before the checkpoint)", flush=True)
    ckpt.finish()
    if out:
        (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "size": size, "attempt": attempt,
                                                          "resumed_from": ckpt.checkpoint, "epochs": history}))
    dist.destroy_process_group()
    return 0


def save(ckpt: Any, stream: Any, net: Any, optimizer: Any, out: Path | None, rank: int,
         seen: list[np.ndarray]) -> None:
    """A checkpoint of the model, the optimizer and every rank's position, taken between two steps; with ``out``,
    the ids this rank had trained of the epoch, under the checkpoint's name."""
    name = ckpt.save([stream], {"model": net.state_dict(), "optimizer": optimizer.state_dict()})
    if out:
        np.savez(out / f"rank{rank}-{name}.npz", id=concat(seen))


def concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.feed:
        return run_feed(args)
    status = run_ranks(args)
    # As examples/train_ddp.py: torch 2.13's gloo can abort the interpreter's exit in a C++ destructor; everything
    # is written and the process group destroyed, so the rank leaves without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
