"""Images end to end: PNG bytes in a Spark DataFrame, a small CNN trained under MPI on them, held-out accuracy.

Ranks (gradients summed with a non-blocking MPI allreduce every step; validation on a second stream):

    mpiexec -n 2 python examples/train_images.py --ranks tcp://127.0.0.1:5556 --decode rank --epochs 3

Feed (the Spark side, in any order with the ranks; same ``--decode``):

    python examples/train_images.py --feed tcp://127.0.0.1:5555 --decode rank --epochs 3 --rows 20000

Or all of it at once: ``sparkbus demo --images [--quick] [--decode spark]``.

The images are scikit-learn's handwritten digits (8x8, shipped in its wheel: no download), upscaled to
``--size`` (32) and each rotated and shifted by its own random amount, so every id is a distinct image. Spark
makes them in its tasks (``mapInArrow``) and keeps them as PNG bytes, ``id long, image binary, label int``:
the table a real job reads from its image files. Where they are decoded is ``--decode``:

- ``rank``: the PNG bytes travel (a ``binary`` column, ~0.7 KB an image); each rank decodes them in a thread
  pool, a few batches ahead of the step (Pillow's decoder releases the GIL; so do torch's ops).
  ``--decode-threads 1 --decode-ahead 0`` decodes inline instead.
- ``spark``: Spark decodes them in the feed job and sends the pixels (``array<tinyint>``, 1 KB an image at
  32x32); the ranks only view them as ``uint8 [n, size, size]``.

Either way a training image is jittered each epoch by up to ``--shift`` pixels (a function of seed, epoch and
id), on the side that decodes, so both ways give the ranks the same pixels. docs/TRAINING.md ("Where to
decode images") has the figures of both on a 2-core machine.

Needs the ``images`` extra (``pip install 'sparkbus[images]'``: Pillow and scikit-learn) where the driver runs,
Pillow on Spark's executors (scikit-learn is not needed there: the digits travel with the tasks), and Pillow
and torch on the ranks.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from sparkbus.cli_help import HelpFormatter
from sparkbus.feeder import epoch_order, feed  # none of these imports pyspark, torch or MPI
from sparkbus.progress import EpochTimes, epoch_label, wait_share, waited_line
from sparkbus.worker import BatchStream
from sparkbus.worker.collectives import abort_on_error, allreduce, gather

# Spark's tasks import this file by name (feed_images ships it with addPyFile): run as a script, it is __main__
# on the driver, and cloudpickle would otherwise try to find __main__'s functions in the executors' own __main__.
MODULE = Path(__file__).stem
VAL_BASE = 1 << 32        # validation ids start here; training ids are 0 .. rows - 1
HOLDOUT_SHARE = 0.2       # digits kept for validation only: held-out images are of digits never trained on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--ranks", help="train: the broker's ranks address (run under mpiexec)")
    side.add_argument("--feed", help="feed: the broker's feed address (runs the Spark job)")
    parser.add_argument("--decode", choices=("rank", "spark"), default="rank",
                        help="where PNG bytes become pixels (the same on both sides)")
    parser.add_argument("--stream", default="images-example",
                        help="the training stream (the same on both sides; each example has its own, so that two "
                             "on one broker never take each other's batches)")
    parser.add_argument("--val-stream", default="images-example-val", help="the held-out stream ('' for none)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (the same on both sides)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels")
    parser.add_argument("--shift", type=int, default=2, help="per-epoch jitter of training images, in pixels")
    parser.add_argument("--seed", type=int, default=7, help="data and shuffle seed (feed), weights seed (ranks)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any single wait may take")
    train = parser.add_argument_group("training (--ranks)")
    train.add_argument("--lr", type=float, default=1e-2, help="learning rate")
    train.add_argument("--channels", type=int, default=8, help="channels of the first convolution (x2 in the second)")
    train.add_argument("--prefetch", type=int, default=4, help="batches in flight to each rank")
    train.add_argument("--decode-threads", type=int, default=2, help="--decode rank: decoding threads per rank")
    train.add_argument("--decode-ahead", type=int, default=2, help="--decode rank: batches decoded ahead of the step")
    train.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    train.add_argument("--no-train", action="store_true", help="decode and convert, but take no step (data path only)")
    train.add_argument("--record", help="each rank writes the ids it trained per epoch, and a few images, here")
    train.add_argument("--summary", help="rank 0 writes the run's figures here as JSON")
    feeding = parser.add_argument_group("feeding (--feed)")
    feeding.add_argument("--rows", type=int, default=20_000, help="training images")
    feeding.add_argument("--val-rows", type=int, default=2_000, help="held-out images")
    feeding.add_argument("--batch-size", type=int, default=128, help="images per batch")
    feeding.add_argument("--partitions", type=int, default=4, help="Spark partitions of each epoch")
    feeding.add_argument("--master", default=os.environ.get("SPARK_MASTER", "local[2]"),
                         help="Spark master (SPARK_MASTER)")
    feeding.add_argument("--report", help="write each epoch's FeedReport here as JSON")
    return parser.parse_args(argv)


# ---- the images: made, encoded, decoded, jittered (used by Spark's tasks and by the ranks) --------------------

@lru_cache(maxsize=1)
def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as ``uint8 [1797, 8, 8]`` (0..255) and their labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return np.rint(data.images * (255 / 16)).astype(np.uint8), data.target.astype(np.int32)


@lru_cache(maxsize=4)
def source_pools(seed: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``count`` digits training images are made from, and the (disjoint) ones held-out images are."""
    order = np.random.default_rng([seed, 0]).permutation(count)
    held = int(len(order) * HOLDOUT_SHARE)
    return order[held:], order[:held]


def render(image_id: int, size: int, seed: int, sources: tuple[np.ndarray, np.ndarray] | None = None
           ) -> tuple[np.ndarray, int]:
    """Image ``image_id``: its digit upscaled to ``size`` and rotated (±12°) and shifted (±size/10) by amounts
    drawn from ``(seed, image_id)``. ``sources`` is :func:`digits` (loaded if not given). Returns
    ``(uint8 [size, size], label)``."""
    from PIL import Image

    images, labels = sources if sources is not None else digits()
    train, held = source_pools(seed, len(labels))
    pool, index = (held, image_id - VAL_BASE) if image_id >= VAL_BASE else (train, image_id)
    source = int(pool[index % len(pool)])
    rng = np.random.default_rng([seed, image_id])
    reach = max(1, size // 10)
    picture = Image.fromarray(images[source], "L").resize((size, size), Image.Resampling.BILINEAR)
    picture = picture.rotate(float(rng.uniform(-12, 12)), Image.Resampling.BILINEAR,
                             translate=tuple(int(t) for t in rng.integers(-reach, reach + 1, 2)))
    return np.asarray(picture), int(labels[source])


def encode_png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "L").save(out, "PNG")
    return out.getvalue()


def decode_into(images: Any, out: np.ndarray, lo: int, hi: int) -> None:
    """Decode ``images[lo:hi]`` (anything whose items are bytes-like: a RaggedColumn's memoryviews, a list of
    ``bytes``) into ``out[lo:hi]``, ``uint8 [n, size, size]``. Pillow releases the GIL while it inflates."""
    from PIL import Image

    for i in range(lo, hi):
        with Image.open(io.BytesIO(images[i])) as picture:
            if picture.size != out.shape[:0:-1] or picture.mode != "L":
                raise ValueError(f"image {i} is {picture.mode} {picture.size}, expected L {out.shape[:0:-1]}")
            out[i] = np.asarray(picture)


def epoch_jitter(ids: np.ndarray, seed: int, epoch: int, shift: int) -> np.ndarray:
    """``int [n, 2]`` shifts (dx, dy) in ``-shift .. shift`` per id: a hash of (seed, epoch, id), so Spark and the
    ranks jitter an image alike."""
    if shift <= 0:
        return np.zeros((len(ids), 2), dtype=np.int64)
    with np.errstate(over="ignore"):              # splitmix64: wrapping multiplication on purpose
        h = ids.astype(np.uint64) ^ np.uint64((seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9) % (1 << 64))
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    span = np.uint64(2 * shift + 1)
    return np.stack([(h % span).astype(np.int64), ((h >> np.uint64(16)) % span).astype(np.int64)], 1) - shift


def jitter_in_place(pixels: np.ndarray, shifts: np.ndarray, lo: int = 0, hi: int | None = None) -> None:
    """Shift each image of ``pixels[lo:hi]`` by its ``(dx, dy)``, filling with black (a random crop of a padded
    image, the usual CNN augmentation)."""
    for i in range(lo, len(pixels) if hi is None else hi):
        dx, dy = (int(s) for s in shifts[i])
        if dx or dy:
            moved = np.zeros_like(pixels[i])
            h, w = moved.shape
            moved[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
                pixels[i, max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
            pixels[i] = moved


# ---- the Spark side -------------------------------------------------------------------------------------------

def image_frame(spark: Any, rows: int, size: int, seed: int, partitions: int, first_id: int = 0) -> Any:
    """``id long, image binary, label int``: images ``first_id .. first_id + rows - 1`` as PNG bytes.

    Made and encoded in Spark's tasks (``mapInArrow`` over ``spark.range``), not on the driver: encoding is
    the costly part (~60 µs an image here), it runs on every executor at once, and the driver never holds the
    images (``createDataFrame`` would ship them all from it). A real job gets the same shape of table from its
    image files with ``spark.read.format("binaryFile")``.
    """
    import pyarrow as pa

    module, sources = MODULE, digits()    # the digits travel with the task (115 KB): no scikit-learn on executors

    def encode(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        images = importlib.import_module(module)      # this file, shipped to the executors by feed_images
        for batch in batches:
            ids = batch.column("id").to_numpy()
            made = [images.render(int(i), size, seed, sources) for i in ids]
            yield pa.RecordBatch.from_arrays(
                [pa.array(ids, pa.int64()), pa.array([images.encode_png(p) for p, _ in made], pa.binary()),
                 pa.array([label for _, label in made], pa.int32())], names=["id", "image", "label"])

    return (spark.range(first_id, first_id + rows, numPartitions=partitions)
            .mapInArrow(encode, "id long, image binary, label int"))


def decoded_frame(df: Any, size: int, seed: int, epoch: int, shift: int) -> Any:
    """``--decode spark``: ``id long, pixels array<tinyint>, label int``, each image's ``size * size`` pixels
    (uint8 stored as Spark's signed byte), jittered for ``epoch``. A narrow step: partitions and order stay."""
    import pyarrow as pa

    module = MODULE

    def decode(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        images = importlib.import_module(module)
        for batch in batches:
            ids = batch.column("id").to_numpy()
            pixels = np.empty((len(ids), size, size), dtype=np.uint8)
            images.decode_into(batch.column("image").to_pylist(), pixels, 0, len(ids))
            images.jitter_in_place(pixels, images.epoch_jitter(ids, seed, epoch, shift))
            offsets = pa.array(np.arange(0, pixels.size + 1, size * size, dtype=np.int32))
            column = pa.ListArray.from_arrays(offsets, pa.array(pixels.view(np.int8).reshape(-1)))
            yield pa.RecordBatch.from_arrays([pa.array(ids, pa.int64()), column, batch.column("label")],
                                             names=["id", "pixels", "label"])

    return df.mapInArrow(decode, "id long, pixels array<tinyint>, label int")


def feed_images(spark: Any, address: str, epochs: int, *, decode: str = "rank", stream: str = "images-example",
                val_stream: str | None = "images-example-val", rows: int = 20_000, val_rows: int = 2_000,
                size: int = 32, shift: int = 2, seed: int = 7, partitions: int = 4, batch_size: int = 128,
                timeout: float = 120.0) -> list[dict]:
    """Make the image sets in Spark, then feed ``epochs`` epochs: training reshuffled, then the held-out set.

    Args:
        spark: the SparkSession; address: the broker's feed address.
        decode: ``"rank"`` feeds the PNG bytes, ``"spark"`` decodes (and jitters) them in the feed job.
        stream, val_stream: stream names (no validation if ``val_stream`` is empty).
        rows, val_rows, size, seed: the sets (see :func:`render`); shift: the per-epoch jitter (spark decode).
        partitions, batch_size: tasks per epoch and images per batch.
        timeout: passed to ``feed``; bounds every wait, a task blocked by backpressure included.
    Returns:
        One dict per epoch: its number, when it started, and each stream's FeedReport as a dict.
    Raises:
        BrokerError, FeedError, TypeError: as ``feeder.feed``.
    """
    spark.sparkContext.addPyFile(__file__)        # the tasks import this file as MODULE
    train = image_frame(spark, rows, size, seed, partitions).cache()
    started = time.monotonic()
    train.count()
    print(f"made {rows:,} training images ({size}x{size} PNG) in {partitions} partitions: "
          f"{time.monotonic() - started:.1f} s", flush=True)
    val = image_frame(spark, val_rows, size, seed, 1, first_id=VAL_BASE).cache() if val_stream else None
    fed = []
    for epoch in range(epochs):
        began = time.time()
        shuffled = epoch_order(train, epoch, seed, key=["id"], partitions=partitions)
        if decode == "spark":
            shuffled = decoded_frame(shuffled, size, seed, epoch, shift)
        report = feed(shuffled, address, stream=stream, epoch=epoch, batch_size=batch_size, timeout=timeout)
        entry = {"epoch": epoch, "started": began, stream: report._asdict()}
        if val is not None:
            held = decoded_frame(val, size, seed, epoch, 0) if decode == "spark" else val
            entry[val_stream] = feed(held, address, stream=val_stream, epoch=epoch, batch_size=batch_size,
                                     timeout=timeout)._asdict()
        fed.append(entry)
        print(f"fed {epoch_label(epoch, epochs)}: {report.rows:,} images in {report.batches} batches "
              f"({report.bytes / 1e6:.1f} MB) in {report.seconds:.1f} s", flush=True)
        print(waited_line(epoch, epochs, report), flush=True)
    return fed


def run_feed(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("sparkbus-train-images-feed")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    try:
        fed = feed_images(spark, args.feed, args.epochs, decode=args.decode, stream=args.stream,
                          val_stream=args.val_stream, rows=args.rows, val_rows=args.val_rows, size=args.size,
                          shift=args.shift, seed=args.seed, partitions=args.partitions,
                          batch_size=args.batch_size, timeout=args.timeout)
        if args.report:
            Path(args.report).write_text(json.dumps({"epochs": fed}, indent=2))
    finally:
        spark.stop()
    return 0


# ---- the ranks ------------------------------------------------------------------------------------------------

class DecodePool:
    """Decodes a batch's PNG column in ``threads`` threads, in chunks, while the caller does something else."""

    def __init__(self, threads: int, size: int):
        self.threads, self.size = max(1, threads), size
        self.executor = ThreadPoolExecutor(self.threads, thread_name_prefix="decode")
        self.busy_seconds = 0.0       # wall seconds in the threads, summed (waits for the GIL included)

    def submit(self, images: Any, shifts: np.ndarray) -> tuple[np.ndarray, list]:
        """Start decoding ``images`` (indexable, items bytes-like) and jittering them by ``shifts``; returns the
        output array (complete once every future is done) and the futures."""
        n = len(images)
        out = np.empty((n, self.size, self.size), dtype=np.uint8)
        bounds = np.linspace(0, n, min(self.threads, max(n, 1)) + 1).astype(int)
        return out, [self.executor.submit(self._chunk, images, out, shifts, int(lo), int(hi))
                     for lo, hi in zip(bounds, bounds[1:])]

    def _chunk(self, images: Any, out: np.ndarray, shifts: np.ndarray, lo: int, hi: int) -> float:
        began = time.perf_counter()
        decode_into(images, out, lo, hi)
        jitter_in_place(out, shifts, lo, hi)
        return time.perf_counter() - began

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def pixel_batches(batches: Iterator[dict], args: argparse.Namespace, epoch: int, jitter: int,
                  pool: DecodePool | None) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(uint8 [n, size, size], labels, ids)`` per batch of the epoch.

    ``--decode rank``: the next ``--decode-ahead`` batches are taken from the stream (in this thread: the stream's
    even-steps agreement is an MPI collective and must stay on the thread that trains) and decoded in the pool
    while the current one trains. Taking a batch acknowledges the one before, so those batches are acknowledged
    before they are trained on, as with a shuffle buffer. ``--decode spark``: a zero-copy view of the pixels.
    """
    if pool is None:
        for batch in batches:
            if "pixels" not in batch:
                raise ValueError(f"batches have columns {sorted(batch)}: is the feed run with --decode spark?")
            n = len(batch["id"])
            yield batch["pixels"].view(np.uint8).reshape(n, args.size, args.size), batch["label"], batch["id"]
        return
    pending: deque = deque()
    source = iter(batches)
    exhausted = False
    while True:
        while not exhausted and len(pending) <= args.decode_ahead:
            batch = next(source, None)
            if batch is None:
                exhausted = True
                break
            if "image" not in batch:
                raise ValueError(f"batches have columns {sorted(batch)}: is the feed run with --decode rank?")
            shifts = epoch_jitter(batch["id"], args.seed, epoch, jitter)
            pending.append((*pool.submit(batch["image"], shifts), batch["label"], batch["id"]))
        if not pending:
            return
        out, futures, labels, ids = pending.popleft()
        pool.busy_seconds += sum(f.result() for f in futures)
        yield out, labels, ids


class Trainer:
    """A small CNN, its optimizer, and one flat buffer through which each step's gradients are summed over MPI."""

    def __init__(self, comm: Any, args: argparse.Namespace):
        import torch
        from torch import nn

        self.comm, self.torch = comm, torch
        torch.manual_seed(args.seed)                        # the same initial weights on every rank
        c = args.channels
        self.model = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * c * (args.size // 4) ** 2, 64), nn.ReLU(), nn.Linear(64, 10))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        self.params = list(self.model.parameters())
        self.flat = np.zeros(sum(p.numel() for p in self.params) + 1, dtype=np.float32)   # gradients, then rows
        self.flat_t = torch.from_numpy(self.flat)

    def tensors(self, pixels: np.ndarray, labels: np.ndarray) -> tuple[Any, Any]:
        """Floats in [-1, 1] as ``[n, 1, size, size]`` (into a new, writable array) and int64 labels."""
        x = np.multiply(pixels, np.float32(2 / 255), dtype=np.float32)
        x -= 1
        return self.torch.from_numpy(x).unsqueeze(1), self.torch.from_numpy(labels.astype(np.int64))

    def step(self, x: Any, y: Any) -> tuple[float, int]:
        """One data-parallel step on the mean over every rank's images; returns this rank's loss sum and hits."""
        torch = self.torch
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.flat_t[:-1])
        self.flat[-1] = len(y)
        summed = torch.from_numpy(allreduce(self.comm, self.flat))      # Iallreduce + Test + sleep: no spinning
        offset = 0
        for p in self.params:
            p.grad.copy_(summed[offset:offset + p.numel()].view_as(p)).div_(summed[-1])
            offset += p.numel()
        self.optimizer.step()
        return float(loss.detach()), int((logits.argmax(1) == y).sum())

    def evaluate(self, x: Any, y: Any) -> int:
        with self.torch.no_grad():
            return int((self.model(x).argmax(1) == y).sum())

    def checksum(self) -> float:
        return float(sum(p.detach().double().sum() for p in self.params))


class Recorder:
    """``--record DIR``: per epoch, the ids this rank trained and those dropped to keep the ranks even, and the
    pixels of the first images of its first batch (``DIR/rank{r}-epoch{e}.npz``)."""

    def __init__(self, directory: str | None, rank: int):
        self.directory, self.rank = (Path(directory) if directory else None), rank
        self.ids: list[np.ndarray] = []
        self.dropped: list[np.ndarray] = []
        self.sample: tuple[np.ndarray, np.ndarray] | None = None

    def trained(self, ids: np.ndarray, pixels: np.ndarray) -> None:
        if self.directory:
            self.ids.append(np.array(ids))
            if self.sample is None:
                self.sample = np.array(ids[:4]), np.array(pixels[:4])

    def on_drop(self, batch: dict) -> None:
        if self.directory:
            self.dropped.append(np.array(batch["id"]))

    def save(self, epoch: int) -> None:
        if self.directory:
            empty = np.zeros(0, np.int64)
            sample_ids, sample_pixels = self.sample if self.sample else (empty, np.zeros((0, 0, 0), np.uint8))
            np.savez(self.directory / f"rank{self.rank}-epoch{epoch}.npz",
                     id=np.concatenate(self.ids) if self.ids else empty,
                     dropped_id=np.concatenate(self.dropped) if self.dropped else empty,
                     sample_id=sample_ids, sample_pixels=sample_pixels)
        self.ids, self.dropped, self.sample = [], [], None


def train_epoch(trainer: Trainer, batches: Iterator, args: argparse.Namespace, recorder: Recorder) -> dict:
    totals = np.zeros(3)                                 # loss sum, correct, images on this rank
    steps, convert = 0, 0.0
    for pixels, labels, ids in batches:
        began = time.perf_counter()
        x, y = trainer.tensors(pixels, labels)
        convert += time.perf_counter() - began
        recorder.trained(ids, pixels)
        if args.no_train:
            totals[2] += len(y)
        else:
            totals += (*trainer.step(x, y), len(y))
        steps += 1
    return {"steps": steps, "loss_sum": totals[0], "correct": totals[1], "images": totals[2],
            "convert_seconds": convert}


def validate(trainer: Trainer, stream: BatchStream, args: argparse.Namespace, pool: DecodePool | None,
             epoch: int) -> np.ndarray:
    """This rank's ``[correct, images]`` of the held-out epoch (no per-batch collective: uneven shares are fine)."""
    totals = np.zeros(2)
    for pixels, labels, _ in pixel_batches(stream.epoch(), args, epoch, 0, pool):
        totals += (trainer.evaluate(*trainer.tensors(pixels, labels)), len(labels))
    return totals


def run_ranks(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    trainer = Trainer(comm, args)
    recorder = Recorder(args.record, comm.rank)
    history, started = [], time.monotonic()
    with ExitStack() as stack:
        pool = DecodePool(args.decode_threads, args.size) if args.decode == "rank" else None
        if pool is not None:
            stack.callback(pool.close)
        train = stack.enter_context(BatchStream(args.ranks, comm=comm, stream=args.stream, prefetch=args.prefetch,
                                                timeout=args.timeout, on_drop=recorder.on_drop))
        val = stack.enter_context(BatchStream(args.ranks, comm=comm, stream=args.val_stream, even=False,
                                              prefetch=args.prefetch, timeout=args.timeout)) \
            if args.val_stream else None
        for epoch in range(args.epochs):
            busy_before, cpu_before = (pool.busy_seconds if pool else 0.0), time.process_time()
            result = train_epoch(trainer, pixel_batches(train.epoch(), args, epoch, args.shift, pool), args,
                                 recorder)
            ep = train.stats.epochs[-1]
            recorder.save(epoch)
            held = validate(trainer, val, args, pool, epoch) if val is not None else np.zeros(2)
            decode = (pool.busy_seconds if pool else 0.0) - busy_before
            mine = [result["loss_sum"], result["correct"], result["images"], *held, ep.seconds, ep.wait_seconds,
                    ep.batches, ep.dropped_batches, decode, result["convert_seconds"], time.process_time() - cpu_before,
                    ep.first_batch_seconds]
            figures = gather(comm, np.array(mine, dtype=np.float64))
            if comm.rank == 0:
                history.append(epoch_figures(epoch, result["steps"], figures))
                print(epoch_line(history[-1], args.epochs), flush=True)
    checksums = gather(comm, np.array([trainer.checksum()]))
    if comm.rank == 0:
        summary = {"ranks": comm.size, "decode": args.decode, "size": args.size, "epochs": history,
                   "seconds": time.monotonic() - started, "param_checksums": checksums[:, 0].tolist(),
                   "final": {k: history[-1][k] for k in ("loss", "accuracy", "val_accuracy")} if history else {}}
        print(f"trained {len(history)} epochs on {comm.size} ranks (decode on {args.decode}) in "
              f"{summary['seconds']:.1f} s: " + ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items()),
              flush=True)
        if args.summary:
            Path(args.summary).write_text(json.dumps(summary, indent=2))
    return 0


def epoch_figures(epoch: int, steps: int, f: np.ndarray) -> dict:
    """One epoch's figures from every rank's gathered row (see ``mine`` in :func:`run_ranks`). ``seconds`` is the
    epoch (the slowest rank's); ``start_up_seconds`` the wait for its first batch (the last rank's to get one: in
    the first epoch, Spark's start-up); ``images_per_second`` and ``data_wait_share`` are over the time after the
    first batch (``streaming_seconds``, the slowest rank's), so that Spark's start-up is not counted as data wait."""
    loss, correct, images, val_correct, val_images = (f[:, i].sum() for i in range(5))
    times = [EpochTimes.split(wait, first, seconds) for seconds, wait, first in zip(f[:, 5], f[:, 6], f[:, 12])]
    streaming = max(t.streaming for t in times)
    return {"epoch": epoch, "steps": steps, "images": int(images), "loss": loss / max(images, 1),
            "accuracy": correct / max(images, 1), "val_images": int(val_images),
            "val_accuracy": val_correct / max(val_images, 1) if val_images else None,
            "seconds": float(f[:, 5].max()), "start_up_seconds": max(t.start_up for t in times),
            "streaming_seconds": streaming, "images_per_second": images / max(streaming, 1e-9),
            "data_wait_share": wait_share(times), "first_batch_seconds": f[:, 12].tolist(),
            "wait_seconds": f[:, 6].tolist(), "rank_seconds": f[:, 5].tolist(),
            "batches": f[:, 7].astype(int).tolist(), "dropped_batches": f[:, 8].astype(int).tolist(),
            "decode_seconds": f[:, 9].tolist(), "convert_seconds": f[:, 10].tolist(), "cpu_seconds": f[:, 11].tolist()}


def epoch_line(r: dict, epochs: int) -> str:
    """Rank 0's line for one epoch: images, start-up (the wait for the first batch), images/s and every rank's data
    wait after the first batch (:func:`epoch_figures`)."""
    waits = ", ".join(f"r{i} {EpochTimes.split(w, b, s).waited:.2f} s"
                      for i, (w, b, s) in enumerate(zip(r["wait_seconds"], r["first_batch_seconds"],
                                                        r["rank_seconds"])))
    val = f" | held-out acc {r['val_accuracy']:.1%}" if r["val_accuracy"] is not None else ""
    decode = sum(r["decode_seconds"])
    return (f"{epoch_label(r['epoch'], epochs)}: {r['images']:,} images in {r['seconds']:.2f} s (start-up "
            f"{r['start_up_seconds']:.2f} s, then {r['images_per_second']:,.0f} images/s), loss {r['loss']:.4f} "
            f"acc {r['accuracy']:.1%}{val} | data wait {waits} ({r['data_wait_share']:.0%})"
            + (f" | decoding {decode:.2f} thread-s" if decode else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.feed:
        return run_feed(args)
    with abort_on_error():                             # never leave the other ranks waiting in a collective
        return run_ranks(args)


if __name__ == "__main__":
    sys.exit(main())
