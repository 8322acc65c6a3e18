"""The demo's MPI ranks: a small MLP trained by data-parallel SGD on batches streamed from a broker.

    mpiexec -n 2 python -m sparkbus.demo.ranks --ranks tcp://broker-host:5556 [--epochs 3 --summary out.json]

(``sparkbus demo`` runs it; deploy/train.py is the same program for the deploy/ recipes.)

Every rank starts from the same weights and applies the same averaged gradient each step, so the models stay
identical. All MPI waits are non-blocking requests tested with a short sleep: a blocking call in the mpich
wheel busy-waits and would take a core away from Spark on a small machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# One BLAS thread per rank (MPI already runs a rank per core): OpenBLAS's extra threads spin while they wait and
# make every step crawl on a machine that Spark keeps busy. Set before numpy loads; the environment wins.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from sparkbus.cli_help import HelpFormatter  # noqa: E402
from sparkbus.demo import synthetic  # noqa: E402
from sparkbus.progress import EpochTimes, epoch_label  # noqa: E402
from sparkbus.worker import BatchStream  # noqa: E402
from sparkbus.worker.collectives import allreduce, gather  # noqa: E402

# Per rank and epoch, the figures gathered to rank 0 for the summary, in this order (EpochStats' names).
FIGURES = ("batches", "rows", "bytes", "dropped_batches", "dropped_rows", "wait_seconds", "seconds",
           "first_batch_seconds")
SECONDS = ("wait_seconds", "seconds", "first_batch_seconds")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparkbus.demo.ranks", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--ranks", default="tcp://127.0.0.1:5556", help="the broker's ranks address")
    parser.add_argument("--stream", default="demo", help="the stream to read (the feed job's --stream)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train (the feed job's --epochs)")
    parser.add_argument("--features", type=int, default=64, help="float32 features per row (the feed job's)")
    parser.add_argument("--classes", type=int, default=10, help="classes of the set (the feed job's)")
    parser.add_argument("--seed", type=int, default=42, help="the feed job's seed (for the held-out set)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden units (0: softmax regression)")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--holdout", type=int, default=10_000, help="rows of the held-out set (0: none)")
    parser.add_argument("--prefetch", type=int, default=4, help="batches in flight to each rank")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds the broker may stay silent")
    parser.add_argument("--summary", help="rank 0 writes the run's figures here as JSON")
    return parser.parse_args(argv)


class MLP:
    """A one-hidden-layer ReLU network with a softmax output (no hidden layer: softmax regression).

    The weights and biases of every layer live in one flat vector, so that a gradient is one buffer to
    reduce and a momentum step is one line.
    """

    def __init__(self, features: int, hidden: int, classes: int, seed: int):
        self.sizes = [features, hidden, classes] if hidden else [features, classes]
        self.params = np.zeros(sum(a * b + b for a, b in zip(self.sizes, self.sizes[1:])))
        self.layers = self.views(self.params)
        rng = np.random.default_rng([seed, 3])      # the same on every rank
        for weights, _ in self.layers:
            weights[:] = rng.normal(0.0, np.sqrt(2.0 / weights.shape[0]), weights.shape)
        self.velocity = np.zeros_like(self.params)

    def views(self, flat: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(weights, bias)`` per layer, as views into ``flat`` (the parameters or a gradient)."""
        layers, offset = [], 0
        for a, b in zip(self.sizes, self.sizes[1:]):
            weights = flat[offset:offset + a * b].reshape(a, b)
            bias = flat[offset + a * b:offset + a * b + b]
            layers.append((weights, bias))
            offset += a * b + b
        return layers

    def forward(self, x: np.ndarray) -> list[np.ndarray]:
        """The input of every layer, then the output logits."""
        outputs = [x]
        for i, (weights, bias) in enumerate(self.layers):
            z = outputs[-1] @ weights + bias
            outputs.append(z if i == len(self.layers) - 1 else np.maximum(z, 0.0))
        return outputs

    def gradient(self, x: np.ndarray, y: np.ndarray, out: np.ndarray) -> tuple[float, int]:
        """Write the gradient of the summed cross-entropy into ``out``; return (summed loss, correct)."""
        outputs = self.forward(x)
        z = outputs[-1] - outputs[-1].max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        rows = np.arange(len(y))
        loss = -np.log(np.maximum(p[rows, y], 1e-12)).sum()
        correct = int((p.argmax(axis=1) == y).sum())
        delta = p
        delta[rows, y] -= 1.0
        grads = self.views(out)
        for i in reversed(range(len(self.layers))):
            grad_w, grad_b = grads[i]
            grad_w[:] = outputs[i].T @ delta
            grad_b[:] = delta.sum(axis=0)
            if i:
                delta = (delta @ self.layers[i][0].T) * (outputs[i] > 0)
        return float(loss), correct

    def step(self, grad: np.ndarray, lr: float, momentum: float) -> None:
        """One momentum SGD step along the (already averaged) gradient."""
        self.velocity *= momentum
        self.velocity -= lr * grad
        self.params += self.velocity

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        """The share of rows of ``x`` classified as ``y``."""
        return float((self.forward(x)[-1].argmax(axis=1) == y).mean())


def train_epoch(stream: BatchStream, model: MLP, comm: Any, args: argparse.Namespace) -> dict:
    """One epoch of data-parallel SGD. Each step's gradient is the mean over every rank's batch rows."""
    n = model.params.size
    buffer = np.zeros(n + 3)      # summed gradient, rows, summed loss, correct: one reduction per step
    totals = np.zeros(3)
    steps = 0
    for batch in stream.epoch():
        x, y = batch["features"], batch["label"]
        if x.shape[1] != model.sizes[0]:
            raise ValueError(f"batches have {x.shape[1]} features, the model expects {model.sizes[0]} "
                             f"(is --features the same for the feed job and the ranks?)")
        loss, correct = model.gradient(x, y, buffer[:n])
        buffer[n:] = len(y), loss, correct
        reduced = allreduce(comm, buffer)
        model.step(reduced[:n] / reduced[n], args.lr, args.momentum)
        totals += reduced[n:]
        steps += 1
    rows, summed_loss, right = (float(t) for t in totals)
    return {"steps": steps, "rows": int(rows), "loss": summed_loss / max(rows, 1),
            "train_accuracy": right / max(rows, 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from mpi4py import MPI
    except ImportError:
        raise SystemExit("the demo's ranks need mpi4py: pip install 'sparkbus[demo]'") from None
    comm = MPI.COMM_WORLD
    rank = comm.rank
    model = MLP(args.features, args.hidden, args.classes, args.seed)
    held_x, held_y = synthetic.holdout(args.holdout, args.classes, args.features, args.seed) \
        if args.holdout and rank == 0 else (None, None)
    history = []
    with BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch,
                     timeout=args.timeout) as stream:
        for epoch in range(args.epochs):
            result = train_epoch(stream, model, comm, args)
            ep = stream.stats.epochs[-1]
            if held_x is not None and held_y is not None:
                result["holdout_accuracy"] = model.accuracy(held_x, held_y)
            history.append({"epoch": epoch, **result})
            if rank == 0:
                print(epoch_line(history[-1], EpochTimes.of(ep), args.epochs), flush=True)
    finished = time.time()

    mine = np.array([[getattr(ep, f) for f in FIGURES] for ep in stream.stats.epochs],
                    dtype=np.float64).reshape(-1, len(FIGURES))
    figures = gather(comm, mine)
    spread = allreduce(comm, model.params, MPI.MAX) - allreduce(comm, model.params, MPI.MIN)
    if rank == 0 and args.summary and figures is not None:     # gather: the figures on rank 0 only
        write_summary(args, figures, history, float(np.abs(spread).max()), finished)
    return 0


def epoch_line(result: dict, times: EpochTimes, epochs: int) -> str:
    """Rank 0's line for one epoch: the model's figures, then rank 0's start-up (the wait for the epoch's first
    batch: in the first epoch, Spark's) and its data wait after the first batch."""
    held = f", held-out acc {result['holdout_accuracy']:.1%}" if "holdout_accuracy" in result else ""
    return (f"{epoch_label(result['epoch'], epochs)}: loss {result['loss']:.4f}, "
            f"train acc {result['train_accuracy']:.1%}{held}; {result['steps']} steps, {result['rows']:,} rows; "
            f"rank 0: start-up {times.start_up:.1f} s, then waited {times.waited:.1f} s of {times.streaming:.1f} s "
            f"({times.wait_share:.0%})")


def write_summary(args: argparse.Namespace, figures: np.ndarray, history: list[dict], spread: float,
                  finished: float) -> None:
    """Rank 0's JSON: per rank and epoch figures, per epoch loss and accuracy, the final accuracy. A rank's
    ``first_batch_seconds`` is its first epoch's: the run's start-up."""
    ranks = []
    for r, table in enumerate(figures):
        epochs = [{f: (int(v) if f not in SECONDS else round(float(v), 4)) for f, v in zip(FIGURES, row)}
                  for row in table]
        totals = {f: sum(e[f] for e in epochs) for f in FIGURES if f != "first_batch_seconds"}
        ranks.append({"rank": r, **totals, "first_batch_seconds": epochs[0]["first_batch_seconds"] if epochs else -1.0,
                      "epochs": epochs})
    last = history[-1] if history else {}
    summary = {"size": len(ranks), "epochs": history, "ranks": ranks, "finished_at": finished,
               "final_accuracy": last.get("holdout_accuracy", last.get("train_accuracy")),
               "final_accuracy_kind": "held-out" if "holdout_accuracy" in last else "train",
               "model_spread_across_ranks": spread}
    path = Path(args.summary)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
