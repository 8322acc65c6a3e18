"""Figure 9: time to the first batch for torchrun ranks (gloo, ``rank="auto"``) beside mpiexec ranks (mpi4py, the
anchor) and mpiexec ranks without mpi4py (a diagnostic), reading an epoch the broker holds before they start, for
the rank whose first batch came last. The ranks' side is ``python -m benchmarks.torchrun --rank-side ...``."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sparkbus.bench.figures import Figure, figure

from .common import ROOT, BenchError, Children, open_epoch
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
            if (bin_dir / program).exists() and (extra is None or _importable(extra))]
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


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _feed(broker: Any, stream: str, timeout: float) -> None:
    """The epoch the ranks will read, held by the broker before they start (1 partition, 32 batches)."""
    import numpy as np

    from sparkbus.broker.client import ControlClient
    from sparkbus.feeder.task import stream_partition
    from sparkbus.wire.protocol import Kind

    features = np.ones((BATCH_ROWS, FEATURES), np.float32)
    batches = ({"id": np.arange(i * BATCH_ROWS, (i + 1) * BATCH_ROWS, dtype=np.int64), "x": features}
               for i in range(BATCHES))
    with ControlClient(broker.control, timeout) as client:
        open_epoch(client, stream, 0, 1)
        stream_partition(batches, broker.feed, broker.control, stream, 0, 0, 0, timeout, pack_bytes=0)
        client.request(Kind.EPOCH_CLOSE, stream=stream, epoch=0, partitions=1)


def _one(children: Children, broker: Any, way: str, work: Path, timeout: float) -> dict:
    from sparkbus.launch.mpi import loopback_env
    from sparkbus.launch.processes import ChildProcess

    n = next(_runs)
    stream, out = f"first-{n}", work / f"first-{n}"
    out.mkdir(parents=True, exist_ok=True)
    _feed(broker, stream, timeout)
    rank_args = ["--rank-side", "torch" if way == "torchrun" else "mpi" if way == "mpiexec" else "auto",
                 "--ranks", broker.ranks, "--stream", stream, "--out", str(out), "--timeout", str(timeout)]
    if way == "torchrun":
        launcher = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(RANKS),
                    "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "benchmarks.torchrun"]
    else:
        launcher = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(RANKS), sys.executable, "-u", "-m",
                    "benchmarks.torchrun"]
    env = {**loopback_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    launched = time.time()
    child = children.add(ChildProcess(f"first-{way}-{n}", [*launcher, *rank_args], children.log(f"first-{way}"),
                                      env=env, cwd=ROOT))
    try:
        code = child.wait(timeout)
        if code != 0:
            raise BenchError(f"the {way} ranks failed with exit status {code}:\n{child.tail()}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    finally:
        children.discard(child)
    last = max(ranks, key=lambda r: r["t_first"])
    return {"launch_to_first": last["t_first"] - launched,
            "import_torch": last["t_imported"] - last["t_process"] if last.get("t_imported") else None}


# ---- a rank's side (run under a launcher: python -m benchmarks.torchrun --rank-side ...) ----------------------

def process_start() -> float:
    """This process's creation as ``time.time()``, to a clock tick: ``/proc/self/stat``'s start time (ticks since
    boot) against ``CLOCK_BOOTTIME`` (psutil's creation time rests on the boot time in whole seconds)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def rank_main(argv: list[str] | None = None) -> int:
    """Consume one epoch, recording when the runtime was ready, the stream made and the first batch arrived."""
    parser = argparse.ArgumentParser(prog="benchmarks.torchrun")
    parser.add_argument("--rank-side", choices=("torch", "mpi", "auto"), required=True)
    parser.add_argument("--ranks", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    t_process = process_start()
    comm: Any = None
    t_imported = None                   # torchrun: torch imported, before init_process_group
    if args.rank_side == "torch":
        from datetime import timedelta

        import torch.distributed as dist

        t_imported = time.time()
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        how: dict[str, Any] = {"rank": "auto"}
    elif args.rank_side == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        how = {"comm": comm}
    else:
        how = {"rank": "auto"}
    t_ready = time.time()
    from sparkbus.worker import BatchStream

    t_stream = time.time()
    with BatchStream(args.ranks, stream=args.stream, timeout=args.timeout, **how) as stream:
        batches = stream.epoch()
        first = next(batches, None)
        t_first = time.time()
        count = sum(1 for _ in batches) + (first is not None)
        rank, size = stream.rank, stream.size
    figures = {"rank": rank, "size": size, "t_process": t_process, "t_imported": t_imported, "t_ready": t_ready,
               "t_stream": t_stream, "t_first": t_first, "batches": count, "first_batch_seconds":
               stream.stats.first_batch_seconds, "way": args.rank_side}
    tmp = args.out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(figures))
    os.replace(tmp, args.out / f"rank{rank}.json")
    if args.rank_side == "torch":
        dist.destroy_process_group()
        # torch 2.13's gloo can abort the interpreter's exit in a C++ destructor (examples/train_ddp.py says more)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# ---- the section ------------------------------------------------------------------------------------------

class TorchrunSection(Section[list]):
    """Figure 9: time to the first batch for torchrun ranks, beside mpiexec ranks (no target)."""

    name, title = "torchrun", "9. first batch, torchrun ranks"

    def measure(self, ctx: Context) -> list:
        return run(ctx.children, ctx.sizes.reps, ctx.work, min(ctx.sizes.timeout, 120.0), ctx.log)


if __name__ == "__main__":
    sys.exit(rank_main())
