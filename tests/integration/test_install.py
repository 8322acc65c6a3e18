"""Install only what each side needs: the core dependencies carry the broker, a Spark-free feed and the rank side.
And the wheel is the product: built, installed into a fresh venv and run from a directory of the user's own files.

A real venv with only the core would need PyPI (or a wheel cache) at test time. Instead the children here run in
this venv with every distribution outside the core's dependency closure refused at import time: a
``sitecustomize`` on their ``PYTHONPATH`` puts a finder first on ``sys.meta_path`` that raises
``ModuleNotFoundError`` for those top-level names, exactly as a missing package does (pyarrow's and numpy's
optional imports then take their "not installed" paths). The refused names are computed from the installed
metadata (the core's ``Requires-Dist`` without extras, recursively), so a new import of anything else on these
paths (psutil, pandas, tqdm, ...) fails this test, not only pyspark, mpi4py and torch.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # pytest's own dependency
from packaging.utils import canonicalize_name

from sparkbus.launch.broker import BrokerProcess

from harness import run_child

pytestmark = pytest.mark.timeout(90)      # the wheel's tests set their own (the demos take 30-60 s each)

ROOT = Path(__file__).resolve().parents[2]
# What the issue names: the rank side must import without these (asserted to be among the refused).
EXTRAS_PACKAGES = ("pyspark", "py4j", "pandas", "mpi4py", "torch", "rich", "prometheus_client", "grpc")
USER_EXTRAS = {"spark", "connect", "mpi", "torch", "broker", "text"}        # what `all` must hold
DEVELOPER_EXTRAS = {"test", "bench", "images", "demo"}

# sitecustomize for the children: refuse the names in SPARKBUS_TEST_REFUSE (a JSON list) before any other finder.
REFUSER = '''
import json, os, sys

class RefuseExtras:
    """Stands in for a distribution that is not installed."""
    refused = frozenset(json.loads(os.environ["SPARKBUS_TEST_REFUSE"]))

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.refused:
            raise ModuleNotFoundError(f"No module named {name!r} (refused: not in sparkbus's core)", name=name)
        return None

sys.meta_path.insert(0, RefuseExtras())
'''

# The rank: consume `epochs` epochs and print the ids and steps of each, and the refused modules that got loaded
# (none). With a rank and a size, one of a group (steps granted by the broker); without, an independent consumer.
RANK = '''
import json, sys
import sparkbus, sparkbus.worker
from sparkbus import BatchStream

address, epochs, *group = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:])
ids, steps = [], []
with BatchStream(address, stream="core", timeout=30, **dict(zip(("rank", "size"), group))) as s:
    for _ in range(epochs):
        batches = list(s.epoch())
        ids.append(sorted(int(i) for batch in batches for i in batch["id"]))
        steps.append(len(batches))
refused = sys.meta_path[0].refused
print(json.dumps({"ids": ids, "steps": steps,
                  "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in refused)}))
'''

# The feed, as a Spark task would do it but without Spark: the driver's epoch open and close through the control
# socket, each partition through the task code (feeder.task.stream_partition) from numpy dicts.
FEEDER = '''
import sys
import numpy as np
from sparkbus.broker.client import ControlClient
from sparkbus.wire.protocol import Kind
from sparkbus.feeder.task import stream_partition

feed, control, epochs, partitions, rows = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
with ControlClient(control, 30) as driver:
    for epoch in range(epochs):
        driver.request(Kind.EPOCH_OPEN, stream="core", epoch=epoch, partitions=partitions, delivery="stream")
        for part in range(partitions):
            ids = np.arange(part * rows, (part + 1) * rows, dtype=np.int64) + epoch * partitions * rows
            batches = ({"id": ids[i:i + 64], "x": ids[i:i + 64, None].astype(np.float32).repeat(8, 1)}
                       for i in range(0, rows, 64))
            stream_partition(batches, feed, control, "core", epoch, part, 0, 30)
        driver.request(Kind.EPOCH_CLOSE, stream="core", epoch=epoch, partitions=partitions)
'''

# What an extra's absence looks like to its user: a message that names the extra, no traceback from deep inside.
ABSENT = '''
import importlib, json, sys
import pkgutil
import sparkbus
from sparkbus import broker, feeder, launch, wire, worker

failed = {}
for package in (broker, feeder, launch, sparkbus, wire, worker):
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if module.name.endswith("__main__"):            # python -m sparkbus.broker: it would run the daemon
            continue
        try:
            importlib.import_module(module.name)
        except ImportError as exc:
            failed[module.name] = str(exc)
try:
    from sparkbus.launch.spark import local_session
    local_session()
except ImportError as exc:
    failed["local_session()"] = str(exc)
refused = sys.meta_path[0].refused
print(json.dumps({"failed": failed, "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in refused)}))
'''


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def core_distributions() -> set[str]:
    """The distributions sparkbus's core needs: its dependencies without extras, theirs, and so on."""
    needed, todo = set(), ["sparkbus"]
    while todo:
        name = todo.pop()
        if name in needed:
            continue
        needed.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return needed


def refused_modules() -> list[str]:
    """Every top-level module of an installed distribution outside the core (this project's own excepted)."""
    core = core_distributions()
    ours = {"sparkbus"}
    installed = metadata.packages_distributions()
    refused = {module for module, dists in installed.items() if module not in ours and not module.startswith("_")
               and not core & {canonicalize_name(d) for d in dists}}
    missing = [p for p in EXTRAS_PACKAGES if p in installed and p not in refused]
    assert not missing, f"{missing} would not be refused: the core's closure is wrong ({sorted(core)})"
    return sorted(refused)


@pytest.fixture
def core_only(tmp_path):
    """``(run, env)``: run a Python snippet in a child that can import only the core; ``env`` for other children."""
    site = tmp_path / "core-only"
    site.mkdir()
    (site / "sitecustomize.py").write_text(REFUSER)
    env = {"PYTHONPATH": str(site), "SPARKBUS_TEST_REFUSE": json.dumps(refused_modules())}

    def run(code: str, *args: str, timeout: float = 60) -> dict:
        result = run_child([sys.executable, "-c", textwrap.dedent(code), *args], timeout, env=env, cwd=tmp_path)
        assert result.returncode == 0, f"the core-only child failed:\n{result.stderr[-3000:]}"
        return json.loads(result.stdout.strip().splitlines()[-1])

    return run, env


def test_the_refuser_refuses_what_an_absent_extra_would(core_only):
    run, _ = core_only
    seen = run('''
        import importlib, json
        def absent(name):
            try:
                importlib.import_module(name)
            except ModuleNotFoundError:
                return True
            return False
        print(json.dumps({name: absent(name) for name in ("pyspark", "mpi4py", "torch", "pandas", "zmq", "pyarrow")}))
    ''')
    assert seen == {"pyspark": True, "mpi4py": True, "torch": True, "pandas": True, "zmq": False, "pyarrow": False}


@pytest.mark.parametrize("group", [[], [0, 2]], ids=["independent", "rank-and-size"])
def test_the_rank_side_consumes_every_row_with_only_the_core(core_only, children, tmp_path, group):
    """A broker (``python -m sparkbus.broker``), a Spark-free feed and the ranks, all with only the core's distributions
    importable: each epoch's ids arrive exactly once. ``BatchStream(address, rank=r, size=n)``: two ranks, equal
    steps granted by the broker, no mpi4py."""
    _, env = core_only
    epochs, partitions, rows = 2, 3, 512            # 24 batches of 64 an epoch: 12 steps a rank
    broker = BrokerProcess(tmp_path / "broker.log", "--heartbeat", "500ms", env=env, cwd=tmp_path)
    broker.start(timeout=20)
    try:
        ranks = [children.spawn([sys.executable, "-c", RANK, broker.ranks, str(epochs),
                                 *([str(r), str(group[1])] if group else [])],
                                env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(group[1] if group else 1)]
        fed = run_child([sys.executable, "-c", FEEDER, broker.feed, broker.control, str(epochs), str(partitions),
                         str(rows)], 60, env=env, cwd=tmp_path)
        assert fed.returncode == 0, f"the feed failed:\n{fed.stderr[-3000:]}"
        got = []
        for r, rank in enumerate(ranks):
            out, err = children.finish(rank, 60, f"core-only rank {r}")
            assert rank.returncode == 0, f"core-only rank {r} failed:\n{err[-3000:]}"
            got.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        broker.stop()
    assert not broker.killed, "the broker did not stop on SIGTERM"
    per_epoch = partitions * rows
    for e in range(epochs):
        assert sorted(i for one in got for i in one["ids"][e]) == list(range(e * per_epoch, (e + 1) * per_epoch))
        assert [one["steps"][e] for one in got] == [per_epoch // 64 // len(got)] * len(got)
    assert [one["loaded"] for one in got] == [[]] * len(got)
    assert "broker stopped" in broker.log.read_text()


def test_every_module_imports_with_only_the_core_except_where_an_extra_is_named(core_only):
    run, _ = core_only
    seen = run(ABSENT)
    assert seen["loaded"] == []
    # sparkbus.broker.metrics is prometheus-client's module (only --metrics-port loads it); local_session needs pyspark
    assert set(seen["failed"]) == {"sparkbus.broker.metrics", "local_session()"}, seen["failed"]
    assert "pip install 'sparkbus[broker]'" in seen["failed"]["sparkbus.broker.metrics"]
    assert "pip install 'sparkbus[spark]'" in seen["failed"]["local_session()"]


@pytest.mark.parametrize("command, extra", [
    (["-m", "sparkbus.broker", "--feed", "tcp://127.0.0.1:*", "--ranks", "tcp://127.0.0.1:*", "--metrics-port", "0"],
     "sparkbus[broker]"),
    (["-m", "sparkbus.broker.cli", "status", "--watch", "tcp://127.0.0.1:1"], "sparkbus[broker]"),
    (["-m", "sparkbus.broker.cli", "demo", "--quick"], "sparkbus[demo]"),
], ids=["broker-metrics", "status-watch", "demo"])
def test_a_missing_extra_is_a_usage_error_that_names_it(core_only, command, extra):
    _, env = core_only
    result = run_child([sys.executable, *command], 30, env=env)
    assert result.returncode == 2, result.stderr
    assert f"pip install '{extra}'" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_core_is_small_and_all_holds_every_users_extra():
    try:
        import tomllib
    except ImportError:                 # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert sorted(_name(r) for r in project["dependencies"]) == ["msgpack", "numpy", "pyarrow", "pyzmq", "tomli",
                                                                 "xxhash"]
    extras = project["optional-dependencies"]
    assert set(extras) == USER_EXTRAS | DEVELOPER_EXTRAS | {"all"}
    (everything,) = extras["all"]
    named = re.fullmatch(r"sparkbus\[([a-z,]+)\]", everything)
    assert named and set(named.group(1).split(",")) == USER_EXTRAS


# ---- the wheel in a fresh venv --------------------------------------------------------------------------------------

# What a wheel is built from: the project's own files, copied, so that nothing else of the checkout (build/, a stale
# egg-info) can reach the wheel and the test shows what the wheel needs.
SOURCES = ("pyproject.toml", "README.md", "sparkbus", "feeder", "broker", "worker", "wire", "launch", "examples")
USER_FILES = ("worker.py", "broker.py", "feeder.py", "launch.py")      # the user's own, beside their script

# From the user's directory (their worker.py & co. first on sys.path): where each name comes from, and what the
# checkout would have given (nothing: it is not importable).
PROBE = '''
import importlib.util, json, sys
import sparkbus
from sparkbus import BatchStream, feed
from sparkbus.demo import run
print(json.dumps({"sparkbus": sparkbus.__file__, "version": sparkbus.__version__,
                  "examples": importlib.util.find_spec("sparkbus.examples").origin,
                  "checkout": [p for p in sys.path if p.rstrip("/") == sys.argv[1]],
                  "editable": [m for m in sys.modules if "editable" in m]}))
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(python, bin, user_dir)``: a fresh venv with the wheel installed (--no-deps), the test venv's installed
    distributions importable through a .pth path line, and a directory holding the user's own worker.py & co."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    wheels = work / "dist"
    built = run_child([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                       str(source), "-w", str(wheels)], 120, cwd=work)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("sparkbus-0.3.0-*.whl")
    venv = work / "venv"
    made = run_child([sys.executable, "-m", "venv", "--without-pip", str(venv)], 60)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(run_child([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], 30,
                          check=True).stdout.strip())
    # A path line, not a site dir: the .pth files there (the editable install's finder of the checkout) stay inert
    # (every site-packages of this run's path: a worktree's venv may reach its dependencies through another's)
    dependencies = dict.fromkeys([sysconfig.get_paths()["purelib"], *(p for p in sys.path if p.endswith("-packages"))])
    (site / "test-venv-dependencies.pth").write_text("".join(f"{p}\n" for p in dependencies))
    # The programs the dependencies installed beside the test venv's python (mpiexec, spark-submit, ...), as pip
    # would have put them beside this one's
    ours = Path(sys.executable).parent
    for program in ours.iterdir():
        if not program.name.startswith(("python", "pip", "activate", "Activate", "sparkbus")):
            (venv / "bin" / program.name).symlink_to(program)
    # and the shared libraries beside its lib/python3.x (the mpich wheel's libmpi, which mpi4py looks for there)
    for library in (ours.parent / "lib").iterdir():
        if not library.name.startswith("python"):
            (venv / "lib" / library.name).symlink_to(library)
    put = run_child([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--quiet",
                     str(wheel)], 120)
    assert put.returncode == 0, put.stderr[-3000:]
    user = work / "user"
    user.mkdir()
    for name in USER_FILES:
        (user / name).write_text(f"raise ImportError('the user\\'s own {name} was imported')\n")
    return python, venv / "bin", user, wheel


def user_env(bin_dir: Path) -> dict[str, str]:
    """The user's shell: the fresh venv first on PATH, nothing of the test run's Python settings."""
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "VIRTUAL_ENV": str(bin_dir.parent),
            "PYTHONPATH": "", "PYTHONSAFEPATH": ""}


@pytest.mark.timeout(120)
def test_the_wheel_holds_only_sparkbus_and_imports_beside_the_users_own_files(installed):
    python, bin_dir, user, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"sparkbus", "sparkbus-0.3.0.dist-info"}, sorted(names)[:20]
    assert "sparkbus/demo/ranks.py" in names and "sparkbus/examples/train_images.py" in names
    probe = run_child([python, "-c", PROBE, str(ROOT)], 60, cwd=user, env=user_env(bin_dir))
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    site = str(python.parent.parent)
    assert seen["sparkbus"].startswith(site) and seen["examples"].startswith(site), seen     # the wheel's, not ROOT's
    assert seen["version"] == "0.3.0"
    assert seen["checkout"] == [] and seen["editable"] == [], seen
    version = run_child([bin_dir / "sparkbus", "--version"], 30, cwd=user, env=user_env(bin_dir))
    assert (version.returncode, version.stdout.strip()) == (0, "sparkbus 0.3.0"), version.stderr



@pytest.mark.timeout(120)
def test_the_bench_runs_from_the_wheel(installed):
    """``sparkbus bench`` ships in the package: its hop runs from the wheel, without a checkout, and writes its
    figures (their validity is test_bench's; here: every hop figure, from the wheel's code)."""
    python, bin_dir, user, wheel = installed
    assert "sparkbus/bench/run.py" in zipfile.ZipFile(wheel).namelist()
    out = user / "bench-out"
    bench = run_child([bin_dir / "sparkbus", "bench", "--quick", "--only", "hop", "--hop-seconds", "0.05",
                       "--out", out], 100, cwd=user, env=user_env(bin_dir))
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    figures = [json.loads(line) for line in (out / "figures.jsonl").read_text().splitlines()]
    assert {f["name"] for f in figures} >= {f"{way} {size}" for way in ("zmq.proxy", "sparkbus")
                                            for size in ("1 KiB", "64 KiB", "1 MiB")}
    assert all(f["value"] > 0 and (f["anchor"] is None or f["ratio"] > 0) for f in figures)
    assert "zmq.proxy" in run_child([bin_dir / "sparkbus", "bench", "--help"], 30, cwd=user,
                                    env=user_env(bin_dir)).stdout


def run_demo(installed, *flags: str, timeout: float) -> tuple[subprocess.CompletedProcess, Path]:
    python, bin_dir, user, _ = installed
    out = user / ("demo-out" + "".join(flags).replace("-", "_"))
    result = run_child([bin_dir / "sparkbus", "demo", *flags, "--quick", "--out", out, "--timeout", str(timeout - 20)],
                       timeout, cwd=user, env=user_env(bin_dir))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert "demo passed" in result.stdout
    return result, out


@pytest.mark.timeout(150)
def test_the_quick_demo_runs_from_the_wheel(installed):
    result, out = run_demo(installed, timeout=130)
    feed = json.loads((out / "feed-report.json").read_text())
    ranks = json.loads((out / "summary.json").read_text())
    assert [e["rows"] for e in feed["epochs"]] == [20_000, 20_000] and len(ranks["epochs"]) == 2
    for number in range(2):
        seen = sum(r["epochs"][number]["rows"] + r["epochs"][number]["dropped_rows"] for r in ranks["ranks"])
        assert seen == 20_000                         # every row reached a rank (or was a counted leftover)
    assert ranks["final_accuracy"] > 0.5              # 10 classes: chance is 0.1
    assert ranks["model_spread_across_ranks"] == 0.0  # allreduce kept the ranks' models identical
    for r in ranks["ranks"]:                          # the run's start-up: its first epoch's wait for a batch
        first = r["epochs"][0]
        assert 0 < first["first_batch_seconds"] <= first["wait_seconds"] + 0.05 and \
            r["first_batch_seconds"] == first["first_batch_seconds"]
    assert "final accuracy" in result.stdout
    # epochs printed as the API numbers them, with their place in the run; the first batch's wait shown apart
    assert "epoch 0 (1 of 2)" in result.stdout and "epoch 1 (2 of 2)" in result.stdout
    assert not re.search(r"epoch \d+/\d+", result.stdout), result.stdout[-4000:]
    assert "start-up" in result.stdout and "rank 0: start-up" in result.stdout
    # after each epoch, one line saying why training waited (FeedReport.verdict)
    for label in ("epoch 0 (1 of 2)", "epoch 1 (2 of 2)"):
        assert re.search(rf"why training waited in {re.escape(label)}: (input-bound|compute-bound|balanced)",
                         result.stdout), result.stdout[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_image_demo_runs_from_the_wheel(installed):
    """Slow (a CNN on the ranks, PNG decoding): about a minute on 2 cores."""
    run_demo(installed, "--images", timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_text_demo_runs_from_the_wheel(installed):
    """Slow (a sequence model on the ranks): about 45 s on 2 cores."""
    run_demo(installed, "--text", timeout=180)
