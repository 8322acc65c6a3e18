"""A benchmark rank of the Parquet-staging baseline: read this rank's share of the staged files with pyarrow.

    mpiexec -n N python benchmarks/parquet_reader.py --dir STAGING --go FILE --out DIR [--batch-size 1024]

Writes ``ready-<rank>``, waits for ``--go`` (Spark's write done), reads ``sorted(*.parquet)[rank::N]`` into numpy
columns as a training loop would get them, and writes ``rank<rank>.json`` (first and last batch).
"""

import argparse
import time
from pathlib import Path

import pyarrow.parquet as pq
from mpi4py import MPI
from rank_files import ready_path, run_or_abort, wait_for_go, write_figures

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--go", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--batch-size", type=int, default=1024)
parser.add_argument("--timeout", type=float, default=300.0)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
out = Path(args.out)


def numpy_columns(record_batch) -> dict:
    """Each column as numpy, as a training loop gets it: ``[n]`` for numbers, ``[n, k]`` for arrays of ``k``.

    The baseline's own conversion (pyarrow only), so that it does not depend on the feeder's internals.
    """
    columns = {}
    for name, array in zip(record_batch.schema.names, record_batch.columns):
        if hasattr(array, "flatten"):                 # a list column of equal-length arrays
            columns[name] = array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), -1)
        else:
            columns[name] = array.to_numpy(zero_copy_only=False)
    return columns


def main() -> None:
    ready_path(out, rank).touch()
    wait_for_go(args.go, args.timeout)
    t_start = time.time()
    files = sorted(Path(args.dir).glob("*.parquet"))[rank::size]
    t_first = t_last = None
    batches = rows = nbytes = 0
    for path in files:
        for record_batch in pq.ParquetFile(path).iter_batches(batch_size=args.batch_size):
            columns = numpy_columns(record_batch)
            t_last = time.time()
            if t_first is None:
                t_first = t_last
            batches += 1
            rows += record_batch.num_rows
            nbytes += sum(a.nbytes for a in columns.values())
    result = {"rank": rank, "size": size, "files": len(files), "t_start": t_start, "t_first": t_first,
              "t_last": t_last, "t_end": time.time(), "batches": batches, "rows": rows, "bytes": nbytes}
    write_figures(out, rank, result)


run_or_abort(main, comm)
