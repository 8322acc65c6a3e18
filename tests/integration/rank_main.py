"""A test rank: consume epochs through BatchStream and record what arrived. Run under ``mpiexec -n N``.

Writes ``OUT/rank{r}.json`` (per epoch: batches, rows, dropped, column dtypes and shapes),
``OUT/rank{r}-epoch{e}.npz`` (every numpy column received, concatenated, plus ``dropped_id``) and, for the
With ``--values``, also ``OUT/rank{r}-epoch{e}-values.json``: every column's values (``to_pylist()`` of a
RaggedColumn, ``tolist()`` of an array) in arrival order, bytes as ``{"hex": ...}`` and dates as ISO strings,
beside each batch's form (``forms``: per batch, per column, the type's name).
With ``--no-mpi`` it is an independent consumer (``comm=None``) named by ``--name``; with ``--group R/N`` rank R of
a group of N started without MPI (``BatchStream(rank=R, size=N)``, steps granted by the broker).
With ``--stop-after K`` it records its first K batches, writes ``OUT/{name}.stopped``, and hangs until killed.
With ``--checkpoint-at K`` it saves ``stream.state_dict()`` after its K-th batch of epoch 0 to ``OUT/{name}-state.json``
and the ids trained so far (that batch's included) to ``OUT/{name}-checkpoint.npz``; ``--resume DIR`` starts from
``DIR/{name}-state.json`` (``BatchStream(resume=...)``).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from sparkbus.worker import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--ranks", required=True)
parser.add_argument("--stream", default="train")
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--out", required=True)
parser.add_argument("--even", choices=["auto", "yes", "no"], default="auto")
parser.add_argument("--prefetch", type=int, default=4)
parser.add_argument("--prefetch-bytes", type=int, default=None, help="the byte window (default: BatchStream's)")
parser.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-seconds per batch")
parser.add_argument("--slow-seconds", type=float, default=0.0)
parser.add_argument("--stall-file", help="wait for this file to exist before consuming")
parser.add_argument("--stop-after", type=int, default=0, help="after this many batches, record and hang")
parser.add_argument("--leave-after", type=int, default=0, help="leave epoch 0 (break) after this many batches")
parser.add_argument("--raise-rank", type=int, default=-1, help="this rank raises after --raise-after batches")
parser.add_argument("--raise-after", type=int, default=0)
parser.add_argument("--no-mpi", action="store_true")
parser.add_argument("--group", help="R/N: rank R of a group of N started without MPI (BatchStream(rank=, size=))")
parser.add_argument("--steps", choices=["broker", "mpi"], default="broker", help="how even ranks keep equal steps")
parser.add_argument("--remainder", choices=["split", "drop", "pad"], help="default: BatchStream's")
parser.add_argument("--name", help="file name prefix (default rank{r})")
parser.add_argument("--timeout", type=float, default=60.0)
parser.add_argument("--values", action="store_true", help="record every column's values as JSON too")
parser.add_argument("--checkpoint-at", type=int, default=0, help="save state_dict() after this many batches of epoch 0")
parser.add_argument("--resume", help="a directory with a state file written by --checkpoint-at: resume from it")
parser.add_argument("--resume-all", help="a directory with every rank's state file: resume from all of them "
                                         "(a group of another size)")
args = parser.parse_args()

group = {}
if args.group:
    rank, size = (int(n) for n in args.group.split("/"))
    comm, group = None, {"rank": rank, "size": size}
elif args.no_mpi:
    comm, rank = None, 0
else:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
name = args.name or f"rank{rank}"
out = Path(args.out)
even = {"auto": None, "yes": True, "no": False}[args.even]


def jsonable(value):
    if isinstance(value, (bytes, memoryview)):
        return {"hex": bytes(value).hex()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def save(epoch, columns, dropped, objects=None, forms=None):
    if args.values:
        (out / f"{name}-epoch{epoch}-values.json").write_text(json.dumps(
            {"values": {k: jsonable(v) for k, v in objects.items()}, "forms": forms}))
    joined = {k: np.concatenate(v) for k, v in columns.items()}
    np.savez(out / f"{name}-epoch{epoch}.npz", **joined,
             dropped_id=np.concatenate(dropped) if dropped else np.zeros(0, np.int64))
    return joined


def main():
    dropped = []
    summary = {"rank": rank, "size": comm.Get_size() if comm else group.get("size", 1), "epochs": []}
    consumed = 0
    options = {} if args.prefetch_bytes is None else {"prefetch_bytes": args.prefetch_bytes}
    if args.remainder:
        options["remainder"] = args.remainder
    if args.resume:
        options["resume"] = json.loads((Path(args.resume) / f"{name}-state.json").read_text())
    if args.resume_all:
        options["resume"] = [json.loads(p.read_text()) for p in sorted(Path(args.resume_all).glob("*-state.json"))]
    with BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch, **options, even=even,
                     timeout=args.timeout, on_drop=lambda b: dropped.append(b["id"].copy()), steps=args.steps,
                     **group) as stream:
        if args.stall_file:
            deadline = time.monotonic() + args.timeout
            while not os.path.exists(args.stall_file):
                if time.monotonic() > deadline:
                    raise TimeoutError("stall file never appeared")
                time.sleep(0.05)
        for e in range(args.epochs):
            dropped.clear()
            columns, objects, forms = {}, {}, []
            for batch in stream.epoch():
                if args.stop_after and consumed == args.stop_after:
                    save(e, columns, dropped, objects, forms)   # this batch is not acknowledged: not recorded
                    (out / f"{name}.stopped").touch()
                    time.sleep(3600)
                if e == 0 and args.leave_after and consumed == args.leave_after:
                    break
                if rank == args.raise_rank and consumed == args.raise_after:
                    raise RuntimeError(f"rank {rank} fails on purpose")
                if args.values:
                    forms.append({key: type(array).__name__ for key, array in batch.items()})
                for key, array in batch.items():
                    if type(array) is np.ndarray:
                        columns.setdefault(key, []).append(array.copy())
                    if args.values:
                        objects.setdefault(key, []).extend(
                            array.to_pylist() if hasattr(array, "to_pylist") else array.tolist())
                consumed += 1
                if e == 0 and args.checkpoint_at and consumed == args.checkpoint_at:
                    (out / f"{name}-state.json").write_text(json.dumps(stream.state_dict()))
                    np.savez(out / f"{name}-checkpoint.npz", id=np.concatenate(columns["id"]))
                if rank == args.slow_rank:
                    time.sleep(args.slow_seconds)
            stats = stream.stats.epochs[-1]
            joined = save(e, columns, dropped, objects, forms)
            summary["epochs"].append({
                "epoch": stats.epoch, "batches": stats.batches, "rows": stats.rows,
                "dropped_batches": stats.dropped_batches, "dropped_rows": stats.dropped_rows,
                "cut_batches": stats.cut_batches, "repeated_batches": stats.repeated_batches,
                "repeated_rows": stats.repeated_rows,
                "wait_seconds": stats.wait_seconds,
                "dtypes": {k: str(v.dtype) for k, v in joined.items() if k != "dropped_id"},
                "shapes": {k: list(v.shape) for k, v in joined.items() if k != "dropped_id"}})
    summary["skipped_batches"] = stream.stats.skipped_batches
    summary["imported_mpi4py"] = "mpi4py" in sys.modules
    (out / f"{name}.json").write_text(json.dumps(summary))


main()
