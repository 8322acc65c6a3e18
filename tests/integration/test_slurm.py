"""deploy/slurm under a real Slurm: a one-node Slurm from Debian's packages (tests/integration/slurm_cluster.py),
``sbatch`` of each recipe as an operator runs it, fed by a Spark-free feed (slurm_feed.py) through the recipe's
FEED_CMD.

- ``sparkbus-train.sbatch``: the broker's step, then mpi4py ranks under ``srun --mpi=pmi2`` (the mpich wheel);
- ``sparkbus-train-torch.sbatch``: the broker's step, then ranks under plain ``srun`` with torch.distributed (gloo)
  and ``BatchStream(address, rank="auto")``, no mpi4py.

Each asserts every row id once per epoch, equal steps on every rank, and the broker's clean stop at the end
("broker stopped" in its log: SIGTERM reached the broker through ``scancel --signal=TERM``, the step was not
killed). Skipped where Slurm cannot run (not root, packages missing, daemons that do not start).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from sparkbus.launch.processes import WaitTimeout

from harness import free_port_triple, free_ports, wait_for
from slurm_cluster import OneNodeSlurm, SlurmUnavailable, unavailable

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = Path(sys.executable).parent.parent
EPOCHS, PARTITIONS, ROWS, BATCH = 2, 3, 1000, 50
JOB_SECONDS = 60
# sitecustomize for the torch ranks: mpi4py cannot be imported there (as on a node with no MPI installed)
NO_MPI = """
import sys

class NoMPI:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("mpi4py", "mpich"):
            raise ModuleNotFoundError(f"No module named {name!r} (refused: a torch rank needs no MPI)", name=name)
        return None

sys.meta_path.insert(0, NoMPI())
"""


@pytest.fixture(scope="module")
def slurm():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cluster = OneNodeSlurm(cpus=4)
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    left = cluster.stop()
    assert not left, f"slurmstepd processes {left} outlived the one-node Slurm (killed)"


def sbatch(slurm: OneNodeSlurm, recipe: str, work: Path, settings: dict[str, str], *flags: str) -> dict:
    """Submit ``deploy/slurm/<recipe>`` from ``work`` on one node with two ranks, wait for the job to end (bounded),
    and return its ``scontrol show job`` fields, with ``output``: the recipe's own output file's text."""
    base = free_port_triple()
    env = {"SPARKBUS_HOME": str(ROOT), "VENV": str(VENV), "BROKER_BIND": "127.0.0.1",
           "SPARKBUS_FEED_PORT": str(base), "SPARKBUS_RANKS_PORT": str(base + 1), "PYTHONUNBUFFERED": "1",
           "FEED_CMD": f"python {HERE / 'slurm_feed.py'} --epochs {EPOCHS} --partitions {PARTITIONS} "
                       f"--rows {ROWS} --batch-size {BATCH}", **settings}
    submitted = slurm.run(["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
                           "--time=00:05:00", str(ROOT / "deploy" / "slurm" / recipe), *flags],
                          timeout=20, env=env, cwd=work)
    assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    job = submitted.stdout.strip().split(";")[0]

    def ended() -> dict | None:
        fields = show_job(slurm, job)
        return fields if fields.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                    "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"} else None

    output = work / f"sparkbus-train-{job}.out"
    try:
        fields = wait_for(ended, JOB_SECONDS, f"job {job} to end", interval=0.2)
    except WaitTimeout as exc:
        text = output.read_text(errors="replace") if output.exists() else "(no output file)"
        raise AssertionError(f"{exc}; its output so far:\n{text[-3000:]}\n{slurm.tails()}") from None
    finally:
        if slurm.jobs():
            slurm.run(["scancel", "--full", job], timeout=10)
    fields["output"] = output.read_text(errors="replace") if output.exists() else "(no output file)"
    fields["broker_log"] = work / f"sparkbus-broker-{job}.log"
    return fields


def show_job(slurm: OneNodeSlurm, job: str) -> dict[str, str]:
    result = slurm.run(["scontrol", "show", "job", "--oneliner", job], timeout=10)
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout)) if result.returncode == 0 else {}


def assert_clean_run(fields: dict) -> str:
    """The job exited 0, and its broker stopped on SIGTERM instead of being killed with its step."""
    output = fields["output"]
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output
    assert "forcing job termination" not in output and "Killed" not in output, output
    log = fields["broker_log"].read_text(errors="replace")
    assert "broker stopped" in log, f"the broker did not stop cleanly:\n{log[-2000:]}\n--- job output\n{output}"
    assert "Traceback" not in log
    return log


def rank_ids(out: Path, ranks: int, epochs: int) -> list[list[np.ndarray]]:
    """Per epoch, per rank: the ids the rank trained on (``rank<r>-epoch<e>.npz``, none dropped)."""
    found = []
    for e in range(epochs):
        ids = []
        for r in range(ranks):
            with np.load(out / f"rank{r}-epoch{e}.npz") as data:
                assert data["dropped_id"].size == 0, f"rank {r} dropped {data['dropped_id'].size} rows in epoch {e}"
                ids.append(data["id"])
        found.append(ids)
    return found


def assert_every_row_once(epochs: list[list[np.ndarray]], expected: list[np.ndarray],
                          steps: list[list[int]]) -> None:
    """Per epoch: the ranks' ids together are that epoch's ids exactly once, and every rank took as many steps
    (``PARTITIONS * ROWS / BATCH`` batches shared by two ranks)."""
    for epoch, (ranks_ids, ids, ranks_steps) in enumerate(zip(epochs, expected, steps)):
        np.testing.assert_array_equal(np.sort(np.concatenate(ranks_ids)), ids, err_msg=f"epoch {epoch}")
        assert ranks_steps == [PARTITIONS * ROWS // BATCH // 2] * 2, f"epoch {epoch}: steps {ranks_steps}"


def test_the_mpi_recipe_trains_under_srun_pmi2_and_stops_its_broker_cleanly(slurm, tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    fields = sbatch(slurm, "sparkbus-train.sbatch", tmp_path, {"TRAIN_SCRIPT": str(HERE / "rank_main.py")},
                    "--out", str(out), "--epochs", str(EPOCHS))
    assert_clean_run(fields)
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["size"] for s in summaries] == [2, 2]
    per_epoch = PARTITIONS * ROWS             # slurm_feed.py: epoch e has the ids e * per_epoch ... + per_epoch - 1
    assert_every_row_once(rank_ids(out, 2, EPOCHS), [np.arange(e * per_epoch, (e + 1) * per_epoch)
                                                     for e in range(EPOCHS)],
                          [[s["epochs"][e]["batches"] for s in summaries] for e in range(EPOCHS)])


def test_the_torch_recipe_trains_ddp_under_plain_srun_without_mpi(slurm, tmp_path):
    """examples/train_ddp.py (the recipe's default) under srun: gloo over loopback, BatchStream(rank="auto"), fed by
    its own Spark-free feed; no rank imports mpi4py (the ranks would fail: it is refused in their environment)."""
    out = tmp_path / "ranks"
    refuse = tmp_path / "no-mpi"
    refuse.mkdir()
    (refuse / "sitecustomize.py").write_text(NO_MPI)
    feed = (f"python {ROOT / 'examples' / 'train_ddp.py'} --feed \"$SPARKBUS_FEED_ADDRESS\" --no-spark "
            f"--epochs {EPOCHS} --rows {PARTITIONS * ROWS} --partitions {PARTITIONS} --batch-size {BATCH}")
    (master_port,) = free_ports(1)
    fields = sbatch(slurm, "sparkbus-train-torch.sbatch", tmp_path,
                    {"FEED_CMD": feed, "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": "lo",
                     "PYTHONPATH": str(refuse)},
                    "--epochs", str(EPOCHS), "--out", str(out), "--record-ids", "--timeout", "60")
    assert_clean_run(fields)
    assert f"MASTER_PORT={master_port}" in fields["output"]
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(s["rank"], s["size"]) for s in summaries] == [(0, 2), (1, 2)]
    assert summaries[0]["weights_sha256"] == summaries[1]["weights_sha256"]     # DDP kept them in step
    assert_every_row_once(rank_ids(out, 2, EPOCHS), [np.arange(PARTITIONS * ROWS)] * EPOCHS,
                          [[s["epochs"][e]["steps"] for s in summaries] for e in range(EPOCHS)])

