"""Versions that last (docs/PROTOCOL.md "Versions"): a broker serves clients of its protocol version and of the one
before, and a client falls back to an older broker's version, both ways through real processes.

"Old" is the real previous release, protocol version 6: commit :data:`OLD` of this repository, unpacked by
``git archive`` into a temporary directory and run from there (``PYTHONPATH`` at that tree, the working directory
elsewhere, so that its ``broker``, ``feeder`` and ``worker`` packages are the ones imported). Without the git
history (a source tarball), the tests are skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbus.launch.broker import BrokerProcess
from sparkbus.wire import protocol

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
OLD = "b241a19"               # the last commit of protocol version 6 on main
FEED = ROOT / "tests" / "integration" / "slurm_feed.py"     # a Spark-free feed that runs on either release
EPOCHS, PARTITIONS, ROWS = 2, 3, 200

# Run on either release. The release before 0.3.0 first: its top-level packages (the tree on PYTHONPATH), whose
# broker/protocol.py 0.3.0 no longer has (with 0.3.0 installed, sparkbus.* would import the installed code)
IMPORTS = """
try:
    from broker import protocol
    import broker
    from broker.client import fetch_stats
    from worker import BatchStream
except ImportError:
    from sparkbus import broker
    from sparkbus.wire import protocol
    from sparkbus.worker import BatchStream
    from sparkbus.broker.client import fetch_stats
"""

CONSUME = IMPORTS + """
import json, sys
address, stream, epochs, out = sys.argv[1:5]
ids = []
with BatchStream(address, stream=stream, timeout=30) as batches:
    for _ in range(int(epochs)):
        ids.append(sorted(int(i) for batch in batches.epoch() for i in batch["id"]))
with open(out, "w") as f:
    json.dump({"ids": ids, "version": protocol.VERSION, "module": broker.__file__}, f)
"""

STATUS = IMPORTS + """
import json, sys
figures = fetch_stats(sys.argv[1], 10)
print(json.dumps({"version": protocol.VERSION, "broker": figures["broker"],
                  "streams": sorted(figures["streams"])}))
"""


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    """The previous release's source tree (protocol version 6), from this repository's history."""
    try:
        subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{OLD}^{{commit}}"], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        pytest.skip(f"no git history here (commit {OLD}, the previous protocol version, is needed)")
    tree = tmp_path_factory.mktemp("sparkbus-v6")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", OLD], check=True, capture_output=True, timeout=60)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=60)
    assert "VERSION = 6\n" in (tree / "broker" / "protocol.py").read_text()
    return tree


def run(tree: Path, workdir: Path, args: list[str], timeout: float = 60, **env: str) -> str:
    """Run ``python args`` on the code of ``tree``; its stdout (a failure shows its stderr)."""
    result = subprocess.run([sys.executable, *args], cwd=workdir, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "PYTHONPATH": str(tree), **env})
    assert result.returncode == 0, f"{args[:2]} on {tree.name} failed:\n{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def feed(tree: Path, workdir: Path, broker: BrokerProcess, stream: str) -> None:
    run(tree, workdir, [str(FEED), "--stream", stream, "--epochs", str(EPOCHS), "--partitions", str(PARTITIONS),
                        "--rows", str(ROWS), "--timeout", "30"], SPARKBUS_FEED_ADDRESS=broker.feed)


def consume(tree: Path, workdir: Path, broker: BrokerProcess, stream: str) -> tuple[dict, str]:
    out = workdir / f"{stream}-{tree.name}.json"
    log = run(tree, workdir, ["-c", CONSUME, broker.ranks, stream, str(EPOCHS), str(out)])
    return json.loads(out.read_text()), log


def expected() -> list[list[int]]:
    return [list(range(e * PARTITIONS * ROWS, (e + 1) * PARTITIONS * ROWS)) for e in range(EPOCHS)]


def module(tree: Path) -> str:
    """The broker's module in ``tree``: ``broker`` before 0.3.0, ``sparkbus.broker`` since."""
    return "sparkbus.broker" if tree == ROOT else "broker"


def start(tree: Path, workdir: Path, name: str) -> BrokerProcess:
    return BrokerProcess(workdir / f"{name}.log", env={"PYTHONPATH": str(tree)}, cwd=workdir,
                         module=module(tree)).start(timeout=30)


def test_old_feeders_ranks_and_status_on_a_new_broker(old_tree, tmp_path):
    """A v7 broker started by its CLI serves v6 feeders (their epochs committed by their tasks' ends, as v6 did), v6
    ranks (the batches of a v7 feeder re-encoded for them) and a v6 `sparkbus status`, beside v7 clients: every id
    once."""
    broker = start(ROOT, tmp_path, "new-broker")
    try:
        feed(old_tree, tmp_path, broker, "old-fed")          # v6 feeder -> v7 broker
        feed(ROOT, tmp_path, broker, "new-fed")              # v7 feeder -> v7 broker
        for stream, tree in [("old-fed", old_tree), ("new-fed", old_tree)]:
            got, _ = consume(tree, tmp_path, broker, stream)   # v6 ranks, the second of v7 batches
            assert (got["version"], got["module"]) == (6, str(old_tree / "broker" / "__init__.py"))
            assert got["ids"] == expected(), stream
        feed(old_tree, tmp_path, broker, "old-to-new")
        got, _ = consume(ROOT, tmp_path, broker, "old-to-new")  # v6 batches to a v7 rank, unchanged
        assert got["version"] == protocol.VERSION and got["ids"] == expected()
        status = json.loads(run(old_tree, tmp_path, ["-c", STATUS, broker.control]).splitlines()[-1])
        assert status["version"] == 6 and status["broker"]["version"] == protocol.VERSION
        assert status["broker"]["versions"] == [6, 7]
        assert status["streams"] == ["new-fed", "old-fed", "old-to-new"]
    finally:
        assert broker.stop() == 0


def test_new_ranks_and_status_fall_back_on_an_old_broker_and_a_new_feeder_says_to_upgrade_it(old_tree, tmp_path):
    """A v7 rank and `sparkbus status` speak v6 to a v6 broker; a v7 feeder (whose epochs the driver commits, which
    v6 cannot) fails at once with a message saying what to do."""
    from sparkbus.broker.client import ControlClient, fetch_stats
    from sparkbus.wire.errors import BrokerError
    from sparkbus.wire.protocol import ErrorCode
    broker = start(old_tree, tmp_path, "old-broker")
    try:
        feed(old_tree, tmp_path, broker, "s")
        got, log = consume(ROOT, tmp_path, broker, "s")
        assert got["version"] == protocol.VERSION and got["ids"] == expected()
        assert "speaks protocol version 6; rank 0 speaks it too" in log
        figures = fetch_stats(broker.control, 10)            # this process's client, v7, falls back
        assert figures["broker"]["version"] == 6 and sorted(figures["streams"]) == ["s"]
        with ControlClient(broker.control, 10) as client:
            with pytest.raises(BrokerError, match="speaks protocol version 6, older than this feeder's 7: "
                                                  "upgrade the broker first") as refused:
                client.hello("feeder", "s")
        assert refused.value.code == ErrorCode.VERSION
    finally:
        assert broker.stop() == 0


def test_a_broker_upgraded_on_its_journal_delivers_what_the_old_one_held_to_an_old_rank(old_tree, tmp_path):
    """The upgrade path of docs/OPERATIONS.md: a v6 broker with --journal holds two fed epochs and stops; the v7
    broker started on the same journal replays them (v6 batch headers, open records without a commit mode) and a
    v6 rank reads every id once."""
    journal = tmp_path / "journal"
    old = BrokerProcess(tmp_path / "old.log", "--journal", str(journal), env={"PYTHONPATH": str(old_tree)},
                        cwd=tmp_path, module=module(old_tree)).start(timeout=30)
    try:
        feed(old_tree, tmp_path, old, "kept")
    finally:
        assert old.stop() == 0
    new = BrokerProcess(tmp_path / "new.log", "--journal", str(journal), env={"PYTHONPATH": str(ROOT)},
                        cwd=tmp_path).start(timeout=30)
    try:
        got, _ = consume(old_tree, tmp_path, new, "kept")
        assert got["version"] == 6 and got["ids"] == expected()
    finally:
        assert new.stop() == 0
