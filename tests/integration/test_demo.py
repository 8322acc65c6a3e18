"""The command line a user meets first: ``sparkbus --version``, help without markup and with defaults, ``sparkbus
status`` at the default address, the examples' help, and their own stream names. ``sparkbus demo --quick`` itself
runs from a built wheel in test_install.py (the same code as from a checkout, and the demo a user runs)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from harness import run_child

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SPARKBUS = Path(sys.executable).parent / "sparkbus"
EXAMPLES = ("train_ddp.py", "train_images.py", "train_text.py", "train_torch.py")


def help_of(*command: str | Path) -> str:
    result = run_child([*command, "--help"], 30)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_version():
    result = run_child([SPARKBUS, "--version"], 30)
    assert (result.returncode, result.stdout.strip()) == (0, "sparkbus 0.3.0")


@pytest.mark.parametrize("command", [[], ["broker"], ["status"], ["keys"], ["demo"], ["bench"]],
                         ids=["sparkbus", "broker", "status", "keys", "demo", "bench"])
def test_help_has_no_markup(command):
    text = help_of(SPARKBUS, *command)
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert f"usage: sparkbus {' '.join(command)}".strip() in text


def test_help_shows_defaults():
    assert "(default: 5s)" in help_of(SPARKBUS, "status")
    assert "tcp://127.0.0.1:5557" in help_of(SPARKBUS, "status")
    broker = " ".join(help_of(SPARKBUS, "broker").split())
    assert "(default tcp://127.0.0.1:5555; SPARKBUS_FEED)" in broker
    demo = help_of(SPARKBUS, "demo")
    assert "(default: 64)" in demo and "(default: local[2])" in demo and "(default: None)" not in demo


def test_bench_help_speaks_as_sparkbus_bench():
    text = help_of(SPARKBUS, "bench")
    assert "benchmarks/bench.py [" not in text and "usage: benchmarks" not in text
    assert "sections.Section" not in text and not re.search(r"\b[A-Z][a-z]+[A-Z]\w*\b", text.split("options:")[0])
    assert "--quick" in text and "source checkout" in " ".join(text.split())


def test_status_without_an_address_asks_the_default_control_address():
    """A broker with default settings may or may not run here: either its figures, or an error naming the address
    that was asked (``--timeout`` bounds the wait)."""
    result = run_child([SPARKBUS, "status", "--timeout", "2s"], 30, env={"SPARKBUS_STATUS_ADDRESS": ""})
    assert "Traceback" not in result.stderr
    if result.returncode != 0:
        assert result.returncode == 1 and "tcp://127.0.0.1:5557" in result.stderr, result.stderr
    else:
        assert "broker" in result.stdout


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_examples_help_shows_defaults(example):
    text = help_of(sys.executable, ROOT / "examples" / example)
    assert "``" not in text
    assert "(default: 3)" in text                         # --epochs
    assert "(default: None)" not in text and "(default: False)" not in text
    for option in ("--stream", "--batch-size", "--rows", "--lr"):
        assert help_default(text, option)


def help_default(text: str, option: str) -> str:
    """The default of ``option`` in a --help text (its help may take several lines, wrapped at a hyphen too)."""
    entry = re.search(rf"^  {option} [A-Z_]+(.*(?:\n {{6,}}.*)*)", text, re.M)
    assert entry, text
    joined = " ".join(re.sub(r"-\n\s+", "-", entry.group(1)).split())
    default = re.search(r"\(default: ([^)\s]+)\)", joined)
    assert default, entry.group(0)
    return default.group(1)


def test_the_demo_and_the_examples_use_streams_of_their_own():
    from sparkbus.demo.run import STREAMS

    examples = {e: help_of(sys.executable, ROOT / "examples" / e) for e in EXAMPLES}
    defaults = {e: [help_default(text, "--stream")] for e, text in examples.items()}
    for e in ("train_images.py", "train_text.py"):                 # the held-out streams (train_torch's: none)
        defaults[e].append(help_default(examples[e], "--val-stream"))
    assert defaults == {"train_ddp.py": ["ddp-example"], "train_images.py": ["images-example", "images-example-val"],
                        "train_text.py": ["text-example", "text-example-val"], "train_torch.py": ["torch-example"]}
    streams = [stream for pair in STREAMS.values() for stream in pair if stream]
    streams += [stream for names in defaults.values() for stream in names]
    assert len(set(streams)) == len(streams) and "train" not in streams, streams
