"""A rank of tests/integration/test_coordinated_steps.py: one epoch of a stream through ``BatchStream(rank=,
size=)`` (granted steps, no MPI), recording for each step, in the order its loop got them, the batch's row ids and
the lengths of its ``tokens`` rows. Writes ``<out>/rank<r>.json``: ``{"steps": [{"ids": [...], "lengths": [...]}]}``.

    python bucket_rank.py --ranks tcp://127.0.0.1:P --stream S --group R/N --out DIR [--timeout 60]
"""

import argparse
import json
from pathlib import Path

import numpy as np

from sparkbus.worker import BatchStream

parser = argparse.ArgumentParser()
parser.add_argument("--ranks", required=True)
parser.add_argument("--stream", required=True)
parser.add_argument("--group", required=True, help="R/N: rank R of a group of N")
parser.add_argument("--out", required=True)
parser.add_argument("--prefetch", type=int, default=4)
parser.add_argument("--timeout", type=float, default=60.0)
args = parser.parse_args()
rank, size = (int(n) for n in args.group.split("/"))

steps = []
with BatchStream(args.ranks, stream=args.stream, rank=rank, size=size, prefetch=args.prefetch,
                 timeout=args.timeout) as stream:
    for batch in stream.epoch():
        steps.append({"ids": np.asarray(batch["id"]).tolist(),
                      "lengths": np.asarray(batch["tokens"].lengths()).tolist()})
path = Path(args.out) / f"rank{rank}.json"
path.with_suffix(".tmp").write_text(json.dumps({"steps": steps}))
path.with_suffix(".tmp").replace(path)
