"""``BatchStream``'s group: ``comm=``, ``rank=``/``size=``, ``rank="auto"`` (``worker.launcher``), and the usage
errors, checked before any socket is made."""

from __future__ import annotations

import sys

import pytest

from sparkbus.worker import BatchStream
from sparkbus.worker.launcher import launcher_rank
from sparkbus.worker.stream import _group


def test_the_launchers_variables_are_tried_in_the_documented_order():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "PMI_RANK": "2", "PMI_SIZE": "4"}
    assert launcher_rank(env) == (2, 4, "PMI (MPICH, Intel MPI, srun --mpi=pmi2)")
    env |= {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert launcher_rank(env)[:2] == (1, 2)
    env |= {"RANK": "0", "WORLD_SIZE": "16"}
    assert launcher_rank(env) == (0, 16, "torchrun")
    assert launcher_rank({"SLURM_PROCID": "5", "SLURM_NTASKS": "6"})[:2] == (5, 6)


def test_an_initialised_torch_group_comes_first(monkeypatch):
    class Dist:
        is_available = staticmethod(lambda: True)
        is_initialized = staticmethod(lambda: True)
        get_rank = staticmethod(lambda: 1)
        get_world_size = staticmethod(lambda: 3)

    monkeypatch.setitem(sys.modules, "torch.distributed", Dist)
    assert launcher_rank({"RANK": "0", "WORLD_SIZE": "2"}) == (1, 3, "torch.distributed")


def test_no_launcher_or_a_bad_variable_is_a_clear_error():
    with pytest.raises(ValueError, match="found no launcher.*RANK/WORLD_SIZE"):
        launcher_rank({})
    with pytest.raises(ValueError, match="not a rank and a size"):
        launcher_rank({"RANK": "zero", "WORLD_SIZE": "2"})


class Comm:
    def Get_rank(self):
        return 1

    def Get_size(self):
        return 4


@pytest.mark.parametrize("args, message", [
    (dict(comm=Comm(), rank=0, size=2), "not both"),
    (dict(rank=0), "needs size="),
    (dict(size=2), "needs rank="),
    (dict(rank=2, size=2), "outside a group of size 2"),
    (dict(rank="first", size=2), "a number or 'auto'"),
])
def test_usage_errors(args, message):
    with pytest.raises(ValueError, match=message):
        _group(args.get("comm"), args.get("rank"), args.get("size"))


def test_the_group_comes_from_comm_from_rank_and_size_or_from_the_launcher(monkeypatch):
    assert _group(Comm(), None, None) == (1, 4)
    assert _group(None, 2, 3) == (2, 3)
    assert _group(None, None, None) == (0, 1)             # an independent consumer, never a silent group
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _group(None, "auto", None) == (1, 2)
    with pytest.raises(ValueError, match="size=3, but torchrun says the group has 2 ranks"):
        _group(None, "auto", 3)


def test_steps_over_mpi_need_a_communicator():
    with pytest.raises(ValueError, match="needs comm="):
        BatchStream("tcp://127.0.0.1:1", rank=0, size=2, steps="mpi")
