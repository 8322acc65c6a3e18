"""A benchmark rank: epochs from the bus through BatchStream, what it saw written to ``OUT/NAME.json``.

    mpiexec -n N python benchmarks/rank.py --out DIR --ranks ADDRESS --stream S [options]   (NAME: rank<r>)
    torchrun --nproc-per-node N benchmarks/rank.py --launch torch ...      (--launch auto: mpiexec, no mpi4py)
    python benchmarks/rank.py --launch none --name NAME ...   (the fault table's consumers; --group R/N)

Touches ``OUT/NAME.ready`` once it joined the broker, waits for ``--go`` if given, sleeps ``--compute`` a batch (the
training step), and per epoch records wall-clock times of its first and last batch and BatchStream's figures; with
``--touch`` the bytes of every column, with ``--lengths COLUMN`` per batch its rows, real tokens and longest row,
with ``--ids`` every id in ``OUT/NAME.ids`` (one ``O_APPEND`` write a batch: what the kernel has is what the loop
trained, even if SIGKILLed). ``images_rank.py`` shares its files (:func:`ready`, :func:`finish`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.launch.processes import wait_for
from sparkbus.worker.collectives import abort_on_error


def ready(out: Path, name: str) -> None:
    (out / f"{name}.ready").touch()


def wait_for_go(go: str | Path, timeout: float) -> None:
    wait_for(lambda: os.path.exists(go), timeout, f"{go} to appear", interval=0.002)


def finish(out: Path, name: str, figures: dict) -> None:
    """Write ``figures`` to ``NAME.json`` at once (never half a file for the benchmark to read)."""
    tmp = out / f"{name}.json.tmp"
    tmp.write_text(json.dumps(figures))
    os.replace(tmp, out / f"{name}.json")


def lengths_of(column: Any) -> np.ndarray:
    """Row lengths of a variable-length column: a ragged column's, or ``k`` per row of a ``[n, k]`` array."""
    if hasattr(column, "lengths"):
        return np.asarray(column.lengths())
    return np.full(len(column), column.shape[1] if column.ndim > 1 else 1, dtype=np.int64)


def column_bytes(column: Any) -> int:
    """A numpy array's bytes, or a variable-length column's values and offsets."""
    if hasattr(column, "offsets") and hasattr(column, "values"):
        return column.values.nbytes + column.offsets.nbytes
    return column.nbytes


def one_epoch(stream: Any, args: argparse.Namespace, epoch: int, name: str, ids: int | None) -> dict:
    t_first = t_last = None
    touched = 0
    batches: list[list[int]] = []          # --lengths: [rows, real tokens, longest row] per batch
    sources: list[str] = []
    slots: list[int] = []
    for batch in stream.epoch():
        t_last = time.time()
        t_first = t_first or t_last
        if ids is not None:
            os.write(ids, np.ascontiguousarray(batch["id"], dtype=np.int64).tobytes())
        if args.touch:
            touched += sum(column_bytes(column) for column in batch.values())
        if args.lengths:
            n = lengths_of(batch[args.lengths])
            batches.append([int(n.size), int(n.sum()), int(n.max()) if n.size else 0])
        if epoch == args.mixture_epoch:
            sources += [str(s) for s in batch["source"].to_pylist()]
            slots += np.asarray(batch["slot"]).tolist()
        if args.compute:
            time.sleep(args.compute)
    (args.out / f"done-{name}-{epoch}").touch()
    ep = stream.stats.epochs[-1]
    return {"t_first": t_first, "t_last": t_last, "rows": ep.rows, "dropped_rows": ep.dropped_rows,
            "wait_seconds": ep.wait_seconds, "seconds": ep.seconds, "touched_bytes": touched, "batches": batches,
            "sources": sources, "slots": slots}


def hf_shard(files: list[str], rank: int, size: int, args: argparse.Namespace) -> dict:
    """This rank's shard of the Arrow files ``Dataset.from_spark`` wrote, in Arrow batches (the anchor's fastest)."""
    import pyarrow.compute as pc
    from datasets import Dataset, concatenate_datasets
    from datasets.distributed import split_dataset_by_node

    ds = concatenate_datasets([Dataset.from_file(f) for f in files])
    shard = split_dataset_by_node(ds, rank=rank, world_size=size).with_format("arrow")
    t_first = t_last = None
    rows = tokens = 0
    for table in shard.iter(batch_size=args.hf_batch_size):
        t_last = time.time()
        t_first = t_first or t_last
        rows += table.num_rows
        tokens += int(pc.sum(pc.list_value_length(table.column(args.lengths))).as_py() or 0)
    return {"t_first": t_first, "t_last": t_last, "rows": rows, "tokens": tokens}


def process_start() -> float:
    """This process's creation as ``time.time()``, to a clock tick: ``/proc/self/stat``'s start time (ticks since
    boot) against ``CLOCK_BOOTTIME`` (psutil's creation time rests on the boot time in whole seconds)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def main(args: argparse.Namespace, comm: Any, started: dict) -> None:
    from sparkbus import worker
    from sparkbus.worker import BatchStream

    if args.hf_go:
        import datasets  # noqa: F401 - imported before the clock starts, as sparkbus's worker is
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    how: dict[str, Any] = {"comm": comm, "even": None if args.even == "auto" else False, "steps": args.steps}
    if comm is None:                       # the launcher's rank (torchrun, mpiexec without mpi4py), or a --group
        how = {"rank": "auto"} if args.launch != "none" else {}
    if args.group:
        rank, size = (int(n) for n in args.group.split("/"))
        dropped = os.open(args.out / f"{args.name}.dropped", flags, 0o644)
        how = {"rank": rank, "size": size, "on_drop": lambda batch: os.write(
            dropped, np.ascontiguousarray(batch["id"], dtype=np.int64).tobytes())}
    if args.prefetch_bytes is not None:
        how["prefetch_bytes"] = args.prefetch_bytes
    with BatchStream(args.ranks, stream=args.stream, timeout=args.timeout, **how) as stream:
        name = args.name or f"rank{stream.rank}"
        ids = os.open(args.out / f"{name}.ids", flags, 0o644) if args.ids else None
        ready(args.out, name)
        if args.go:
            wait_for_go(args.go, args.timeout)
        cpu_start = time.process_time()
        epochs = [one_epoch(stream, args, epoch, name, ids) for epoch in range(args.epochs)]
    result: dict[str, Any] = {"name": name, "epochs": epochs, "cpu_seconds": time.process_time() - cpu_start,
                              "module": os.path.dirname(worker.__file__), **started}   # which sparkbus (2b checks)
    for rep in range(args.hf_reps if args.hf_go else 0):
        go = f"{args.hf_go}-{rep}"
        wait_for_go(go, args.timeout)
        result.setdefault("hf", []).append(hf_shard(json.loads(Path(go).read_text()), comm.Get_rank(),
                                                    comm.Get_size(), args))
    finish(args.out, name, result)


if __name__ == "__main__":
    started = {"t_process": process_start()}
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--launch", choices=["mpi", "torch", "auto", "none"], default="mpi",
                        help="mpiexec with mpi4py, torchrun (gloo), a launcher's rank without either, or no group")
    parser.add_argument("--name", help="--launch none: a consumer of its own (or of a --group) with this name")
    parser.add_argument("--group", help="with --name: rank R of a group of N, R/N (granted steps)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--compute", type=float, default=0.0, help="seconds of sleep per batch")
    parser.add_argument("--go", help="wait for this file to exist before consuming")
    parser.add_argument("--even", choices=["auto", "no"], default="auto", help="no: no equal steps (a diagnostic)")
    parser.add_argument("--steps", choices=["broker", "mpi"], default="broker")
    parser.add_argument("--prefetch-bytes", type=int, default=None, help="the byte window (0: batches only)")
    parser.add_argument("--touch", action="store_true", help="add up the bytes of every column of every batch")
    parser.add_argument("--lengths", help="a variable-length column: per batch its rows, tokens and longest row")
    parser.add_argument("--ids", action="store_true", help="append every id yielded to NAME.ids")
    parser.add_argument("--mixture-epoch", type=int, default=-1, help="keep each row's source and slot")
    parser.add_argument("--hf-go", help="then read from_spark's files, named in FILE-<rep>, --hf-reps times")
    parser.add_argument("--hf-reps", type=int, default=1)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=120.0)
    arguments = parser.parse_args()
    if arguments.launch == "mpi":
        from mpi4py import MPI

        with abort_on_error(MPI.COMM_WORLD):
            main(arguments, MPI.COMM_WORLD, started)
    elif arguments.launch == "torch":
        from datetime import timedelta

        import torch.distributed as dist

        started["t_imported"] = time.time()
        dist.init_process_group("gloo", timeout=timedelta(seconds=arguments.timeout))
        main(arguments, None, started)
        dist.destroy_process_group()
        # torch 2.13's gloo can abort the interpreter's exit in a C++ destructor (examples/train_ddp.py says more)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        main(arguments, None, started)
