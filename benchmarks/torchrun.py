"""Figure 9: time to the first batch for torchrun ranks (gloo, ``rank="auto"``) beside mpiexec ranks (mpi4py, the
anchor) and mpiexec ranks without mpi4py (a diagnostic), reading an epoch the broker holds before they start, for
the rank whose first batch came last. The ranks are ``rank.py --launch torch|mpi|auto``."""

from __future__ import annotations

import itertools
import json
import socket
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure

from .common import HERE, ROOT, BenchError, Children, feed_parts
from .sections import Context, Section

RANKS = 2
BATCH_ROWS = 1024
FEATURES = 16                       # 1024 rows x (8 + 64) bytes: 72 KiB a batch, one batch per message
BATCHES = 32                        # the epoch: 16 batches per rank
WAYS = ("torchrun", "mpiexec", "mpiexec-auto")     # the anchor: mpiexec with mpi4py; -auto: without it (diagnostic)
_runs = itertools.count()


def run(children: Children, reps: int, work: Path, timeout: float, log=print) -> list[Figure]:
    """The slowest rank's launch to first batch per way of launching (a way that cannot run here is left out),
    against mpiexec with mpi4py; and torchrun's ``import torch``."""
    bin_dir = Path(sys.executable).parent
    ways = [way for way, program, extra in (("torchrun", "torchrun", "torch"), ("mpiexec", "mpiexec", "mpi4py"),
                                            ("mpiexec-auto", "mpiexec", None))
            if (bin_dir / program).exists() and (extra is None or find_spec(extra) is not None)]
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    broker = children.broker("256MiB")
    try:
        for rep in range(reps):
            for way in (ways if rep % 2 == 0 else ways[::-1]):
                runs[way].append(_one(children, broker, way, work, timeout))
                log(f"  first batch, {way} rep {rep + 1}/{reps}: launch -> first batch "
                    f"{runs[way][-1]['launch_to_first']:.2f} s")
    finally:
        children.discard(broker)
    if "mpiexec" not in runs:
        return []
    anchor = figure("torchrun", "mpiexec: launch to first batch", [r["launch_to_first"] for r in runs["mpiexec"]], "s")
    out = [anchor, *(figure("torchrun", f"{way}: launch to first batch", [r["launch_to_first"] for r in rs], "s",
                            anchor) for way, rs in runs.items() if way != "mpiexec")]
    if "torchrun" in runs:
        out.append(figure("torchrun", "torchrun: import torch", [r["import_torch"] for r in runs["torchrun"]], "s"))
    return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _feed(broker: Any, stream: str, timeout: float) -> None:
    """The epoch the ranks will read, held by the broker before they start (1 partition, 32 batches)."""
    import numpy as np

    from sparkbus.broker.client import ControlClient

    features = np.ones((BATCH_ROWS, FEATURES), np.float32)
    batches = ({"id": np.arange(i * BATCH_ROWS, (i + 1) * BATCH_ROWS, dtype=np.int64), "x": features}
               for i in range(BATCHES))
    with ControlClient(broker.control, timeout) as client:
        feed_parts(client, broker, stream, 0, [batches], timeout, pack_bytes=0)


def _one(children: Children, broker: Any, way: str, work: Path, timeout: float) -> dict:
    from sparkbus.launch.mpi import loopback_env
    from sparkbus.launch.processes import ChildProcess

    n = next(_runs)
    stream, out = f"first-{n}", work / f"first-{n}"
    out.mkdir(parents=True, exist_ok=True)
    _feed(broker, stream, timeout)
    rank_args = [str(HERE / "rank.py"), "--launch", "torch" if way == "torchrun" else "mpi" if way == "mpiexec"
                 else "auto", "--ranks", broker.ranks, "--stream", stream, "--out", str(out), "--timeout", str(timeout)]
    if way == "torchrun":
        launcher = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(RANKS),
                    "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    else:
        launcher = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(RANKS), sys.executable, "-u"]
    launched = time.time()
    child = children.add(ChildProcess(f"first-{way}-{n}", [*launcher, *rank_args], children.log(f"first-{way}"),
                                      env=loopback_env(), cwd=ROOT))
    try:
        code = child.wait(timeout)
        if code != 0:
            raise BenchError(f"the {way} ranks failed with exit status {code}:\n{child.tail()}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    finally:
        children.discard(child)
    last = max(ranks, key=lambda r: r["epochs"][0]["t_first"])
    return {"launch_to_first": last["epochs"][0]["t_first"] - launched,
            "import_torch": last["t_imported"] - last["t_process"] if last.get("t_imported") else None}


class TorchrunSection(Section[list]):
    name, title = "torchrun", "9. first batch, torchrun ranks"

    def measure(self, ctx: Context) -> list:
        return run(ctx.children, ctx.sizes.reps, ctx.work, min(ctx.sizes.timeout, 120.0), ctx.log)
