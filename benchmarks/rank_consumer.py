"""A benchmark rank: one epoch from the bus through BatchStream, or (``--parquet``) from staged Parquet files.

    mpiexec -n N python benchmarks/rank_consumer.py --out DIR (--ranks tcp://127.0.0.1:P --stream S | --parquet DIR)
            [--compute SECONDS] [--go FILE] [--prefetch 4] [--touch] [--steps broker|mpi] [--batch-size 1024]

Writes ``ready-<rank>`` once it can start (joined the broker), waits for ``--go`` if given, and writes
``rank<rank>.json`` with wall-clock times of the first and last batch and counts. From the bus it sleeps
``--compute`` a batch (the training step) and adds BatchStream's ``wait_seconds`` and ``seconds``, its own timing
of ``next()`` (first, between, last), with ``--touch`` the bytes of every column, its CPUs and the directory it
imported ``worker`` from. ``--parquet``: the staging baseline, files ``sorted(*.parquet)[rank::N]`` read with pyarrow
in batches of ``--batch-size`` rows into numpy columns as a training loop would get them.
"""

import argparse
import os
import time
from pathlib import Path

import pyarrow.parquet as pq
from mpi4py import MPI
from rank_files import ready_path, run_or_abort, wait_for_go, write_figures

from sparkbus import worker
from sparkbus.worker import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--ranks")
parser.add_argument("--stream")
parser.add_argument("--parquet", help="read this rank's share of the Parquet files in this directory instead")
parser.add_argument("--batch-size", type=int, default=1024, help="rows a batch read from Parquet")
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


def numpy_columns(record_batch) -> dict:
    """Each column as numpy, as a training loop gets it (``[n, k]`` for arrays of ``k``), by pyarrow alone."""
    columns = {}
    for name, array in zip(record_batch.schema.names, record_batch.columns):
        if hasattr(array, "flatten"):                 # a list column of equal-length arrays
            columns[name] = array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), -1)
        else:
            columns[name] = array.to_numpy(zero_copy_only=False)
    return columns


def from_parquet() -> None:
    ready_path(out, rank).touch()
    wait_for_go(args.go, args.timeout)
    t_start = time.time()
    files = sorted(Path(args.parquet).glob("*.parquet"))[rank::comm.Get_size()]
    t_first = t_last = None
    batches = rows = nbytes = 0
    for path in files:
        for record_batch in pq.ParquetFile(path).iter_batches(batch_size=args.batch_size):
            columns = numpy_columns(record_batch)
            t_last = time.time()
            t_first = t_first or t_last
            batches += 1
            rows += record_batch.num_rows
            nbytes += sum(a.nbytes for a in columns.values())
    write_figures(out, rank, {"rank": rank, "size": comm.Get_size(), "files": len(files), "t_start": t_start,
                              "t_first": t_first, "t_last": t_last, "t_end": time.time(), "batches": batches,
                              "rows": rows, "bytes": nbytes})


def main() -> None:
    if args.parquet:
        return from_parquet()
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
