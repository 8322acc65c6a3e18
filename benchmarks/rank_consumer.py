"""A benchmark rank: one epoch from the bus through BatchStream.

    mpiexec -n N python benchmarks/rank_consumer.py --out DIR --ranks tcp://127.0.0.1:P --stream S
            [--compute SECONDS] [--go FILE] [--even auto|no] [--steps broker|mpi] [--touch]

Writes ``ready-<rank>`` once it joined the broker, waits for ``--go`` if given, sleeps ``--compute`` a batch (the
training step) and writes ``rank<rank>.json``: wall-clock times of the first and last batch, counts, BatchStream's
``wait_seconds`` and ``seconds``, its CPU seconds, with ``--touch`` the bytes of every column, and the directory it
imported ``worker`` from.
"""

import argparse
import os
import time
from pathlib import Path

from mpi4py import MPI
from rank_files import ready_path, run_or_abort, wait_for_go, write_figures

from sparkbus import worker
from sparkbus.worker import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--ranks", required=True)
parser.add_argument("--stream", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--compute", type=float, default=0.0, help="seconds of sleep per batch")
parser.add_argument("--go", help="wait for this file to exist before consuming")
parser.add_argument("--even", choices=["auto", "no"], default="auto",
                    help="no: each rank consumes on its own (a diagnostic: no equal steps)")
parser.add_argument("--steps", choices=["broker", "mpi"], default="broker",
                    help="how even ranks keep equal steps: granted by the broker, or agreed over MPI")
parser.add_argument("--touch", action="store_true",
                    help="add up the bytes of every column of every batch (numpy nbytes; a variable-length "
                         "column's values and offsets), no per-row Python")
parser.add_argument("--timeout", type=float, default=120.0)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
out = Path(args.out)


def column_bytes(column) -> int:
    """Bytes of one column of a batch: a numpy array's, or a variable-length column's values and offsets."""
    if hasattr(column, "offsets") and hasattr(column, "values"):
        return column.values.nbytes + column.offsets.nbytes
    return column.nbytes


def main() -> None:
    with BatchStream(args.ranks, comm=comm, stream=args.stream, even=None if args.even == "auto" else False,
                     timeout=args.timeout, steps=args.steps) as stream:
        ready_path(out, rank).touch()
        if args.go:
            wait_for_go(args.go, args.timeout)
        cpu_start = time.process_time()
        t_first = t_last = None
        touched = 0
        for batch in stream.epoch():
            t_last = time.time()
            t_first = t_first or t_last
            if args.touch:
                touched += sum(column_bytes(column) for column in batch.values())
            if args.compute:
                time.sleep(args.compute)
        ep = stream.stats.epochs[-1]
        result = {"rank": rank, "t_first": t_first, "t_last": t_last, "rows": ep.rows,
                  "dropped_rows": ep.dropped_rows, "wait_seconds": ep.wait_seconds, "seconds": ep.seconds,
                  "cpu_seconds": time.process_time() - cpu_start, "touched_bytes": touched,
                  "module": os.path.dirname(worker.__file__)}     # which sparkbus it imported (2b checks it)
    write_figures(out, rank, result)


run_or_abort(main, comm)
