"""The documentation's runnable code runs: every block of README.md and docs/TRAINING.md marked ``<!-- runs: KIND -->``.

KIND says how (docs/TESTING.md, "The documentation's code"):

- ``spark``: executed in this process, where the session-scoped local Spark is running (the block's
  ``SparkSession.builder...getOrCreate()`` returns it), against a broker this test started;
- ``ranks``: written to a file and run as ``mpiexec -n 2 python FILE`` against the same broker, after the
  ``spark`` blocks before it have fed their epochs;
- ``python``: written to a file and run as ``python FILE``.

The one change made to a block is the broker's address: the default addresses the documents use
(``tcp://127.0.0.1:5555`` and ``:5556``) are replaced by the started broker's random ports.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkbus.launch.broker import BrokerProcess
from sparkbus.launch.mpi import loopback_env, mpiexec_python
from sparkbus.launch.processes import wait_for

from harness import Children, run_child

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", "docs/TRAINING.md"]
KINDS = ("spark", "ranks", "python")
MARKER = re.compile(r"^<!--\s*runs:\s*(\S+)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)")
DEFAULT_FEED, DEFAULT_RANKS = "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"
CHILD_TIMEOUT = 60.0
STREAM = re.compile(r'stream="([^"]+)"')
HYDRA_LAUNCH_FAILURE = "process reading stdin too slowly"     # hydra on a loaded machine, before any rank runs


@dataclass
class Block:
    document: str
    line: int          # of the code's first line, 1-based
    kind: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line} ({self.kind})"


def marked_blocks(document: str) -> list[Block]:
    """The blocks of ``document`` marked runnable, in order. A marker must stand on the line before a fence."""
    lines = (ROOT / document).read_text().splitlines()
    blocks = []
    for number, line in enumerate(lines):
        match = MARKER.match(line)
        if not match:
            continue
        kind = match.group(1)
        assert kind in KINDS, f"{document}:{number + 1}: unknown marker kind {kind!r} (one of {KINDS})"
        assert number + 1 < len(lines) and FENCE.match(lines[number + 1]), \
            f"{document}:{number + 1}: a runs marker must stand on the line just before a code fence"
        end = next((i for i in range(number + 2, len(lines)) if lines[i].startswith("```")), None)
        assert end is not None, f"{document}:{number + 2}: the marked code block is never closed"
        blocks.append(Block(document, number + 3, kind, "\n".join(lines[number + 2:end]) + "\n"))
    return blocks


def test_the_markers_are_found():
    """A marker that no longer parses would silently make the test below run nothing."""
    readme = marked_blocks("README.md")
    assert [b.kind for b in readme].count("spark") >= 3 and [b.kind for b in readme].count("ranks") >= 3
    for document in DOCUMENTS:
        text = (ROOT / document).read_text()
        assert text.count("<!-- runs:") == len(marked_blocks(document)), f"{document}: a malformed marker"


def start_ranks(children: Children, path: Path) -> subprocess.Popen:
    return children.spawn(mpiexec_python(2, path), env=loopback_env(), cwd=path.parent, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def wait_until_joined(broker: BrokerProcess, block: Block, proc: subprocess.Popen) -> None:
    """Until both ranks of ``block`` have joined their stream (named ``stream="..."`` in the block) at the broker."""
    named = STREAM.search(block.code)
    assert named, f"{block.where}: a ranks block names its stream (stream=\"...\")"

    def joined() -> bool:
        assert proc.poll() is None, f"{block.where}: the ranks ended before joining: {proc.communicate()}"
        return len(broker.stats()["streams"].get(named.group(1), {}).get("ranks", [])) >= 2

    wait_for(joined, CHILD_TIMEOUT, f"the ranks of {block.where} to join stream {named.group(1)!r}", interval=0.2)


def finish_ranks(children: Children, proc: subprocess.Popen, path: Path, where: str) -> str:
    """The ranks' output once they ended well (launched again if hydra failed before any rank ran)."""
    for _attempt in range(3):
        out, err = children.finish(proc, CHILD_TIMEOUT, f"{where} under mpiexec -n 2")
        if not (proc.returncode and HYDRA_LAUNCH_FAILURE in err):
            break
        proc = start_ranks(children, path)
    assert proc.returncode == 0, f"{where} failed under mpiexec -n 2:\n{out[-2000:]}\n{err[-3000:]}"
    # mpiexec merges the ranks' stdout: two lines can arrive run together ("rank 0: ...rank 1: ...")
    printed = re.findall(r"rank [01]\b", out)
    assert sorted(set(printed)) == ["rank 0", "rank 1"], f"{where}: expected a line from each of 2 ranks, got {out!r}"
    return out


def run_python(path: Path, where: str) -> str:
    result = run_child([sys.executable, "-u", path], timeout=CHILD_TIMEOUT, cwd=path.parent)
    assert result.returncode == 0, f"{where} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def run_spark(code: str, where: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            exec(compile(code, where, "exec"), {"__name__": "__main__"})
        except Exception as exc:
            raise AssertionError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    return out.getvalue()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_marked_blocks_run(document, spark, start_broker_process, children, tmp_path):
    blocks = marked_blocks(document)
    if not blocks:
        pytest.skip(f"{document} marks no block runnable")
    broker = start_broker_process()
    paths = []
    for number, block in enumerate(blocks):
        paths.append(tmp_path / f"block_{number}_{block.kind}.py")
        paths[-1].write_text(block.code.replace(DEFAULT_FEED, broker.feed).replace(DEFAULT_RANKS, broker.ranks))
    # The ranks that read what a spark block feeds (the ranks block after it) start first, all at once, and join
    # their streams (the README: "in any order"), so each feed meets ranks that wait for it; ranks of another
    # stream than the feed's would wait until their timeout and fail the test.
    ranks = {number + 1: start_ranks(children, paths[number + 1]) for number, block in enumerate(blocks[:-1])
             if block.kind == "spark" and blocks[number + 1].kind == "ranks"}
    for number, proc in ranks.items():
        wait_until_joined(broker, blocks[number], proc)
    for number, (block, path) in enumerate(zip(blocks, paths)):
        if block.kind == "spark":
            run_spark(path.read_text(), block.where)
        elif block.kind == "ranks":
            proc = ranks.pop(number, None) or start_ranks(children, path)
            finish_ranks(children, proc, path, block.where)
        else:
            run_python(path, block.where)
