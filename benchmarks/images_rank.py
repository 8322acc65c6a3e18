"""A rank of the images figure (``images.py``): decode every PNG of one epoch, from the bus or from staged Parquet,
with :func:`decode_into` on ``--threads`` decoders: ``--ranks``, a ``BatchStream`` (``even=False``) whose batches'
PNGs are split over a thread pool; ``--parquet``, a DataLoader whose workers read this rank's row groups and decode
them (started before ready, waiting for ``--go``). Writes ``rank<rank>.ready`` and ``rank<rank>.json`` (as
``rank.py``): first and last decoded batch, images, id and pixel sums, CPU seconds.
"""

import argparse
import io
import os
import resource
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from mpi4py import MPI
from PIL import Image  # imported before the clock starts, and before the DataLoader forks its workers
from rank import finish, ready, wait_for_go

from sparkbus.worker.collectives import abort_on_error

parser = argparse.ArgumentParser()
source = parser.add_mutually_exclusive_group(required=True)
source.add_argument("--ranks", help="the broker's ranks address (sparkbus)")
source.add_argument("--parquet", help="the staging directory (Parquet + DataLoader)")
parser.add_argument("--stream", default="images")
parser.add_argument("--go", help="--parquet: read once this file exists")
parser.add_argument("--out", required=True)
parser.add_argument("--size", type=int, default=32, help="image side in pixels")
parser.add_argument("--threads", type=int, default=2, help="decoders per rank: pool threads or DataLoader workers")
parser.add_argument("--batch-size", type=int, default=128, help="--parquet: images per batch read")
parser.add_argument("--timeout", type=float, default=120.0)
AHEAD = 2                               # --ranks: batches decoded beyond the awaited one


def decode_into(images, out: np.ndarray, lo: int, hi: int) -> float:
    """Decode ``images[lo:hi]`` (bytes-like items) into ``out[lo:hi]``; returns the seconds it took."""
    began = time.perf_counter()
    for i in range(lo, hi):
        with Image.open(io.BytesIO(images[i])) as picture:
            out[i] = np.asarray(picture)
    return time.perf_counter() - began


def warm_up(size: int, parquet: bool) -> None:
    """Pay the decoding path's lazy imports before the clock starts: Pillow's PNG plugin (on the first open), and
    with ``parquet`` pandas, which pyarrow imports on the first ``to_numpy``; a DataLoader's forked workers inherit
    them."""
    png = io.BytesIO()
    Image.new("L", (size, size)).save(png, "PNG")
    decode_into([png.getvalue()], np.empty((1, size, size), np.uint8), 0, 1)
    if not parquet:
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    staged = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array([0], pa.int64()), "image": pa.array([png.getvalue()], pa.binary())}),
                   staged)
    for record_batch in pq.ParquetFile(io.BytesIO(staged.getvalue())).iter_batches(batch_size=1):
        decode_into(record_batch.column("image").to_pylist(), np.empty((1, size, size), np.uint8), 0, 1)
        record_batch.column("id").to_numpy()


class Tally:
    """What a rank decoded: batches, images, sums of ids and pixels, first and last time."""

    def __init__(self, out: Path, rank: int):
        self.out, self.rank = out, rank
        self.batches = self.images = self.id_sum = self.pixel_sum = 0
        self.decode_seconds = self.cpu_start = 0.0
        self.t_first: float | None = None
        self.t_last: float | None = None

    def ready(self) -> None:
        """Say so to the benchmark (which then starts the clock); CPU time is counted from here."""
        self.cpu_start = time.process_time()
        ready(self.out, f"rank{self.rank}")

    def add(self, ids: np.ndarray, pixels: np.ndarray, decode_seconds: float) -> None:
        self.t_last = time.time()
        if self.t_first is None:
            self.t_first = self.t_last
        self.batches += 1
        self.images += len(ids)
        self.id_sum += int(np.asarray(ids, dtype=np.int64).sum())
        self.pixel_sum += int(np.asarray(pixels).sum(dtype=np.int64))
        self.decode_seconds += decode_seconds


def from_bus(args, comm, out: Path) -> tuple[Tally, dict]:
    from sparkbus.worker import BatchStream

    tally, pool = Tally(out, comm.rank), ThreadPoolExecutor(args.threads, thread_name_prefix="decode")
    try:
        with BatchStream(args.ranks, comm=comm, stream=args.stream, even=False,
                         timeout=args.timeout) as stream:
            tally.ready()
            pending: deque = deque()
            batches, exhausted, t_received = stream.epoch(), False, None
            while True:
                while not exhausted and len(pending) <= AHEAD:
                    batch = next(batches, None)
                    if batch is None:
                        exhausted = True
                        break
                    t_received = t_received or time.time()
                    images = batch["image"]
                    pixels = np.empty((len(images), args.size, args.size), dtype=np.uint8)
                    bounds = np.linspace(0, len(images), min(args.threads, max(len(images), 1)) + 1).astype(int)
                    futures = [pool.submit(decode_into, images, pixels, int(lo), int(hi))
                               for lo, hi in zip(bounds, bounds[1:])]
                    pending.append((batch["id"], pixels, futures))
                if not pending:
                    break
                ids, pixels, futures = pending.popleft()
                tally.add(ids, pixels, sum(f.result() for f in futures))
            ep = stream.stats.epochs[-1]
            return tally, {"t_first_received": t_received, "dropped_rows": ep.dropped_rows,
                           "wait_seconds": ep.wait_seconds}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def from_parquet(args, comm, out: Path) -> tuple[Tally, dict]:
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    torch.set_num_threads(1)
    rank, size = comm.rank, comm.size

    class StagedImages(IterableDataset):
        """This rank's share of the staged row groups, split again among the DataLoader's workers; yields
        ``(ids, uint8 [n, size, size], decode seconds)`` per batch of ``--batch-size`` rows."""

        def __iter__(self):
            wait_for_go(args.go, args.timeout)
            info = get_worker_info()
            wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
            files = sorted(Path(args.parquet).glob("*.parquet"))
            units = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
            for path, group in units[rank::size][wid::workers]:
                for record_batch in pq.ParquetFile(path).iter_batches(batch_size=args.batch_size, row_groups=[group],
                                                                       columns=["id", "image"]):
                    images = record_batch.column("image").to_pylist()
                    pixels = np.empty((len(images), args.size, args.size), dtype=np.uint8)
                    seconds = decode_into(images, pixels, 0, len(images))
                    yield record_batch.column("id").to_numpy(zero_copy_only=False, writable=True), pixels, seconds

    tally = Tally(out, rank)
    loader = DataLoader(StagedImages(), batch_size=None, num_workers=args.threads, timeout=args.timeout)
    batches = iter(loader)                    # starts the workers; they wait for the go file
    tally.ready()
    for ids, pixels, seconds in batches:
        tally.add(ids.numpy(), pixels.numpy(), float(seconds))
    del batches                               # joins the workers, so that their CPU time is counted below
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return tally, {"dropped_rows": 0, "workers_cpu_seconds": children.ru_utime + children.ru_stime}


def main(args) -> None:
    comm, out = MPI.COMM_WORLD, Path(args.out)
    t_start = time.time()
    warm_up(args.size, parquet=bool(args.parquet))
    tally, extra = (from_bus if args.ranks else from_parquet)(args, comm, out)
    finish(out, f"rank{comm.rank}", {
        "rank": comm.rank, "size": comm.size, "source": "bus" if args.ranks else "parquet", "t_start": t_start,
        "t_first": tally.t_first, "t_last": tally.t_last, "t_end": time.time(), "batches": tally.batches,
        "images": tally.images, "id_sum": tally.id_sum, "pixel_sum": tally.pixel_sum,
        "decode_seconds": tally.decode_seconds, "cpu_seconds": time.process_time() - tally.cpu_start,
        "workers_cpu_seconds": 0.0, **extra, "pid": os.getpid()})


if __name__ == "__main__":
    arguments = parser.parse_args()
    with abort_on_error(MPI.COMM_WORLD):
        main(arguments)
