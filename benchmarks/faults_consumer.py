"""A consumer of the fault table (``faults.py``): one epoch through ``BatchStream``, every id written down.

    python benchmarks/faults_consumer.py --ranks ADDRESS --stream S --out DIR --name NAME
        [--train SECONDS] [--prefetch 4] [--prefetch-bytes 0] [--group R/N] [--timeout 60]

Independent (``comm=None``) or rank R of a granted group of N (dropped batches to ``DIR/NAME.dropped``). Touches
``DIR/NAME.ready``, then appends each yielded batch's ids to ``DIR/NAME.ids`` in one ``O_APPEND`` write (what the
kernel has is what the loop trained, even if SIGKILLed), sleeps ``--train``, and at the end writes ``DIR/NAME.done``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from sparkbus.worker import BatchStream


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--train", type=float, default=0.0, help="seconds of sleep per batch")
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--prefetch-bytes", type=int, default=0, help="the byte window (0: batches only)")
    parser.add_argument("--group", help="R/N: rank R of a group of N (BatchStream(rank=, size=), granted steps)")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    ids = os.open(args.out / f"{args.name}.ids", flags, 0o644)
    group = {}
    if args.group:
        rank, size = (int(n) for n in args.group.split("/"))
        dropped = os.open(args.out / f"{args.name}.dropped", flags, 0o644)
        group = {"rank": rank, "size": size, "on_drop": lambda batch: os.write(
            dropped, np.ascontiguousarray(batch["id"], dtype=np.int64).tobytes())}
    batches = rows = 0
    started = time.monotonic()
    with BatchStream(args.ranks, stream=args.stream, prefetch=args.prefetch, prefetch_bytes=args.prefetch_bytes,
                     timeout=args.timeout, **group) as stream:
        (args.out / f"{args.name}.ready").touch()
        for batch in stream.epoch():
            os.write(ids, np.ascontiguousarray(batch["id"], dtype=np.int64).tobytes())
            batches += 1
            rows += len(batch["id"])
            if args.train:
                time.sleep(args.train)
        stats = stream.stats.epochs[-1]
        done = {"batches": batches, "rows": rows, "seconds": time.monotonic() - started,
                "wait_seconds": stats.wait_seconds, "rejoins": getattr(stream.stats, "rejoins", None)}
    os.close(ids)
    temporary = args.out / f"{args.name}.done.tmp"
    temporary.write_text(json.dumps(done))
    temporary.rename(args.out / f"{args.name}.done")


if __name__ == "__main__":
    main()
