"""Figure 8, images into decoding ranks (issue 15): PNGs of a cached DataFrame (scikit-learn's digits, upscaled,
each rotated and shifted, encoded in Spark's Python workers) into 2 ranks (``images_rank.py``) that decode every
image with the same Pillow call, ``sparkbus`` (``feed`` -> broker -> ``BatchStream`` -> decoding threads) against
``staging`` (Parquet written, then a DataLoader whose workers read and decode); ranks ready before any clock starts;
repetitions alternate which goes first; every run must decode every image once (counts, id and pixel sums)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure
from sparkbus.launch.broker import BrokerProcess

from .common import BenchError, Children, EarlyExit, run_ranks
from .end_to_end import CpuMeter
from .sections import Context, Run, Section
from .spark_data import storage_of, warm_up_feed

IMAGES, QUICK_IMAGES = 50_000, 5_000
REPS, QUICK_REPS = 5, 1
SIZE, PARTITIONS, BATCH_SIZE, RANKS, DECODERS = 32, 4, 128, 2, 2
WAYS = ("sparkbus", "staging")
SEED = 7
LAUNCHES = 3                                   # launches of a run whose ranks exit early (EarlyExit)


# ---- the images -------------------------------------------------------------------------------------------

def image_frame(spark: Any, images: int, size: int = SIZE, partitions: int = PARTITIONS, seed: int = SEED) -> Any:
    """``id long, image binary, label int``: ``images`` distinct PNGs of ``size`` x ``size`` (not cached).

    Image ``i`` is digit ``i % 1797`` of scikit-learn's set, upscaled, rotated by up to 12 degrees and shifted by
    up to ``size / 10`` pixels, by amounts drawn from ``(seed, i)``; rendered and encoded in Spark's tasks.
    """
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    digits = np.rint(data.images * (255 / 16)).astype(np.uint8)
    labels = data.target.astype(np.int32)

    def encode(batches):                       # a closure: cloudpickle ships it, and the digits, by value
        import io

        import numpy as np
        import pyarrow as pa
        from PIL import Image

        reach = max(1, size // 10)
        for batch in batches:
            ids = batch.column("id").to_numpy()
            pngs = []
            for i in ids:
                rng = np.random.default_rng([seed, int(i)])
                picture = Image.fromarray(digits[i % len(digits)], "L").resize((size, size),
                                                                               Image.Resampling.BILINEAR)
                picture = picture.rotate(float(rng.uniform(-12, 12)), Image.Resampling.BILINEAR,
                                         translate=tuple(int(t) for t in rng.integers(-reach, reach + 1, 2)))
                out = io.BytesIO()
                picture.save(out, "PNG")
                pngs.append(out.getvalue())
            yield pa.RecordBatch.from_arrays(
                [pa.array(ids, pa.int64()), pa.array(pngs, pa.binary()), pa.array(labels[ids % len(labels)])],
                names=["id", "image", "label"])

    return spark.range(0, images, numPartitions=partitions).mapInArrow(encode, "id long, image binary, label int")


# ---- one run of each way ----------------------------------------------------------------------------------

class Runner:
    """Starts the ranks of one run, times the Spark side, collects and checks what the ranks decoded."""

    def __init__(self, df: Any, images: int, work: Path, args: list[str], timeout: float, children: Children,
                 broker: BrokerProcess, batch_size: int):
        self.df, self.images, self.work, self.args, self.timeout = df, images, work, args, timeout
        self.children, self.broker, self.batch_size = children, broker, batch_size
        self.count = 0
        self.relaunched: list[str] = []       # runs whose first launch failed before the clock started

    def run(self, way: str) -> dict:
        """One run of ``way`` (``sparkbus`` or ``staging``), started again if its ranks failed to launch."""
        for launch in range(LAUNCHES):
            try:
                return getattr(self, way)()
            except EarlyExit as exc:
                if launch == LAUNCHES - 1:
                    raise
                self.relaunched.append(str(exc).splitlines()[0])
        raise AssertionError("unreachable")

    def _ranks(self, way: str, args: Sequence[str], start: Callable[[], dict]) -> dict:
        """``mpiexec -n 2 images_rank.py args``; once every rank is ready, ``start()`` (timed); what they decoded."""
        out = self.work / f"{way}-{self.count}"
        shutil.rmtree(out, ignore_errors=True)          # a work directory given again
        meters: list[CpuMeter] = []

        def timed() -> dict:
            meters.append(CpuMeter([self.broker]))
            return start()

        ranks, clock = run_ranks(self.children, out.name, RANKS, "images_rank.py", out, [*self.args, *args], timed,
                                 self.timeout, ready_timeout=120.0)
        names = {"jvm": "spark_jvm", "workers": "spark_python", "broker": "broker"}   # this figure's names
        clock["cpu"] = {names[group]: seconds for group, seconds in meters[0].stop().items()}
        shutil.rmtree(out, ignore_errors=True)
        clock["cpu"].update(ranks=sum(f["cpu_seconds"] for f in ranks),
                            loader_workers=sum(f["workers_cpu_seconds"] for f in ranks))
        t0 = clock.pop("t0")
        images, id_sum = sum(f["images"] for f in ranks), sum(f["id_sum"] for f in ranks)
        if images != self.images or id_sum != self.images * (self.images - 1) // 2:
            raise BenchError(f"{way}: the ranks decoded {images:,} images (id sum {id_sum:,}) of "
                             f"{self.images:,} (id sum {self.images * (self.images - 1) // 2:,})")
        last = max(f["t_last"] for f in ranks) - t0
        received = [f["t_first_received"] for f in ranks if f.get("t_first_received")]
        if received:                           # sparkbus: the first batch out of a BatchStream, not yet decoded
            clock["first_received"] = min(received) - t0
        return {"way": way, "first": min(f["t_first"] for f in ranks) - t0, "last": last,
                "images_per_s": images / last, "images": images, "id_sum": id_sum,
                "pixel_sum": sum(f["pixel_sum"] for f in ranks), "batches": sum(f["batches"] for f in ranks),
                "images_per_rank": [f["images"] for f in ranks],
                "decode_seconds": sum(f["decode_seconds"] for f in ranks), **clock}

    def sparkbus(self) -> dict:
        from sparkbus.feeder import feed

        self.count += 1
        stream = f"images-{self.count}"

        def start() -> dict:
            t0 = time.time()
            report = feed(self.df, self.broker.feed, stream=stream, epoch=0, batch_size=self.batch_size,
                          timeout=min(self.timeout, 120.0))
            return {"t0": t0, "feed_seconds": time.time() - t0, "fed_batches": report.batches,
                    "fed_bytes": report.bytes}

        return self._ranks("sparkbus", ["--ranks", self.broker.ranks, "--stream", stream], start)

    def staging(self) -> dict:
        self.count += 1
        staged, go = self.work / f"staged-{self.count}", self.work / f"go-{self.count}"

        def start() -> dict:
            t0 = time.time()
            self.df.write.mode("overwrite").parquet(str(staged))
            written = time.time()
            go.touch()
            files = list(staged.glob("*.parquet"))
            return {"t0": t0, "write_seconds": written - t0, "files": len(files),
                    "staged_bytes": sum(f.stat().st_size for f in files)}

        try:
            return self._ranks("staging", ["--parquet", str(staged), "--go", str(go), "--batch-size",
                                           str(self.batch_size)], start)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
            go.unlink(missing_ok=True)


# ---- the figure -------------------------------------------------------------------------------------------

def measure(spark: Any, images: int = IMAGES, reps: int = REPS, *, size: int = SIZE, partitions: int = PARTITIONS,
            batch_size: int = BATCH_SIZE, decoders: int = DECODERS, work: Path | None = None,
            timeout: float = 300.0, warm_up: bool = True, log: Callable[[str], None] = print) -> dict:
    """Both ways ``reps`` times each, interleaved, on one cached DataFrame of ``images`` PNGs (:func:`image_frame`),
    into 2 ranks of ``decoders`` decoding threads or DataLoader workers each, in batches of ``batch_size``.

    ``work``: logs and staged files (a temporary directory if None); ``warm_up=False``: no untimed scan, write and
    feed first (a test of the harness). Returns a JSON-serialisable dict: the set-up, ``frame``, ``runs`` per way,
    ``first_task`` per repetition, ``ratios`` (sparkbus / staging: ``faster`` images/s, ``first`` image) and
    ``checks``. Raises BenchError if a run failed, did not decode every image once, or decoded other pixels.
    """
    temporary = work is None
    work = Path(tempfile.mkdtemp(prefix="sparkbus-images-")) if work is None else Path(work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"images": images, "size": size, "partitions": partitions, "batch_size": batch_size,
                              "ranks": RANKS, "decoders_per_rank": decoders, "reps": reps,
                              "runs": {way: [] for way in WAYS}}
    children = Children(work)
    df = None
    try:
        broker = children.broker("256MiB", 30.0)
        started = time.monotonic()
        df = image_frame(spark, images, size, partitions).cache()
        row = df.selectExpr("count(*) AS n", "sum(length(image)) AS png").collect()[0]
        result["frame"] = {"images": row["n"], "png_bytes": row["png"], "mean_png_bytes": row["png"] / max(1, row["n"]),
                           "build_seconds": time.monotonic() - started, **storage_of(spark)}
        log(f"  images: {images:,} PNGs of {size}x{size} ({result['frame']['mean_png_bytes']:,.0f} bytes on "
            f"average) made and cached in {result['frame']['build_seconds']:.1f} s")
        if warm_up:
            _warm_up(df, broker, work)
        runner = Runner(df, images, work, ["--size", str(size), "--threads", str(decoders), "--timeout", str(timeout)],
                        timeout, children, broker, batch_size)
        result["first_task"] = []
        for rep in range(reps):
            result["first_task"].append(first_task_seconds(df))
            for way in (WAYS if rep % 2 == 0 else WAYS[::-1]):
                result["runs"][way].append(runner.run(way))
            s, p = result["runs"]["sparkbus"][-1], result["runs"]["staging"][-1]
            log(f"  images rep {rep + 1}/{reps}: sparkbus first {s['first']:.3f} s last {s['last']:.2f} s "
                f"({s['images_per_s']:,.0f} images/s); staging first {p['first']:.3f} s (write "
                f"{p['write_seconds']:.2f} s) last {p['last']:.2f} s ({p['images_per_s']:,.0f} images/s)")
        result["relaunched"] = runner.relaunched
    finally:
        if df is not None:
            df.unpersist()
        children.stop_all()
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    runs = result["runs"]
    s, p = ({key: statistics.median(r[key] for r in runs[way]) for key in ("first", "images_per_s")} for way in WAYS)
    result["ratios"] = {"faster": s["images_per_s"] / p["images_per_s"], "first": s["first"] / p["first"]}
    pixel_sums = {r["pixel_sum"] for way in WAYS for r in runs[way]}
    result["checks"] = {"every_image_once": True, "pixel_sums": sorted(pixel_sums)}
    if len(pixel_sums) != 1:
        raise BenchError(f"the runs decoded different pixels (sums {sorted(pixel_sums)})")
    return result


def first_task_seconds(df: Any) -> float:
    """From the start of a Spark job over ``df`` to the first record batch its Python code is handed
    (``mapInArrow``, keeping nothing): what any path from Spark waits before its first row, on this machine now."""
    import pyarrow as pa

    def first_seen(batches):
        import time

        seen = None
        for _ in batches:
            seen = seen or time.time()
        yield pa.RecordBatch.from_pydict({"t": [seen]}, schema=pa.schema([("t", pa.float64())]))

    started = time.time()
    seen = [r["t"] for r in df.mapInArrow(first_seen, "t double").collect() if r["t"] is not None]
    return min(seen) - started


def _warm_up(df: Any, broker: BrokerProcess, work: Path) -> None:
    """Outside any timing: a full scan of the cache, a small Parquet write (the session's first is slow), and a
    small feed into a stream no rank reads (the Python workers import sparkbus)."""
    df.selectExpr("sum(length(image))").collect()
    df.limit(1000).write.mode("overwrite").parquet(str(work / "warm-up.parquet"))
    shutil.rmtree(work / "warm-up.parquet", ignore_errors=True)
    warm_up_feed(df, rows=0, feed_address=broker.feed, stream="images-warm-up", batch_size=BATCH_SIZE, fraction=0.02)


# ---- the section ------------------------------------------------------------------------------------------

class ImagesSection(Section[dict]):
    """Figure 8: PNG images into decoding ranks, sparkbus vs Parquet staging + DataLoader (not in ``--quick``'s
    default sections: ``--only images`` runs it at the quick size)."""

    name, title, spark, quick = "images", "8. images into decoding ranks", "session", False

    def measure(self, ctx: Context) -> dict:
        images = QUICK_IMAGES if ctx.quick else IMAGES
        reps = ctx.args.reps or (QUICK_REPS if ctx.quick else REPS)
        return measure(ctx.spark, images, reps, work=ctx.work / "images", timeout=max(ctx.sizes.timeout, 120.0),
                       log=ctx.log)

    def figures(self, run: Run, result: dict) -> list[Figure]:
        """Images/s to the last image and the first decoded image, sparkbus against staging + DataLoader; the floor
        of any first image (a Spark job's first record batch) and staging's write, against staging's first image."""
        runs = result["runs"]
        rate = figure("images", "staging + DataLoader images/s", [r["images_per_s"] for r in runs["staging"]],
                      "images/s")
        first = figure("images", "staging + DataLoader first image", [r["first"] for r in runs["staging"]], "s")
        return [rate, figure("images", "sparkbus images/s", [r["images_per_s"] for r in runs["sparkbus"]],
                             "images/s", rate),
                first, figure("images", "sparkbus first image", [r["first"] for r in runs["sparkbus"]], "s", first),
                figure("images", "a Spark job's first record batch in Python", result["first_task"], "s", first),
                figure("images", "staging: Parquet write", [r["write_seconds"] for r in runs["staging"]], "s", first),
                figure("images", "staging: Parquet MB", [r["staged_bytes"] / 1e6 for r in runs["staging"]], "MB")]
