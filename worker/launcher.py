"""A rank's number and its group's size, from whatever started it: ``BatchStream(address, rank="auto")``.

In this order, the first that answers:

1. an initialised ``torch.distributed`` default group (``get_rank()``, ``get_world_size()``);
2. ``RANK`` / ``WORLD_SIZE`` (torchrun, torch's elastic agent, Ray Train, most launchers);
3. ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE`` (Open MPI's mpirun);
4. ``PMI_RANK`` / ``PMI_SIZE`` (MPICH's and Intel MPI's hydra, ``srun --mpi=pmi2``);
5. ``SLURM_PROCID`` / ``SLURM_NTASKS`` (srun).

torch is looked at only if it is imported already: asking never imports it (nor mpi4py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NamedTuple

# (rank variable, size variable, who sets them), in the order they are tried after torch.distributed
VARIABLES = (
    ("RANK", "WORLD_SIZE", "torchrun"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "Open MPI"),
    ("PMI_RANK", "PMI_SIZE", "PMI (MPICH, Intel MPI, srun --mpi=pmi2)"),
    ("SLURM_PROCID", "SLURM_NTASKS", "srun"),
)


class LauncherRank(NamedTuple):
    """This process's rank and its group's size as its launcher set them, and what said so (``source``)."""

    rank: int
    size: int
    source: str          # "torch.distributed", or who sets the variables read: "torchrun", "Open MPI", ...


def launcher_rank(environ: Mapping[str, str] | None = None) -> LauncherRank:
    """``(rank, size, source)``: this process's rank and its group's size, and what said so.

    Raises:
        ValueError: nothing says (not started by a launcher sparkbus knows), or a variable that is not a number.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return LauncherRank(dist.get_rank(), dist.get_world_size(), "torch.distributed")
    environ = os.environ if environ is None else environ
    for rank_name, size_name, source in VARIABLES:
        if rank_name in environ and size_name in environ:
            try:
                rank, size = int(environ[rank_name]), int(environ[size_name])
            except ValueError:
                raise ValueError(f"{rank_name}={environ[rank_name]!r} and {size_name}={environ[size_name]!r} are "
                                 f"not a rank and a size") from None
            return LauncherRank(rank, size, source)
    names = ", ".join(f"{r}/{s}" for r, s, _ in VARIABLES)
    raise ValueError(f"rank='auto' found no launcher: torch.distributed is not initialised and none of {names} is "
                     f"set. Pass rank= and size=, or start the ranks with torchrun, srun or mpirun")
