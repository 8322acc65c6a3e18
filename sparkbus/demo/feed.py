"""The demo's Spark job: generate a synthetic classification set, then feed it to a broker epoch by epoch.

    spark-submit --master local[2] deploy/feed_job.py --feed tcp://127.0.0.1:5555 [--rows 1000000 --epochs 3]

(deploy/feed_job.py runs this module; ``sparkbus demo`` submits this file itself.)

Each epoch is a fresh global shuffle of the cached set (``feeder.epoch_order``: by a hash of seed, epoch and the
row, so a recomputed partition comes out the same) streamed with ``feeder.feed``. The executors' Python must be
the one sparkbus is installed in (set PYSPARK_PYTHON or ``spark.pyspark.python``); ``sparkbus demo`` starts this
job with ``launch.spark.submit_command`` and ``local_env``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from sparkbus.cli_help import HelpFormatter
from sparkbus.demo import synthetic
from sparkbus.feeder import epoch_order, feed
from sparkbus.progress import epoch_label, waited_line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparkbus.demo.feed", description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--feed", default="tcp://127.0.0.1:5555", help="the broker's feed address")
    parser.add_argument("--stream", default="demo", help="the stream to feed (the ranks' --stream)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the synthetic set")
    parser.add_argument("--features", type=int, default=64, help="float32 features per row")
    parser.add_argument("--classes", type=int, default=10, help="classes of the set")
    parser.add_argument("--epochs", type=int, default=3, help="epochs to feed")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per batch")
    parser.add_argument("--partitions", type=int, default=8,
                        help="partitions of the generated set and of each epoch's shuffle")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data and the shuffles")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds any single wait on the broker may take (replies, backpressure)")
    parser.add_argument("--report", help="write the generation time and each epoch's FeedReport here as JSON")
    return parser.parse_args(argv)


def generate(spark, rows: int, features: int, classes: int, partitions: int, seed: int):
    """The training set as a DataFrame ``features array<float>, label int``, cached and counted once."""
    import pyarrow as pa

    centres = synthetic.centroids(classes, features, seed)

    def make_rows(batches):
        from pyspark import TaskContext

        rng = synthetic.partition_rng(seed, TaskContext.get().partitionId())
        for batch in batches:
            x, y = synthetic.sample(batch.num_rows, centres, rng)
            offsets = pa.array(np.arange(0, x.size + 1, features, dtype=np.int32))
            column = pa.ListArray.from_arrays(offsets, pa.array(x.reshape(-1)))
            yield pa.RecordBatch.from_arrays([column, pa.array(y)], names=["features", "label"])

    data = spark.range(rows, numPartitions=partitions).mapInArrow(make_rows, "features array<float>, label int")
    data = data.cache()
    data.count()
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.appName("sparkbus-demo-feed")
             .config("spark.sql.shuffle.partitions", args.partitions)
             # keep each epoch at --partitions tasks instead of letting AQE merge them
             .config("spark.sql.adaptive.coalescePartitions.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    report: dict = {"rows": args.rows, "epochs": []}
    try:
        started = time.monotonic()
        data = generate(spark, args.rows, args.features, args.classes, args.partitions, args.seed)
        report["generate_seconds"] = time.monotonic() - started
        print(f"generated {args.rows:,} rows x {args.features} features, {args.classes} classes, "
              f"in {args.partitions} partitions: {report['generate_seconds']:.1f} s", flush=True)
        for epoch in range(args.epochs):
            began = time.time()
            shuffled = epoch_order(data, epoch, args.seed, partitions=args.partitions)
            result = feed(shuffled, args.feed, stream=args.stream, epoch=epoch, batch_size=args.batch_size,
                          timeout=args.timeout)
            report["epochs"].append({"epoch": epoch, "started": began, **result._asdict()})
            print(f"fed {epoch_label(epoch, args.epochs)}: {result.rows:,} rows in {result.batches:,} batches "
                  f"({result.bytes / 1e6:,.1f} MB) from {result.partitions} partitions in {result.seconds:.1f} s: "
                  f"{result.rows / result.seconds:,.0f} rows/s, {result.bytes / 1e6 / result.seconds:,.1f} MB/s",
                  flush=True)
            print(waited_line(epoch, args.epochs, result), flush=True)
    finally:
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=2))
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
