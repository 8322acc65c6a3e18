"""What the examples print: a resumed run says that it resumed, from which epoch and step, numbered as every
epoch line is (1-based)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_torch  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_a_resumed_run_says_from_which_epoch_and_step():
    line = train_torch.resumed_line("the ranks (ckpt.pt)", {"epoch": 0, "steps": 16, "used": []}, 2)
    assert line.startswith("the ranks (ckpt.pt) resumed from a checkpoint: epoch 1/2, after its step 16")


def test_epoch_lines_are_numbered_from_one():
    result = {"epoch": 0, "steps": 5, "resumed_steps": 16, "rows": 500, "loss": 0.5, "accuracy": 0.9,
              "wait_seconds": [0.1, 0.1], "seconds": [1.0, 1.0]}
    line = train_torch.epoch_line(result, 2)
    assert line.startswith("epoch 1/2: 5 steps (+16 before the checkpoint)")


def test_sparkbus_status_numbers_epochs_from_one():
    from sparkbus.broker.status import render_stats

    epoch = {"ended": True, "closed": True, "committed": 2, "partitions": 2, "batches_in": 4, "bytes_in": 4096,
             "rows_in": 40, "batches_out": 4, "bytes_out": 4096, "rows_out": 40, "acked": 4, "queued": 0,
             "duplicates": 0}
    figures = {"broker": {"version": 7, "pid": 1, "uptime_s": 3.0, "buffered_bytes": 0, "max_buffer": 2**20,
                          "feed_paused": False, "rejected": {}},
               "streams": {"demo": {"ranks": [], "expected_ranks": 2, "epochs": {"0": epoch, "1": epoch}}}}
    text = render_stats(figures)
    assert "  epoch 1 (ended)" in text and "  epoch 2 (ended)" in text and "epoch 0" not in text
