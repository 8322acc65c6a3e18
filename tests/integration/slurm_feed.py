"""A Spark-free feed for the Slurm recipe's FEED_CMD: ``--epochs`` epochs of ``--partitions`` × ``--rows`` rows,
pushed as a Spark job would (the driver's EPOCH_OPEN and EPOCH_CLOSE, each partition through the task code).

Row ids are ``epoch * partitions * rows + 0 .. partitions * rows - 1``; each row has ``x``, 8 float32 copies of its
id. The broker's addresses come from the variables the recipe exports (``SPARKBUS_FEED_ADDRESS``; the control port
is the feed port + 2).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

# isort: off
try:    # a release before 0.3.0 (tests/integration/test_versions.py runs one): top-level packages, on PYTHONPATH
    from broker.protocol import Kind  # noqa: TID251   (0.3.0 has no broker/protocol.py: the ImportError is here)
    from broker.client import ControlClient  # noqa: TID251
    from feeder.task import stream_partition  # noqa: TID251
except ImportError:
    from sparkbus.broker.client import ControlClient
    from sparkbus.feeder.task import stream_partition
    from sparkbus.wire.protocol import Kind
# isort: on

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--stream", default="train")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--partitions", type=int, default=3)
parser.add_argument("--rows", type=int, default=1000)
parser.add_argument("--batch-size", type=int, default=50)
parser.add_argument("--timeout", type=float, default=60.0)
args = parser.parse_args()

feed = os.environ["SPARKBUS_FEED_ADDRESS"]
host, port = feed.rsplit(":", 1)
control = f"{host}:{int(port) + 2}"
with ControlClient(control, args.timeout) as driver:
    for epoch in range(args.epochs):
        driver.request(Kind.EPOCH_OPEN, stream=args.stream, epoch=epoch, partitions=args.partitions,
                       delivery="stream")
        for part in range(args.partitions):
            first = (epoch * args.partitions + part) * args.rows
            ids = np.arange(first, first + args.rows, dtype=np.int64)
            batches = ({"id": ids[i:i + args.batch_size],
                        "x": ids[i:i + args.batch_size, None].astype(np.float32).repeat(8, 1)}
                       for i in range(0, args.rows, args.batch_size))
            stream_partition(batches, feed, control, args.stream, epoch, part, 0, args.timeout)
        driver.request(Kind.EPOCH_CLOSE, stream=args.stream, epoch=epoch, partitions=args.partitions)
print(f"fed {args.epochs} epochs of {args.partitions * args.rows} rows to {feed}")
