"""A rank of the language-model section (``lm.py``): epochs of ragged token rows from the bus, then (``--hf-go``)
its shard of the Arrow files Hugging Face ``datasets.Dataset.from_spark`` wrote.

    mpiexec -n 2 python benchmarks/lm_rank.py --out DIR --ranks tcp://127.0.0.1:P --stream S --epochs N
            [--column tokens] [--mixture-epoch K] [--hf-go FILE --hf-reps 1 --hf-batch-size 32] [--timeout 60]

Writes ``ready-<rank>`` once it joined the broker (and imported ``datasets``). For each epoch of the stream it
records, per batch in the order its loop got them, the rows, the real tokens (the sum of the row lengths of
``--column``) and the longest row, and wall-clock times of the first and the last batch; then writes
``done-<rank>-<epoch>`` (the benchmark feeds the next epoch only once every rank wrote it). In the epoch
``--mixture-epoch`` it also keeps each row's ``source`` and ``slot``. With ``--hf-go FILE`` it then, ``--hf-reps``
times, waits for the file ``FILE-<rep>`` (a JSON list of the Arrow files ``from_spark`` wrote), opens them with
``Dataset.from_file``, takes its shard with ``datasets.distributed.split_dataset_by_node`` and iterates it in
batches of ``--hf-batch-size`` rows, Arrow formatted (no per-row Python: the anchor's fastest way). Writes
``rank<rank>.json``.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI
from rank_files import ready_path, run_or_abort, wait_for_go, write_figures

from sparkbus.worker import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--ranks", required=True)
parser.add_argument("--stream", required=True)
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--column", default="tokens")
parser.add_argument("--mixture-epoch", type=int, default=-1)
parser.add_argument("--hf-go")
parser.add_argument("--hf-batch-size", type=int, default=32)
parser.add_argument("--hf-reps", type=int, default=1, help="read that many datasets, one a go file FILE-<rep>")
parser.add_argument("--out", required=True)
parser.add_argument("--timeout", type=float, default=120.0)
args = parser.parse_args()

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
out = Path(args.out)


def done_path(epoch: int) -> Path:
    return out / f"done-{rank}-{epoch}"


def lengths(column) -> np.ndarray:
    """Row lengths of a received token column: a ragged column's, or ``k`` per row of a ``[n, k]`` array."""
    if hasattr(column, "lengths"):
        return np.asarray(column.lengths())
    return np.full(len(column), column.shape[1] if column.ndim > 1 else 1, dtype=np.int64)


def bus_epoch(stream: BatchStream, epoch: int) -> dict:
    batches: list[list[int]] = []          # [rows, real tokens, longest row] per batch
    sources: list[str] = []
    slots: list[int] = []
    t_first = t_last = None
    for batch in stream.epoch():
        t_last = time.time()
        t_first = t_first or t_last
        n = lengths(batch[args.column])
        batches.append([int(n.size), int(n.sum()), int(n.max()) if n.size else 0])
        if epoch == args.mixture_epoch:
            sources += [str(s) for s in batch["source"].to_pylist()]
            slots += np.asarray(batch["slot"]).tolist()
    done_path(epoch).touch()
    return {"epoch": epoch, "t_first": t_first, "t_last": t_last, "batches": batches, "sources": sources,
            "slots": slots}


def hf_shard(files: list[str]) -> dict:
    import pyarrow.compute as pc
    from datasets import Dataset, concatenate_datasets
    from datasets.distributed import split_dataset_by_node

    t_start = time.time()
    ds = concatenate_datasets([Dataset.from_file(f) for f in files])
    shard = split_dataset_by_node(ds, rank=rank, world_size=comm.Get_size()).with_format("arrow")
    t_first = t_last = None
    rows = tokens = 0
    for table in shard.iter(batch_size=args.hf_batch_size):
        t_last = time.time()
        t_first = t_first or t_last
        rows += table.num_rows
        tokens += int(pc.sum(pc.list_value_length(table.column(args.column))).as_py() or 0)
    return {"t_start": t_start, "t_first": t_first, "t_last": t_last, "rows": rows, "tokens": tokens}


def main() -> None:
    if args.hf_go:
        import datasets  # noqa: F401 - imported before the clock starts, as sparkbus's worker is

    with BatchStream(args.ranks, comm=comm, stream=args.stream, timeout=args.timeout) as stream:
        ready_path(out, rank).touch()
        epochs = [bus_epoch(stream, epoch) for epoch in range(args.epochs)]
    result: dict = {"rank": rank, "size": comm.Get_size(), "epochs": epochs}
    if args.hf_go:
        result["hf"] = []
        for rep in range(args.hf_reps):
            go = f"{args.hf_go}-{rep}"
            wait_for_go(go, args.timeout)
            result["hf"].append(hf_shard(json.loads(Path(go).read_text())))
    write_figures(out, rank, result)


run_or_abort(main, comm)
