"""Text end to end: sentences of varying length, tokenized in Spark, fed as ragged token ids, trained under MPI.

Ranks (a small PyTorch sequence model; gradients averaged with a non-blocking MPI allreduce every step,
held-out accuracy on a second stream):

    mpiexec -n 2 python examples/train_text.py --ranks tcp://127.0.0.1:5556 --epochs 3

Feed (the Spark side, in any order with the ranks): synthetic sentences generated and tokenized with Spark SQL
functions only (no Python UDF: the executors never run Python per row), reshuffled every epoch:

    python examples/train_text.py --feed tcp://127.0.0.1:5555 --epochs 3 --rows 50000

Each sentence is a sequence of words from a small made-up vocabulary; its class (one of ``--classes``) is the
class of the keywords it contains, among filler words and a few keywords of other classes (noise). Lengths are
log-normal, as a tokenizer's sentence lengths are: most short, a long tail. The tokenizer is a hashing one,
``pmod(xxhash64(word), vocab - 1) + 1``, so token 0 is free for padding.

Batches are padded per batch, to their own longest row, with a length mask. The first ``--plain-epochs`` epochs
(default 1) are fed in Spark's order and the rest with ``bucket_by="tokens"`` (rows of similar length batched
together within ``--bucket-window`` batches' worth of rows); every epoch line reports the padding share (padded
slots that are padding / all padded slots), so the two can be compared in one run. Pass the same
``--epochs``/``--plain-epochs`` to both sides. ``--summary FILE`` writes every figure as JSON; ``--dump DIR``
writes each rank's row ids and token sequences per epoch (what the integration test checks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.cli_help import HelpFormatter
from sparkbus.feeder import feed, feed_epochs  # none of these imports pyspark, torch or MPI
from sparkbus.progress import EpochTimes, epoch_label, wait_share, waited_line
from sparkbus.worker import BatchStream, pad
from sparkbus.worker.collectives import abort_on_error, allreduce, wait

PAD = 0                                               # the padding token: the tokenizer never makes it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--ranks", help="train: the broker's ranks address (run under mpiexec)")
    side.add_argument("--feed", help="feed: the broker's feed address (runs the Spark job)")
    parser.add_argument("--stream", default="text-example",
                        help="the training stream (the same on both sides; each example has its own, so that two "
                             "on one broker never take each other's batches)")
    parser.add_argument("--val-stream", default="text-example-val", help="the held-out stream")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (the same on both sides)")
    parser.add_argument("--plain-epochs", type=int, default=1,
                        help="the first N epochs are fed without bucketing (to compare the padding share)")
    parser.add_argument("--classes", type=int, default=4, help="classes of the sentences")
    parser.add_argument("--vocab", type=int, default=2048, help="token ids are 1 .. vocab - 1 (0 is padding)")
    parser.add_argument("--seed", type=int, default=7, help="data and shuffle seed (feed), weights seed (ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    train = parser.add_argument_group("training (--ranks)")
    train.add_argument("--model", choices=("mean", "gru"), default="mean",
                       help="masked mean of the embeddings + linear, or a GRU over the packed sequences")
    train.add_argument("--embedding", type=int, default=32, help="embedding size")
    train.add_argument("--hidden", type=int, default=32, help="the GRU's hidden size")
    train.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    train.add_argument("--prefetch", type=int, default=4, help="batches in flight to each rank")
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    train.add_argument("--summary", help="rank 0 writes the run's figures here as JSON")
    train.add_argument("--dump", help="every rank writes its row ids and tokens per epoch here (npz)")
    feed = parser.add_argument_group("feeding (--feed)")
    feed.add_argument("--rows", type=int, default=50_000, help="training sentences")
    feed.add_argument("--val-rows", type=int, default=5_000, help="held-out sentences")
    feed.add_argument("--median-length", type=float, default=16.0, help="median tokens per sentence")
    feed.add_argument("--length-sigma", type=float, default=0.7, help="sigma of log(length)")
    feed.add_argument("--max-length", type=int, default=128, help="lengths are clipped to 1 .. this")
    feed.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    feed.add_argument("--bucket-window", type=int, default=64, help="bucket within this many batches' rows")
    feed.add_argument("--partitions", type=int, default=4, help="Spark partitions of each epoch")
    feed.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"),
                      help="Spark master (SPARK_MASTER)")
    return parser.parse_args(argv)


# ---- the Spark side -------------------------------------------------------------------------------------------

SYLLABLES = ("ka", "lo", "mi", "su", "te", "ra", "no", "vi", "de", "po", "zu", "fe", "ga", "hi", "ju", "be")
KEYWORDS_PER_CLASS = 6
FILLER_WORDS = 400


def vocabulary(classes: int, seed: int) -> tuple[list[str], list[str]]:
    """``(keywords, filler)``: ``KEYWORDS_PER_CLASS`` made-up words per class (class c owns
    ``keywords[c * K:(c + 1) * K]``) and ``FILLER_WORDS`` neutral ones, all distinct, from ``seed``."""
    rng = np.random.default_rng([seed, 2])
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < classes * KEYWORDS_PER_CLASS + FILLER_WORDS:
        word = "".join(rng.choice(SYLLABLES, size=int(rng.integers(1, 4))))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words[:classes * KEYWORDS_PER_CLASS], words[classes * KEYWORDS_PER_CLASS:]


def tokens_of(text: Any, vocab: int) -> Any:
    """The hashing tokenizer as a Spark column: ``text`` (a string column) split on spaces, each word mapped to
    ``pmod(xxhash64(word), vocab - 1) + 1``: ``array<int>`` of ids in 1 .. vocab - 1, Arrow-native (a
    higher-order SQL function, no Python UDF)."""
    from pyspark.sql import functions as F

    return F.transform(F.split(text, " "),
                       lambda w: (F.pmod(F.xxhash64(w), F.lit(vocab - 1)) + 1).cast("int"))


def text_frame(spark: Any, rows: int, seed: int, partitions: int, *, classes: int = 4, vocab: int = 2048,
               median_length: float = 16.0, length_sigma: float = 0.7, max_length: int = 128,
               first_id: int = 0, with_text: bool = False) -> Any:
    """``id long, tokens array<int>, label int`` (and ``text string`` with ``with_text``): synthetic sentences.

    Every value follows from ``(seed, id)`` through ``xxhash64``, so the set is the same however it is
    partitioned or recomputed: the label is ``pmod(hash, classes)``; the length is log-normal (a Box-Muller
    normal from two hashes), ``round(median_length * exp(length_sigma * z))`` clipped to ``1 .. max_length``;
    position ``p`` holds a keyword of the row's class at one hashed position and with probability 1/8 elsewhere,
    a keyword of a random class with probability 1/16 (noise), and a filler word otherwise. Pure Spark SQL.
    """
    from pyspark.sql import functions as F

    keywords, filler = vocabulary(classes, seed)
    kw = F.array(*[F.lit(w) for w in keywords])
    fill = F.array(*[F.lit(w) for w in filler])

    def uniform(*salt: Any, bits: int = 24) -> Any:       # in [0, 1), from (seed, id, salt)
        return F.pmod(F.xxhash64(F.lit(seed), F.col("id"), *salt), F.lit(1 << bits)) / float(1 << bits)

    def pick(choices: Any, index: Any) -> Any:             # choices[index], index a 0-based int column
        return F.element_at(choices, (index + 1).cast("int"))

    u1 = (uniform(F.lit("u1")) * (1 << 24) + 1) / ((1 << 24) + 1)       # (0, 1): log is finite
    z = F.sqrt(-2 * F.log(u1)) * F.cos(2 * math.pi * uniform(F.lit("u2")))
    length = F.least(F.greatest(F.round(F.lit(median_length) * F.exp(z * length_sigma)), F.lit(1.0)),
                     F.lit(float(max_length))).cast("int")
    label = F.pmod(F.xxhash64(F.lit(seed), F.col("id"), F.lit("label")), F.lit(classes)).cast("int")
    K = KEYWORDS_PER_CLASS

    def word(p: Any) -> Any:
        own = pick(kw, F.col("label") * K + F.floor(uniform(p, F.lit("k")) * K))
        other = pick(kw, F.floor(uniform(p, F.lit("o")) * (classes * K)))
        r = uniform(p, F.lit("r"))
        return (F.when((p == F.col("anchor")) | (r < 1 / 8), own)
                .when(r < 1 / 8 + 1 / 16, other)
                .otherwise(pick(fill, F.floor(uniform(p, F.lit("f")) * len(filler)))))

    base = (spark.range(first_id, first_id + rows, numPartitions=partitions)
            .select("id", label.alias("label"), length.alias("length"))
            .withColumn("anchor", F.floor(uniform(F.lit("a")) * F.col("length")).cast("int")))
    text = F.array_join(F.transform(F.sequence(F.lit(0), F.col("length") - 1), word), " ")
    frame = base.select("id", "label", text.alias("text")).select("id", tokens_of(F.col("text"), vocab).alias(
        "tokens"), "label", "text")
    return frame if with_text else frame.drop("text")


def feed_text_data(spark: Any, address: str, epochs: int, *, stream: str = "text-example",
                   val_stream: str | None = "text-example-val", rows: int = 50_000, val_rows: int = 5_000,
                   seed: int = 7, partitions: int = 4,
                   batch_size: int = 64, bucket_window: int = 64, plain_epochs: int = 1, timeout: float = 120.0,
                   **shape: Any) -> list[dict]:
    """Feed epochs ``0 .. epochs - 1`` of the training set, reshuffled per epoch, each followed by the held-out set.

    Epochs before ``plain_epochs`` go in Spark's (reshuffled) order; the others with ``bucket_by="tokens"``,
    which batches rows of similar length together within ``bucket_window`` batches' worth of rows, so that
    per-batch padding wastes less. ``ragged=["tokens"]`` makes the ranks always get a ragged column, even for a
    batch whose rows happen to share one length. The held-out set is always bucketed (it changes no result).

    Args:
        spark: the SparkSession; address: the broker's feed address; epochs: how many.
        stream, val_stream: stream names (no held-out set if ``val_stream`` is None).
        rows, val_rows, seed: the synthetic sets (:func:`text_frame`; the held-out rows have other ids).
        partitions, batch_size: tasks per training epoch and rows per batch.
        bucket_window, plain_epochs: bucketing, as above.
        timeout: passed to ``feed``: bounds every wait, a task blocked by backpressure included.
        shape: more :func:`text_frame` arguments (``classes``, ``vocab``, ``median_length``, ...).
    Returns:
        One dict per epoch: the epoch number, whether it was bucketed, and the FeedReport (as a dict) of each
        stream.
    Raises:
        BrokerError, FeedError: as ``feeder.feed``.
    """
    train = text_frame(spark, rows, seed, partitions, **shape).cache()
    train.count()
    val = text_frame(spark, val_rows, seed, 1, first_id=1 << 40, **shape).cache() if val_stream else None
    bucketing = dict(bucket_by="tokens", bucket_window=bucket_window)
    fed = []
    for epoch in range(epochs):
        bucketed = epoch >= plain_epochs
        report = feed_epochs(train, address, 1, stream=stream, shuffle_seed=seed, first_epoch=epoch, key=["id"],
                             partitions=partitions, batch_size=batch_size, ragged=["tokens"], timeout=timeout,
                             **(bucketing if bucketed else {}))[0]
        entry = {"epoch": epoch, "bucketed": bucketed, stream: report._asdict()}
        if val is not None:
            entry[val_stream] = feed(val, address, stream=val_stream, epoch=epoch, batch_size=batch_size,
                                     ragged=["tokens"], timeout=timeout, **bucketing)._asdict()
        fed.append(entry)
        print(f"fed {epoch_label(epoch, epochs)} ({'bucketed' if bucketed else 'plain'}): {report.rows:,} rows in "
              f"{report.batches} batches in {report.seconds:.1f} s", flush=True)
        print(waited_line(epoch, epochs, report), flush=True)
    return fed


def run_feed(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)      # executors must import sparkbus too
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkbus-train-text-feed")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    try:
        feed_text_data(spark, args.feed, args.epochs, stream=args.stream, val_stream=args.val_stream,
                       rows=args.rows, val_rows=args.val_rows, seed=args.seed, partitions=args.partitions,
                       batch_size=args.batch_size, bucket_window=args.bucket_window,
                       plain_epochs=args.plain_epochs, timeout=args.timeout, classes=args.classes,
                       vocab=args.vocab, median_length=args.median_length, length_sigma=args.length_sigma,
                       max_length=args.max_length)
    finally:
        spark.stop()
    return 0


# ---- the ranks ------------------------------------------------------------------------------------------------

class TextModel:
    """Embedding (token 0 = padding) then a masked mean over each row's real tokens and a linear layer, or a GRU
    over the packed sequences (padding never enters it) and a linear layer on its last state."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.torch, self.kind = torch, args.model
        self.embed = torch.nn.Embedding(args.vocab, args.embedding, padding_idx=PAD)
        self.gru = torch.nn.GRU(args.embedding, args.hidden, batch_first=True) if self.kind == "gru" else None
        self.out = torch.nn.Linear(args.hidden if self.gru else args.embedding, args.classes)
        self.layers = torch.nn.ModuleList([m for m in (self.embed, self.gru, self.out) if m is not None])

    def __call__(self, tokens: Any, lengths: Any, mask: Any) -> Any:
        torch = self.torch
        x = self.embed(tokens)                                                   # [n, L, E]
        if self.gru is None:
            pooled = (x * mask.unsqueeze(-1)).sum(1) / lengths.unsqueeze(1).to(x.dtype)
            return self.out(pooled)
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, last = self.gru(packed)                                               # [1, n, H]: each row's last step
        return self.out(last[0])


class Trainer:
    """The model, its optimizer, and one flat buffer through which each step's gradients are summed over MPI."""

    def __init__(self, comm: Any, args: argparse.Namespace):
        import torch

        self.comm, self.torch = comm, torch
        torch.manual_seed(args.seed)                           # the same initial weights on every rank
        self.model = TextModel(args)
        self.params = list(self.model.layers.parameters())
        self.optimizer = torch.optim.Adam(self.params, lr=args.lr)
        self.flat = np.zeros(sum(p.numel() for p in self.params) + 1, dtype=np.float32)   # gradients, then rows
        self.flat_t = torch.from_numpy(self.flat)

    def step(self, b: dict[str, Any]) -> tuple[float, int]:
        """One data-parallel step on a padded batch; returns this rank's summed loss and correct predictions."""
        torch = self.torch
        logits = self.model(b["tokens"], b["tokens_lengths"], b["tokens_mask"])
        labels = b["label"].long()
        loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.flat_t[:-1])
        self.flat[-1] = len(labels)
        summed = torch.from_numpy(allreduce(self.comm, self.flat))      # Iallreduce + Test + sleep: no spinning
        offset = 0
        for p in self.params:                                   # the mean over every rank's rows of this step
            p.grad.copy_(summed[offset:offset + p.numel()].view_as(p)).div_(summed[-1])
            offset += p.numel()
        self.optimizer.step()
        return float(loss.detach()), int((logits.argmax(1) == labels).sum())

    def evaluate(self, b: dict[str, Any]) -> int:
        with self.torch.no_grad():
            logits = self.model(b["tokens"], b["tokens_lengths"], b["tokens_mask"])
            return int((logits.argmax(1) == b["label"].long()).sum())

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.params))


class EpochDump:
    """``--dump``: the ids and token sequences a rank trained on in one epoch (read back from the padded
    tensors, so the padding is checked too), and those of batches dropped to keep the ranks even."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.tokens: list[np.ndarray] = []
        self.dropped_ids: list[np.ndarray] = []
        self.dropped_tokens: list[np.ndarray] = []

    def trained(self, b: dict[str, Any]) -> None:
        self.ids.append(b["id"].numpy().copy())
        self.tokens.extend(row[:n].numpy().astype(np.int32) for row, n in zip(b["tokens"], b["tokens_lengths"]))

    def dropped(self, batch: dict[str, Any]) -> None:                          # BatchStream's on_drop
        tokens, lengths = pad(batch["tokens"])
        self.dropped_ids.append(np.array(batch["id"]))
        self.dropped_tokens.extend(row[:n].astype(np.int32) for row, n in zip(tokens, lengths))

    def save(self, path: Path) -> None:
        def ragged(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
            offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
            return (np.concatenate(rows) if rows else np.zeros(0, np.int32)), offsets

        values, offsets = ragged(self.tokens)
        dropped_values, dropped_offsets = ragged(self.dropped_tokens)
        np.savez(path, id=np.concatenate(self.ids or [np.zeros(0, np.int64)]), values=values, offsets=offsets,
                 dropped_id=np.concatenate(self.dropped_ids or [np.zeros(0, np.int64)]),
                 dropped_values=dropped_values, dropped_offsets=dropped_offsets)


def gather(comm: Any, values: list[float]) -> np.ndarray:
    """Every rank's ``values`` as a ``[size, len(values)]`` array on every rank, without a busy-wait."""
    send = np.asarray(values, dtype=np.float64)
    recv = np.empty((comm.size, len(values)), dtype=np.float64)
    wait(comm.Iallgather(send, recv))
    return recv


def train_epoch(trainer: Trainer, loader: Any, dump: EpochDump | None) -> dict:
    """One pass over the loader: train, and count the padded slots and the real tokens of every batch."""
    steps = 0
    totals = np.zeros(5)                 # summed loss, correct, rows, real tokens, padded slots (this rank)
    for b in loader:
        loss, correct = trainer.step(b)
        totals += (loss, correct, len(b["label"]), int(b["tokens_lengths"].sum()), b["tokens"].numel())
        steps += 1
        if dump is not None:
            dump.trained(b)
    loss, correct, rows, real, slots = allreduce(trainer.comm, totals)
    return {"steps": steps, "rows": int(rows), "loss": loss / max(rows, 1), "accuracy": correct / max(rows, 1),
            "tokens": int(real), "padded_slots": int(slots), "padding_share": 1 - real / max(slots, 1)}


def validate(trainer: Trainer, loader: Any) -> dict:
    """This rank's share of the held-out epoch (uneven shares are fine: no per-batch collective)."""
    totals = np.zeros(2)
    for b in loader:
        totals += (trainer.evaluate(b), len(b["label"]))
    correct, rows = allreduce(trainer.comm, totals)
    return {"val_rows": int(rows), "val_accuracy": correct / max(rows, 1)}


def run_ranks(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI
    from torch.utils.data import DataLoader

    from sparkbus.worker.torch_data import StreamDataset, pad_collate

    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    trainer = Trainer(comm, args)
    dump_dir = Path(args.dump) if args.dump else None
    dump = EpochDump() if dump_dir else None
    history, started = [], time.monotonic()
    with ExitStack() as stack:
        train = stack.enter_context(BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch,
                                                timeout=args.timeout,
                                                on_drop=lambda batch: dump and dump.dropped(batch)))
        val = stack.enter_context(BatchStream(args.ranks, comm=comm, stream=args.val_stream, even=False,
                                              prefetch=args.prefetch, timeout=args.timeout))
        # Each batch padded to its own longest row: tokens [n, L] (int32, 0 at padding), tokens_lengths [n],
        # tokens_mask [n, L] (True at real tokens). batch_size=None, num_workers=0: batches come batched, and
        # the socket lives in this process.
        collate = pad_collate({"tokens": PAD})
        loader = DataLoader(StreamDataset(train, transform=collate), batch_size=None, num_workers=0)
        val_loader = DataLoader(StreamDataset(val, transform=collate), batch_size=None, num_workers=0)
        for epoch in range(args.epochs):
            result = train_epoch(trainer, loader, dump)
            ep = train.stats.epochs[-1]
            result.update(validate(trainer, val_loader))
            per_rank = gather(comm, [ep.wait_seconds, ep.seconds, ep.batches, ep.dropped_batches,
                                     ep.first_batch_seconds])
            result.update(epoch=epoch, bucketed=epoch >= args.plain_epochs, wait_seconds=per_rank[:, 0].tolist(),
                          seconds=per_rank[:, 1].tolist(), batches=per_rank[:, 2].astype(int).tolist(),
                          dropped_batches=per_rank[:, 3].astype(int).tolist(),
                          first_batch_seconds=per_rank[:, 4].tolist())
            result.update(time_figures(result))
            history.append(result)
            if dump is not None:
                dump_dir.mkdir(parents=True, exist_ok=True)
                dump.save(dump_dir / f"rank{comm.rank}-epoch{epoch}.npz")
                dump = EpochDump()
            if comm.rank == 0:
                print(epoch_line(result, args.epochs), flush=True)
    checksums = gather(comm, [trainer.checksum()])[:, 0].tolist()
    if comm.rank == 0:
        summary = make_summary(history, checksums, comm.size, time.monotonic() - started)
        print(summary_lines(summary), flush=True)
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=2))
    return 0


def time_figures(r: dict) -> dict:
    """The epoch's time split at the first batch, from every rank's figures in ``r``: ``start_up_seconds`` (the
    last rank's wait for its first batch: in the first epoch, Spark's start-up), ``streaming_seconds`` (the slowest
    rank's time after it), ``rows_per_second`` over that, and ``data_wait_share``, every rank's wait after its
    first batch out of its time after it."""
    times = [EpochTimes.split(*f) for f in zip(r["wait_seconds"], r["first_batch_seconds"], r["seconds"])]
    streaming = max(t.streaming for t in times)
    return {"start_up_seconds": max(t.start_up for t in times), "streaming_seconds": streaming,
            "rows_per_second": r["rows"] / max(streaming, 1e-9), "data_wait_share": wait_share(times),
            "waited_seconds": [t.waited for t in times]}


def epoch_line(r: dict, epochs: int) -> str:
    batching = "bucket_by tokens" if r["bucketed"] else "no bucketing"
    waits = ", ".join(f"r{i} {w:.2f} s" for i, w in enumerate(r["waited_seconds"]))
    return (f"{epoch_label(r['epoch'], epochs)} ({batching}): {r['steps']} steps, {r['rows']:,} rows, "
            f"loss {r['loss']:.4f} acc {r['accuracy']:.1%} | val acc {r['val_accuracy']:.1%} | "
            f"padding {r['padding_share']:.1%} of {r['padded_slots']:,} slots | start-up "
            f"{r['start_up_seconds']:.2f} s, then {r['rows_per_second']:,.0f} rows/s | data wait {waits} "
            f"({r['data_wait_share']:.0%})")


def make_summary(history: list[dict], checksums: list[float], size: int, seconds: float) -> dict:
    def share(bucketed: bool) -> float | None:     # padding over all epochs of one kind, slot-weighted
        chosen = [h for h in history if h["bucketed"] == bucketed]
        slots = sum(h["padded_slots"] for h in chosen)
        return 1 - sum(h["tokens"] for h in chosen) / slots if slots else None

    plain, bucketed = share(False), share(True)
    return {"ranks": size, "epochs": history, "seconds": seconds, "param_checksums": checksums,
            "padding": {"plain": plain, "bucketed": bucketed,
                        "ratio": bucketed / plain if plain and bucketed is not None else None},
            "final": {k: history[-1][k] for k in ("loss", "accuracy", "val_accuracy")} if history else {}}


def summary_lines(s: dict) -> str:
    final = ", ".join(f"{k} {v:.4f}" for k, v in s["final"].items())
    p = s["padding"]
    padding = ", ".join(f"{name} {p[name]:.1%}" for name in ("plain", "bucketed") if p[name] is not None)
    ratio = f" (bucketed / plain {p['ratio']:.2f})" if p["ratio"] is not None else ""
    return (f"trained {len(s['epochs'])} epochs on {s['ranks']} ranks in {s['seconds']:.1f} s: {final}\n"
            f"padding share: {padding}{ratio}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.feed:
        return run_feed(args)
    with abort_on_error():                             # never leave the other ranks waiting in a collective
        return run_ranks(args)


if __name__ == "__main__":
    sys.exit(main())
