"""MPI ranks on this machine: the venv's ``mpiexec`` (hydra, from the mpich wheel) with its network on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

MPIEXEC = Path(sys.executable).parent / "mpiexec"     # the mpich wheel installs it next to the venv's python

# The mpich wheel's network layer (UCX/libfabric) would otherwise also listen on the machine's other NICs.
LOOPBACK_MPI = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo"}


def loopback_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The :data:`LOOPBACK_MPI` variables that ``environ`` (default ``os.environ``) does not set already."""
    environ = os.environ if environ is None else environ
    return {name: value for name, value in LOOPBACK_MPI.items() if name not in environ}


def mpiexec_python(n: int, script: Path | str, *args: str) -> list[str]:
    """The argv of ``mpiexec -n n python -u script args``, with this interpreter (the venv's) on every rank.

    Raises:
        FileNotFoundError: no ``mpiexec`` beside this interpreter (the ``mpi`` extra is not installed).
    """
    if not MPIEXEC.exists():
        raise FileNotFoundError(f"no mpiexec at {MPIEXEC}: the local MPI runs need the mpich wheel, "
                                "pip install 'sparkbus[mpi]'")
    return [str(MPIEXEC), "-n", str(n), sys.executable, "-u", str(script), *args]
