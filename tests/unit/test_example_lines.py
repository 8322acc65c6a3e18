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

