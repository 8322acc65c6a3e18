"""A small language model end to end: text made in Spark, a byte-level BPE tokenizer trained on the corpus itself
(Hugging Face ``tokenizers``, nothing downloaded), tokenized in Spark inside ``mapInArrow``, two sources mixed at
set ratios into one stream (``feed_mixture``) in token-budget batches, packed into rows of ``--context`` tokens on
the ranks, and a small causal transformer trained under torchrun with DistributedDataParallel. Perplexity falls;
the loss is logged per source.

Ranks (gloo on CPU):

    torchrun --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29500 \\
        examples/train_lm.py --ranks tcp://127.0.0.1:5556 --epochs 3

Feed, in any order with the ranks:

    python examples/train_lm.py --feed tcp://127.0.0.1:5555 --epochs 3

Two sources of documents, each a DataFrame with its own statistics: ``prose`` (sentences over a small vocabulary,
words following each other in a fixed pattern per document) and ``code`` (short assignments and calls). The feed
collects a sample to the driver, trains the tokenizer on it (``--vocab`` tokens, ``<eos>`` ending each document),
and ships its JSON to the executors with the job: each Arrow batch is encoded in one ``encode_batch`` call (Rust,
parallel), so no Python runs per row. ``feed_mixture`` mixes the two at ``--weights`` (default 70 % prose, 30 %
code), exactly in every window of 10 documents (docs/MIXTURES.md): an epoch is ``2 * --docs`` documents, so prose
repeats within an epoch (its passes reshuffled) and code is read without replacement across epochs. Every row
carries its source's name (column ``source``). Batches are cut by tokens (``batch_tokens``), so every step carries
about the same work whatever the documents' lengths; the mixture's ratio holds per window of rows, and so about per
step.

On the rank, ``sparkbus.pack`` lays each batch's documents back to back in rows of exactly ``--context`` tokens
(a view of the received frame), with segments and positions restarting per document; the model attends only
within a document, and the loss is the next-token loss summed over real tokens, divided by the tokens of the step
over all ranks (so that the epoch's smaller last step, the remainder shared out by rows, counts for what it
holds). Rank 0 prints per epoch the perplexity over all ranks and, from the ``source`` column, the loss and the
documents per source; ``--summary FILE`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus import pack
from sparkbus.cli_help import HelpFormatter
from sparkbus.progress import epoch_label, fed_lines
from sparkbus.worker import BatchStream

SOURCES = ("prose", "code")
EOS = "<eos>"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--ranks", help="train: the broker's ranks address (run under torchrun)")
    side.add_argument("--feed", help="feed: the broker's feed address (runs the Spark job)")
    parser.add_argument("--stream", default="lm-example", help="the stream (the same on both sides)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (the same on both sides)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    feed = parser.add_argument_group("feeding (--feed)")
    feed.add_argument("--docs", type=int, default=4_000, help="documents per source (an epoch: twice as many)")
    feed.add_argument("--weights", default="prose=0.7,code=0.3", help="the mixture's weights, SOURCE=W,...")
    feed.add_argument("--vocab", type=int, default=384, help="the tokenizer's vocabulary size")
    feed.add_argument("--batch-tokens", type=int, default=2_048, help="tokens per batch at most")
    feed.add_argument("--partitions", type=int, default=4, help="Spark partitions")
    feed.add_argument("--seed", type=int, default=3, help="the data's seed and the shuffle's")
    feed.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"), help="Spark master")
    train = parser.add_argument_group("training (--ranks)")
    train.add_argument("--context", type=int, default=64, help="tokens per packed row")
    train.add_argument("--width", type=int, default=64, help="the model's width")
    train.add_argument("--layers", type=int, default=2, help="transformer layers")
    train.add_argument("--lr", type=float, default=3e-3, help="learning rate (AdamW)")
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    train.add_argument("--summary", help="rank 0 writes the run's figures here as JSON")
    return parser.parse_args(argv)


# ---- the feed: two sources, a tokenizer trained on them, tokens made in Spark ----------------------------------

def corpus(spark: Any, docs: int, seed: int, partitions: int) -> dict[str, Any]:
    """``docs`` documents of each source, as Spark SQL makes them (no Python per row): a DataFrame per source
    (``prose``, ``code``) of one column, ``text``. Within a document, each word follows from the one before by a
    per-document step, so a model can learn the pattern: perplexity falls well below the vocabulary's. Both are
    deterministic (``spark.range`` and hashes), as a mixture's sources must be."""
    words = ["the", "river", "stone", "light", "quiet", "north", "garden", "winter", "bright", "slowly", "across",
             "under", "forest", "window", "golden", "morning", "silver", "market", "harbor", "little"]
    names = ["x", "y", "total", "count", "index", "value", "items", "result"]
    calls = ["len", "sum", "max", "min", "sorted", "abs"]
    word_list = "array(" + ", ".join(f"'{w}'" for w in words) + ")"
    name_list = "array(" + ", ".join(f"'{n}'" for n in names) + ")"
    call_list = "array(" + ", ".join(f"'{c}'" for c in calls) + ")"
    prose = (spark.range(docs, numPartitions=partitions)
             .selectExpr(f"pmod(xxhash64(id, {seed}), 20) as start",
                         f"1 + pmod(xxhash64(id, {seed} + 1), 3) as step",
                         f"4 + pmod(xxhash64(id, {seed} + 2), 28) as n")
             .selectExpr(f"concat_ws(' ', transform(sequence(0, n - 1), i -> element_at({word_list}, "
                         "cast(pmod(start + i * step, 20) + 1 as int)))) || '.' as text"))
    code = (spark.range(docs, numPartitions=partitions)
            .selectExpr(f"pmod(xxhash64(id, {seed} + 3), 8) as a",
                        f"pmod(xxhash64(id, {seed} + 4), 6) as f", f"1 + pmod(xxhash64(id, {seed} + 5), 6) as n")
            .selectExpr(f"concat_ws('\\n', transform(sequence(1, n), i -> concat("
                        f"element_at({name_list}, cast(pmod(a + i, 8) + 1 as int)), ' = ', "
                        f"element_at({call_list}, cast(pmod(f + i, 6) + 1 as int)), '(', "
                        f"element_at({name_list}, cast(pmod(a + i - 1, 8) + 1 as int)), ') + ', "
                        "cast(i as string)))) as text"))
    return {"prose": prose, "code": code}


def train_tokenizer(texts: list[str], vocab: int) -> str:
    """A byte-level BPE tokenizer trained on ``texts``; its JSON (what the executors load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


def tokenized(df: Any, tokenizer_json: str) -> Any:
    """``df`` (``text``) as ``ids``, the text's token ids and ``<eos>``: one ``encode_batch`` per Arrow batch inside
    ``mapInArrow``."""

    def encode(batches: Any) -> Any:
        import pyarrow as pa
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(tokenizer_json)
        eos = tokenizer.token_to_id(EOS)
        for batch in batches:
            encodings = tokenizer.encode_batch(batch.column("text").to_pylist())
            ids = pa.array([e.ids + [eos] for e in encodings], pa.list_(pa.int32()))
            yield pa.record_batch([ids], names=["ids"])

    return df.mapInArrow(encode, "ids array<int>")


def parse_weights(text: str) -> dict[str, float]:
    """``prose=0.7,code=0.3`` as a dict; every source named once."""
    weights = {name.strip(): float(w) for name, w in (part.split("=") for part in text.split(","))}
    if set(weights) != set(SOURCES):
        raise SystemExit(f"--weights must name {', '.join(SOURCES)}, not {text!r}")
    return weights


def mixture_options(args: argparse.Namespace) -> dict[str, Any]:
    """What ``feed_mixture`` is given besides the sources and the address (the test feeds with the same)."""
    return dict(weights=parse_weights(args.weights), rows_per_epoch=2 * args.docs, epochs=args.epochs,
                stream=args.stream, seed=args.seed, ragged=["ids"], batch_tokens=args.batch_tokens,
                batch_size=100_000, timeout=args.timeout)


def run_feed(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    from sparkbus import feed_mixture

    spark = (SparkSession.builder.master(args.master).appName("sparkbus-train-lm-feed")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    try:
        texts = corpus(spark, args.docs, args.seed, args.partitions)
        started = time.monotonic()
        sample = [r.text for df in texts.values()
                  for r in df.sample(fraction=min(1.0, 1_000 / args.docs), seed=args.seed).collect()]
        tokenizer_json = train_tokenizer(sample, args.vocab)
        print(f"tokenizer: byte-level BPE of {args.vocab} tokens trained on {len(sample):,} documents in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        sources = {name: tokenized(df, tokenizer_json).cache() for name, df in texts.items()}
        for name, data in sources.items():
            tokens = data.selectExpr("sum(size(ids)) as n").first().n
            print(f"source {name}: {args.docs:,} documents, {tokens:,} tokens", flush=True)
        feed_mixture(sources, args.feed, **mixture_options(args),
                     on_epoch=lambda e, r: print(fed_lines(e, args.epochs, r, "documents"), flush=True))
    finally:
        spark.stop()
    return 0


# ---- the ranks: pack, a causal transformer, DDP ----------------------------------------------------------------

def make_model(vocab: int, width: int, layers: int, context: int) -> Any:
    import torch
    from torch import nn

    class TinyLM(nn.Module):
        """Token and position embeddings, a pre-norm transformer, tied output weights."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(context, width)
            layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            for table in (self.tokens, self.positions):      # small, as GPT-2's: the first logits near 0, not
                nn.init.normal_(table.weight, std=0.02)       # a standard deviation of sqrt(width) (tied weights)

        def forward(self, tokens: torch.Tensor, positions: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
            h = self.tokens(tokens) + self.positions(positions)
            h = self.body(h, mask=blocked)
            return self.norm(h) @ self.tokens.weight.T

    return TinyLM()


def step_tensors(packed: Any, source: np.ndarray, context: int) -> dict[str, Any]:
    """What one step trains on: tokens, positions, the attention mask (a token sees the tokens before it in its
    own document), the next-token targets where the next token is in the same document, each token's source."""
    import torch

    tokens = torch.from_numpy(packed.tokens.astype(np.int64))
    segments = torch.from_numpy(packed.segments)
    allowed = torch.from_numpy(packed.attention_mask)                       # [rows, L, L]
    allowed |= torch.eye(context, dtype=torch.bool)                        # padding attends to itself: no NaN
    blocked = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, float("-inf"))
    same = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    return {"tokens": tokens, "positions": torch.from_numpy(packed.positions.astype(np.int64)),
            "blocked": blocked.repeat_interleave(4, dim=0), "targets": tokens[:, 1:], "real": same,
            "source": torch.from_numpy(source[:, 1:])}


def run_ranks(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    vocab = 1 << 10                                  # room for any --vocab up to 1,024; ids above are unused
    model = DistributedDataParallel(make_model(vocab, args.width, args.layers, args.context))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    history = []
    with BatchStream(args.ranks, rank="auto", stream=args.stream, timeout=args.timeout) as stream:
        for epoch in range(args.epochs):
            sums = torch.zeros(2 + 3 * len(SOURCES), dtype=torch.float64)   # loss, tokens; per source: both, docs
            docs = steps = 0
            for batch in stream.epoch():
                ids = batch["ids"]
                source = np.asarray([SOURCES.index(name) for name in batch["source"].to_pylist()], dtype=np.int64)
                docs += len(source)
                packed = pack(ids, args.context, pad_last=True)          # every token of the batch, once
                per_token = np.full(packed.tokens.size, -1, dtype=np.int64)
                per_token[:len(ids.values)] = np.repeat(source, ids.lengths())
                t = step_tensors(packed, per_token.reshape(packed.tokens.shape), args.context)
                if not len(packed.tokens):           # a 0-row last step: no token, but DDP's allreduce goes on
                    t = {k: v for k, v in step_tensors(pack(np.zeros((1, args.context), np.int64), args.context),
                                                       np.full((1, args.context), -1), args.context).items()}
                    t["real"] = torch.zeros_like(t["real"])
                logits = model(t["tokens"], t["positions"], t["blocked"])[:, :-1]
                losses = F.cross_entropy(logits.reshape(-1, vocab), t["targets"].reshape(-1), reduction="none")
                losses = losses.reshape(t["targets"].shape) * t["real"]
                real = torch.tensor([float(t["real"].sum())], dtype=torch.float64)
                dist.all_reduce(real)                # the step's tokens over all ranks: a smaller step weighs less
                optimizer.zero_grad()
                (losses.sum() / real.clamp(min=1.0)).backward()
                optimizer.step()
                steps += 1
                sums[0] += float(losses.sum().detach())
                sums[1] += float(t["real"].sum())
                for s in range(len(SOURCES)):
                    own = t["real"] & (t["source"] == s)
                    sums[2 + 3 * s] += float((losses * own).sum().detach())
                    sums[3 + 3 * s] += float(own.sum())
                    sums[4 + 3 * s] += float(np.count_nonzero(source == s))
            ep = stream.stats.epochs[-1]
            counts = torch.tensor([docs, steps], dtype=torch.float64)
            dist.all_reduce(sums)
            dist.all_reduce(counts)
            figures = {"epoch": epoch, "perplexity": math.exp(sums[0] / max(sums[1], 1.0)),
                       "tokens": int(sums[1]), "documents": int(counts[0]), "steps": steps,
                       "source_loss": {name: float(sums[2 + 3 * s] / max(sums[3 + 3 * s], 1.0))
                                       for s, name in enumerate(SOURCES)},
                       "source_documents": {name: int(sums[4 + 3 * s]) for s, name in enumerate(SOURCES)},
                       "dropped_batches": ep.dropped_batches, "cut_batches": ep.cut_batches}
            history.append(figures)
            if rank == 0:
                per_source = ", ".join(f"{n} {v:.3f} ({figures['source_documents'][n]:,} documents)"
                                       for n, v in figures["source_loss"].items())
                print(f"{epoch_label(epoch, args.epochs)}: perplexity {figures['perplexity']:.2f} over "
                      f"{figures['tokens']:,} tokens of {figures['documents']:,} documents, {steps} steps a rank; "
                      f"loss per source: {per_source}", flush=True)
    if rank == 0 and args.summary:
        Path(args.summary).write_text(json.dumps({"ranks": size, "epochs": history}, indent=2))
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_feed(args) if args.feed else run_ranks(args)


if __name__ == "__main__":
    raise SystemExit(main())
