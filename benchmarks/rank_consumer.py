"""A benchmark rank: iterate one epoch of a stream through BatchStream and record when batches arrived.

    mpiexec -n N python benchmarks/rank_consumer.py --ranks tcp://127.0.0.1:P --stream S --out DIR
            [--compute SECONDS] [--go FILE] [--prefetch 4] [--touch] [--steps broker|mpi]

Writes ``ready-<rank>`` once joined, waits for ``--go`` if given, sleeps ``--compute`` a batch (the training step),
and writes ``rank<rank>.json``: first and last batch, counts, BatchStream's ``wait_seconds`` and ``seconds``, its
own timing of ``next()`` (first, between, last), with ``--touch`` the bytes of every column, its CPUs and the
directory it imported ``worker`` from.
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
parser.add_argument("--prefetch", type=int, default=4)
parser.add_argument("--even", choices=["auto", "no"], default="auto",
                    help="no: each rank consumes on its own (a diagnostic: no per-step agreement over MPI)")
parser.add_argument("--steps", choices=["broker", "mpi"], default="broker",
                    help="how even ranks keep equal steps: granted by the broker, or agreed over MPI")
parser.add_argument("--no-verify", action="store_true", help="skip the checksum check (a diagnostic)")
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
    with BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch,
                     even=None if args.even == "auto" else False, verify=not args.no_verify,
                     timeout=args.timeout, steps=args.steps) as stream:
        ready_path(out, rank).touch()
        if args.go:
            wait_for_go(args.go, args.timeout)
        t_start, cpu_start = time.time(), time.process_time()
        t_first = t_last = None
        touched = 0
        waits = []                      # each time the loop asked for a batch: how long until it had one
        batches = stream.epoch()
        while True:
            asked = time.time()
            try:
                batch = next(batches)
            except StopIteration:
                waits.append(time.time() - asked)
                break
            t_last = time.time()
            waits.append(t_last - asked)
            if args.touch:
                touched += sum(column_bytes(column) for column in batch.values())
            if t_first is None:
                t_first = t_last
            if args.compute:
                time.sleep(args.compute)
        t_end, cpu = time.time(), time.process_time() - cpu_start
        ep = stream.stats.epochs[-1]
        steady = waits[1:-1]
        result = {"rank": rank, "size": comm.Get_size(), "t_start": t_start, "t_first": t_first,
                  "t_last": t_last, "t_end": t_end, "batches": ep.batches, "rows": ep.rows, "bytes": ep.bytes,
                  "dropped_batches": ep.dropped_batches, "dropped_rows": ep.dropped_rows,
                  "wait_seconds": ep.wait_seconds, "seconds": ep.seconds, "cpu_seconds": cpu,
                  # the loop's own view of the same waits: the first batch, the steady state, the epoch's end
                  "wait_first": waits[0] if len(waits) > 1 else 0.0, "wait_end": waits[-1],
                  "wait_steady": sum(steady), "wait_steady_max": max(steady, default=0.0),
                  "waits_over_1ms": sum(1 for w in steady if w > 1e-3), "touched_bytes": touched,
                  # where this rank ran and which sparkbus it imported (the benchmark checks both)
                  "affinity": sorted(os.sched_getaffinity(0)), "module": os.path.dirname(worker.__file__)}
    write_figures(out, rank, result)


run_or_abort(main, comm)
