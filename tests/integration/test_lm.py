"""A language model end to end (examples/train_lm.py): a byte-level BPE tokenizer trained on the corpus with
Hugging Face ``tokenizers``, tokens made in Spark inside ``mapInArrow`` (the session of the suite), two sources mixed
by ``feed_mixture`` at 70/30 in token-budget batches, ``pack`` on the ranks, a causal transformer under ``torchrun``
with DDP: every document of the plan once per epoch, none dropped, each source's documents exactly its share (the
ranks count them from the ``source`` column), and the perplexity and each source's loss falling."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbus import feed_mixture

from harness import Children

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_lm.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
DOCS = 1_500                  # per source

pytest.importorskip("torch")
pytest.importorskip("tokenizers")


def example():
    spec = importlib.util.spec_from_file_location("sparkbus_example_train_lm", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_language_model_learns_from_spark_tokens_packed_on_the_ranks(spark, start_broker_process, children,
                                                                       tmp_path):
    lm = example()
    broker = start_broker_process()
    summary = tmp_path / "summary.json"
    ranks = children.spawn([TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                            str(free_port()), EXAMPLE, "--ranks", broker.ranks, "--epochs", "2", "--timeout", "60",
                            "--summary", summary], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    texts = lm.corpus(spark, DOCS, 3, 4)
    tokenizer = lm.train_tokenizer([r.text for df in texts.values() for r in df.limit(500).collect()], 384)
    sources = {name: lm.tokenized(df, tokenizer).cache() for name, df in texts.items()}
    for data in sources.values():
        assert data.selectExpr("max(ids[size(ids) - 1])").first()[0] == 0, "every document ends with <eos> (id 0)"
    args = lm.parse_args(["--feed", broker.feed, "--docs", str(DOCS), "--epochs", "2", "--timeout", "60"])
    reports = feed_mixture(sources, broker.feed, **lm.mixture_options(args))
    assert [r.rows for r in reports] == [2 * DOCS, 2 * DOCS]
    out, err = Children.finish(ranks, 180, "torchrun")
    assert ranks.returncode == 0, f"torchrun failed ({ranks.returncode}):\n{out[-2000:]}\n{err[-6000:]}"
    epochs = json.loads(summary.read_text())["epochs"]
    assert [e["documents"] for e in epochs] == [2 * DOCS, 2 * DOCS], "every document of the plan once per epoch"
    # 7 prose and 3 code in every window of 10 documents: 2,100 and 900 of the epoch's 3,000, to the document
    assert all(e["source_documents"] == {"prose": 2_100, "code": 900} for e in epochs), epochs
    assert all(e["dropped_batches"] == 0 for e in epochs)
    first, last = epochs
    assert last["perplexity"] < first["perplexity"] / 4 and last["perplexity"] < 64, epochs    # vocabulary: 384
    for source in ("prose", "code"):
        assert last["source_loss"][source] < first["source_loss"][source], (source, epochs)
    assert "perplexity" in out and "loss per source: prose" in out and "(900 documents)" in out
