"""``sparkbus.worker.collectives.abort_on_error`` under ``mpiexec -n 2``: a rank that raises aborts the job, so its
peer, waiting in a collective, is not left there; on one rank the exception is raised as it was."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from sparkbus.launch.mpi import loopback_env, mpiexec_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent("""
    from mpi4py import MPI

    from sparkbus.worker.collectives import abort_on_error

    comm = MPI.COMM_WORLD
    with abort_on_error():
        if comm.Get_rank() == comm.Get_size() - 1:
            raise ValueError(f"rank {comm.Get_rank()} failed on purpose")
        comm.Barrier()                      # the peer that would wait forever without the abort
    print("past the barrier", flush=True)
""")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_failing_rank_ends_the_job_with_its_error_and_no_rank_waits(tmp_path, ranks):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    done = subprocess.run(mpiexec_python(ranks, script), env={**os.environ, **loopback_env()},
                          capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    assert f"ValueError: rank {ranks - 1} failed on purpose" in done.stderr, done.stderr[-2000:]
    assert "past the barrier" not in done.stdout
