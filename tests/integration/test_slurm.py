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
from slurm_cluster import OneNodeSlurm, SlurmUnavailable, unavailable

from helpers import free_port_triple, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VENV = Path(sys.executable).parent.parent
EPOCHS, PARTITIONS, ROWS, BATCH = 2, 3, 1000, 50
JOB_SECONDS = 60


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

    try:
        fields = wait_for(ended, JOB_SECONDS, f"job {job} to end", interval=0.2)
    finally:
        if slurm.jobs():
            slurm.run(["scancel", "--full", job], timeout=10)
    output = work / f"sparkbus-train-{job}.out"
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


def assert_every_row_once(epochs: list[list[np.ndarray]], steps: list[list[int]]) -> None:
    """Per epoch: the ranks' ids together are that epoch's ids exactly once, and every rank took as many steps."""
    per_epoch = PARTITIONS * ROWS
    for epoch, (ranks_ids, ranks_steps) in enumerate(zip(epochs, steps)):
        ids = np.sort(np.concatenate(ranks_ids))
        np.testing.assert_array_equal(ids, np.arange(epoch * per_epoch, (epoch + 1) * per_epoch))
        assert len(set(ranks_steps)) == 1, f"epoch {epoch}: unequal steps {ranks_steps}"
        assert ranks_steps[0] == per_epoch // BATCH // 2


def test_the_mpi_recipe_trains_under_srun_pmi2_and_stops_its_broker_cleanly(slurm, tmp_path):
    out = tmp_path / "ranks"
    out.mkdir()
    fields = sbatch(slurm, "sparkbus-train.sbatch", tmp_path, {"TRAIN_SCRIPT": str(HERE / "rank_main.py")},
                    "--out", str(out), "--epochs", str(EPOCHS))
    assert_clean_run(fields)
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [s["size"] for s in summaries] == [2, 2]
    epochs, steps = [], []
    for e in range(EPOCHS):
        ids = []
        for r in range(2):
            with np.load(out / f"rank{r}-epoch{e}.npz") as data:
                ids.append(data["id"])
                assert data["dropped_id"].size == 0
        epochs.append(ids)
        steps.append([s["epochs"][e]["batches"] for s in summaries])
    assert_every_row_once(epochs, steps)

