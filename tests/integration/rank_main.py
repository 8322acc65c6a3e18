"""A test rank: consume epochs through BatchStream and record what arrived. Run under ``mpiexec -n N``.

Writes ``OUT/rank{r}.json`` (per epoch: batches, rows, dropped, column dtypes and shapes) and
``OUT/rank{r}-epoch{e}.npz`` (every column received, concatenated, plus ``dropped_id``).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from worker import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--ranks", required=True)
parser.add_argument("--stream", default="train")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--out", required=True)
parser.add_argument("--even", choices=["auto", "yes", "no"], default="auto")
parser.add_argument("--prefetch", type=int, default=4)
parser.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-seconds per batch")
parser.add_argument("--slow-seconds", type=float, default=0.0)
parser.add_argument("--stall-file", help="wait for this file to exist before consuming")
parser.add_argument("--timeout", type=float, default=60.0)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
out = Path(args.out)
even = {"auto": None, "yes": True, "no": False}[args.even]


def main():
    dropped = []
    summary = {"rank": rank, "size": comm.Get_size(), "epochs": []}
    with BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch, even=even,
                     timeout=args.timeout, on_drop=lambda b: dropped.append(b["id"].copy())) as stream:
        if args.stall_file:
            deadline = time.monotonic() + args.timeout
            while not os.path.exists(args.stall_file):
                if time.monotonic() > deadline:
                    raise TimeoutError("stall file never appeared")
                time.sleep(0.05)
        for e in range(args.epochs):
            dropped.clear()
            columns = {}
            for batch in stream.epoch():
                for name, array in batch.items():
                    columns.setdefault(name, []).append(array.copy())
                if rank == args.slow_rank:
                    time.sleep(args.slow_seconds)
            stats = stream.stats.epochs[-1]
            joined = {k: np.concatenate(v) for k, v in columns.items()}
            np.savez(out / f"rank{rank}-epoch{e}.npz", **joined,
                     dropped_id=np.concatenate(dropped) if dropped else np.zeros(0, np.int64))
            summary["epochs"].append({
                "epoch": stats.epoch, "batches": stats.batches, "rows": stats.rows,
                "dropped_batches": stats.dropped_batches, "dropped_rows": stats.dropped_rows,
                "wait_seconds": stats.wait_seconds,
                "dtypes": {k: str(v.dtype) for k, v in joined.items()},
                "shapes": {k: list(v.shape) for k, v in joined.items()}})
    (out / f"rank{rank}.json").write_text(json.dumps(summary))


try:
    main()
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    comm.Abort(1)        # never leave the other ranks waiting in a collective
