"""torch DistributedDataParallel ranks started by torchrun (gloo on CPU, no MPI) on one stream of a broker started
through its CLI: examples/train_ddp.py, with ``BatchStream(address, rank="auto")``, fed by its Spark-free feed.

Every run is bounded: torchrun and the feed are children of the test, killed with all they started when their
time runs out (a DDP rank left alone in an allreduce is a failure of the test, not a stuck suite), and the
example's gloo collectives time out too (``--timeout``).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness import Children, run_child, steps_of

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
DEPLOY = ROOT / "deploy" / "run-ranks-torchrun.sh"
SIZE = 2
RUN_SECONDS = 75.0        # a torchrun job of these sizes takes 5-10 s on 2 idle cores
COLLECTIVE_TIMEOUT = 30   # the example's gloo and BatchStream timeout: a hang fails the job before the test's bound

# hydra, on a loaded machine, now and then fails a launch with this before any rank runs (as test_images.py meets
# it); the broker then still holds every batch of the stream, so the ranks are started again, once.
HYDRA_LAUNCH_FAILURE = "process reading stdin too slowly"

pytest.importorskip("torch")
if not TORCHRUN.exists():
    pytest.skip(f"no torchrun beside {sys.executable}", allow_module_level=True)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for torchrun's rendezvous store (rank 0 binds it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class TorchrunJob:
    """``torchrun --nproc-per-node 2 examples/train_ddp.py``: its process and the directory its ranks write to."""

    proc: subprocess.Popen
    out: Path
    size: int = SIZE

    def wait(self, timeout: float = RUN_SECONDS) -> list[dict]:
        """Every rank's figures (``rank<r>.json``) once torchrun exited 0 within ``timeout``."""
        stdout, stderr = Children.finish(self.proc, timeout, "torchrun")
        assert self.proc.returncode == 0, f"torchrun failed ({self.proc.returncode}):\n{stdout[-2000:]}\n" \
                                          f"{stderr[-8000:]}"
        assert "weights identical on every rank" in stdout, stdout[-2000:]
        return [json.loads((self.out / f"rank{r}.json").read_text()) for r in range(self.size)]

    def ids(self, rank: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The ids rank ``rank`` trained on in ``epoch``, and those dropped on it to keep the ranks even."""
        with np.load(self.out / f"rank{rank}-epoch{epoch}.npz") as data:
            return data["id"], data["dropped_id"]


@pytest.fixture
def start_torchrun(children, tmp_path):
    """``start_torchrun(ranks_address, *flags, deploy=False)``: examples/train_ddp.py under ``torchrun
    --nproc-per-node 2`` on loopback (``deploy``: through deploy/run-ranks-torchrun.sh), writing to a directory of
    its own; killed with its ranks at the end of the test if still running."""
    count = 0

    def start(address: str, *flags: str, deploy: bool = False, size: int = SIZE) -> TorchrunJob:
        nonlocal count
        out = tmp_path / f"ddp-{count}"
        count += 1
        ours = ["--out", out, "--timeout", str(COLLECTIVE_TIMEOUT), *flags]
        if deploy:       # as an operator starts them: the broker's host and ranks port, torchrun's port
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            command, env = [DEPLOY, *ours], {"SPARKBUS_BROKER": host, "SPARKBUS_RANKS_PORT": port,
                                             "NPROC": str(size), "MASTER_PORT": str(free_port())}
        else:
            command, env = [TORCHRUN, "--nproc-per-node", str(size), "--master-addr", "127.0.0.1",
                            "--master-port", str(free_port()), EXAMPLE, "--ranks", address, *ours], {}
        proc = children.spawn(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return TorchrunJob(proc, out, size)

    return start


def feed(broker, stream: str, epochs: int, rows: int, *flags: str) -> None:
    """The example's Spark-free feed of ``epochs`` reshuffled epochs of ``rows`` rows (ids 0 .. rows - 1)."""
    run_child([sys.executable, EXAMPLE, "--feed", broker.feed, "--control", broker.control, "--no-spark",
               "--stream", stream, "--epochs", str(epochs), "--rows", str(rows), *flags], 60, check=True)


def finish_mpi_ranks(start_ranks, ranks, address: str, *flags: str) -> tuple[Any, list[dict]]:
    """The mpiexec ranks' summaries once they exited 0 (started once more after a failed hydra launch)."""
    for attempt in range(2):
        _, err = Children.finish(ranks.proc, RUN_SECONDS, "the mpiexec ranks")
        if ranks.proc.returncode == 0:
            break
        assert not attempt and HYDRA_LAUNCH_FAILURE in err and not any(ranks.out.iterdir()), \
            f"the mpiexec ranks failed ({ranks.proc.returncode}):\n{err[-3000:]}"
        ranks = start_ranks(SIZE, address, *flags)
    return ranks, [json.loads((ranks.out / f"rank{r}.json").read_text()) for r in range(SIZE)]


def check_equal_steps(figures: list[dict], epochs: int, first_epoch: int = 0) -> None:
    """Every rank took as many steps as every other in each epoch (the broker's epochs ``first_epoch ..``), one per
    batch its stream yielded."""
    for epoch in range(epochs):
        steps = [f["epochs"][epoch]["steps"] for f in figures]
        assert steps[0] > 0 and steps == [steps[0]] * len(figures), (epoch, steps)
        assert [f["epochs"][epoch]["batches"] for f in figures] == steps
        assert [f["epochs"][epoch]["broker_epoch"] for f in figures] == [first_epoch + epoch] * len(figures)
        assert all(f["epochs"][epoch]["steps_per_rank"] == steps for f in figures)


def fed_batches(rows: int, partitions: int, batch_size: int) -> int:
    """The batches of an epoch of the example's feed: each partition cut into ``batch_size`` rows, the last shorter."""
    return sum(-(-len(part) // batch_size) for part in np.array_split(np.arange(rows), partitions))


def check_every_row_once(job: TorchrunJob, figures: list[dict], epochs: int, rows: int, batches: int) -> None:
    """Per epoch, the ids trained on by all ranks are ``0 .. rows - 1``, each exactly once (none dropped: the
    default remainder shares the epoch's last batches out by rows), and every rank took the epoch's steps."""
    for epoch in range(epochs):
        counts = [(f["epochs"][epoch]["batches"], f["epochs"][epoch]["dropped_batches"]) for f in figures]
        assert counts == [(steps_of(batches, job.size), 0)] * job.size, (epoch, counts)
        kept, dropped = zip(*(job.ids(r, epoch) for r in range(job.size)))
        every = np.sort(np.concatenate(kept + dropped))
        np.testing.assert_array_equal(every, np.arange(rows))
        assert sum(len(d) for d in dropped) == sum(f["epochs"][epoch]["dropped_rows"] for f in figures)
        assert sum(f["epochs"][epoch]["dropped_batches"] for f in figures) <= job.size - 1
        assert [f["epochs"][epoch]["rows"] for f in figures] == [len(k) for k in kept]
        assert figures[0]["epochs"][epoch]["all_rows"] == sum(len(k) for k in kept)


def test_ddp_ranks_take_equal_steps_and_end_with_identical_weights_and_a_falling_loss(start_broker_process,
                                                                                       start_torchrun):
    epochs, rows = 4, 3_300
    broker = start_broker_process()
    job = start_torchrun(broker.ranks, "--stream", "ddp", "--epochs", str(epochs), "--record-ids")
    # 3 partitions of 11 batches an epoch, each partition one pack (the feeder's default): 33 batches, one too many
    feed(broker, "ddp", epochs, rows, "--batch-size", "100", "--partitions", "3")
    figures = job.wait()
    check_equal_steps(figures, epochs)
    check_every_row_once(job, figures, epochs, rows, fed_batches(rows, 3, 100))
    digests = {f["weights_sha256"] for f in figures}
    assert len(digests) == 1                                     # bit-identical weights on every rank
    losses = [e["loss"] for e in figures[0]["epochs"]]
    assert [[e["loss"] for e in f["epochs"]] for f in figures] == [losses] * SIZE   # the loss of all ranks' rows
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_slow_rank_still_takes_as_many_steps_and_every_row_arrives_once(start_broker_process, start_torchrun):
    epochs, rows = 2, 3_050
    broker = start_broker_process()
    # rank 1 sleeps 15 ms a step; one batch per message (no packs), 63 an epoch; a shuffle buffer on the ranks
    job = start_torchrun(broker.ranks, "--stream", "slow", "--epochs", str(epochs), "--record-ids",
                         "--slow-rank", "1", "--slow-seconds", "0.015", "--shuffle-buffer", "3")
    feed(broker, "slow", epochs, rows, "--batch-size", "50", "--partitions", "3", "--pack-bytes", "0")
    figures = job.wait()
    check_equal_steps(figures, epochs)
    check_every_row_once(job, figures, epochs, rows, fed_batches(rows, 3, 50))
    assert len({f["weights_sha256"] for f in figures}) == 1


def test_torchrun_and_mpiexec_ranks_train_with_equal_steps_from_the_same_broker(start_broker_process, start_torchrun,
                                                                               start_ranks, children):
    epochs, rows = 2, 3_000
    broker = start_broker_process()
    job = start_torchrun(broker.ranks, "--stream", "ddp", "--epochs", str(epochs), "--record-ids", deploy=True)
    mpi_flags = ("--stream", "mpi", "--epochs", str(epochs), "--slow-rank", "1", "--slow-seconds", "0.005")
    mpi = start_ranks(SIZE, broker.ranks, *mpi_flags)
    feeding = [children.spawn([sys.executable, EXAMPLE, "--feed", broker.feed, "--control", broker.control,
                               "--no-spark", "--stream", stream, "--epochs", str(epochs), "--rows", str(rows),
                               "--batch-size", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for stream in ("ddp", "mpi")]                      # both streams fed at once
    for proc in feeding:
        _, err = Children.finish(proc, 60, "the feed")
        assert proc.returncode == 0, err[-3000:]
    figures = job.wait()
    check_equal_steps(figures, epochs)
    check_every_row_once(job, figures, epochs, rows, fed_batches(rows, 4, 100))
    assert len({f["weights_sha256"] for f in figures}) == 1
    mpi, summaries = finish_mpi_ranks(start_ranks, mpi, broker.ranks, *mpi_flags)
    for epoch in range(epochs):
        batches = [s["epochs"][epoch]["batches"] for s in summaries]
        assert batches[0] > 0 and batches == [batches[0]] * SIZE, (epoch, batches)
        kept = [mpi.epoch(r, epoch)["id"] for r in range(SIZE)]
        dropped = [mpi.epoch(r, epoch)["dropped_id"] for r in range(SIZE)]
        np.testing.assert_array_equal(np.sort(np.concatenate(kept + dropped)), np.arange(rows))
        assert sum(s["epochs"][epoch]["dropped_batches"] for s in summaries) <= SIZE - 1
    # One broker served both jobs, every epoch whole, and granted the steps each job took.
    streams = broker.stats()["streams"]
    for name, steps in (("ddp", [e["steps"] for e in figures[0]["epochs"]]),
                        ("mpi", [e["batches"] for e in summaries[0]["epochs"]])):
        fed = [streams[name]["epochs"][str(e)] for e in range(epochs)]
        assert [(e["ended"], e["rows_in"], e["steps"]) for e in fed] == [(True, rows, n) for n in steps]


def test_a_torchrun_job_started_again_with_another_world_size_trains_the_epochs_the_first_left(start_broker_process,
                                                                                                start_torchrun):
    epochs, rows = 4, 3_300
    broker = start_broker_process()
    feed(broker, "again", epochs, rows, "--batch-size", "100", "--partitions", "3")    # every epoch held before
    first = start_torchrun(broker.ranks, "--stream", "again", "--epochs", "2")
    figures = first.wait()
    check_equal_steps(figures, 2)
    # The job started again with 3 ranks (a resume, torchrun's elastic restart), while the first one's windows held
    # batches of epoch 2: at that epoch boundary the broker takes the new group, epochs 2 and 3, every row once.
    # (At f7eccb4 a new group, of either size, waited --rejoin-grace for those batches, then stalled: DDP deadlocked.)
    again = start_torchrun(broker.ranks, "--stream", "again", "--epochs", "2", "--record-ids", "--timeout", "15",
                           size=3)
    figures = again.wait()
    check_equal_steps(figures, 2, first_epoch=2)
    check_every_row_once(again, figures, 2, rows, fed_batches(rows, 3, 100))
