"""A language model end to end (examples/train_lm.py): a byte-level BPE tokenizer trained on the corpus with
Hugging Face ``tokenizers``, tokens made in Spark inside ``mapInArrow`` (the session of the suite), token-budget
batches, ``pack`` on the ranks, a causal transformer under ``torchrun`` with DDP: every document once per epoch, none
dropped, and the perplexity and each source's loss falling."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbus.feeder import feed_epochs

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
    text = lm.corpus(spark, DOCS, 3, 4).cache()
    tokenizer = lm.train_tokenizer([r.text for r in text.limit(1_000).collect()], 384)
    data = lm.tokenized(text, tokenizer).cache()
    assert data.selectExpr("max(ids[size(ids) - 1])").first()[0] == 0, "every document ends with <eos> (id 0)"
    reports = feed_epochs(data, broker.feed, 2, stream="lm-example", shuffle_seed=3, ragged=["ids"],
                          batch_tokens=2_048, batch_size=100_000, timeout=60)
    assert [r.rows for r in reports] == [2 * DOCS, 2 * DOCS]
    out, err = Children.finish(ranks, 180, "torchrun")
    assert ranks.returncode == 0, f"torchrun failed ({ranks.returncode}):\n{out[-2000:]}\n{err[-6000:]}"
    epochs = json.loads(summary.read_text())["epochs"]
    assert [e["documents"] for e in epochs] == [2 * DOCS, 2 * DOCS], "every document once per epoch"
    assert all(e["dropped_batches"] == 0 for e in epochs)
    first, last = epochs
    assert last["perplexity"] < first["perplexity"] / 4 and last["perplexity"] < 64, epochs    # vocabulary: 384
    for source in ("prose", "code"):
        assert last["source_loss"][source] < first["source_loss"][source], (source, epochs)
    assert "perplexity" in out and "loss per source: prose" in out
