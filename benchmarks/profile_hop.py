"""Where the time of a sparkbus hop goes: the broker, the feeder and the consumer under py-spy, at one batch size.

    .venv/bin/pip install py-spy            # not a sparkbus dependency; for this investigation only
    .venv/bin/python benchmarks/profile_hop.py [--size 1KiB] [--seconds 5] [--prefetch 4] [--top 15]

Prints per process the share of wall time waiting and the functions with the most samples (inclusive and self).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":        # as a script: the package from the checkout's root, not this directory's modules
    sys.path[0] = str(HERE.parent)

IDLE = re.compile(r"^(poll|_poll|recv|recv_multipart|select|wait|sleep|_recv_copy|_recv_frame) ")


LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    """``name (file:line)`` -> ``name (file)``: samples of one function's lines add up."""
    return LINE.sub(")", frame)


def summarize(path: Path, top: int) -> str:
    """Top functions of a py-spy ``raw`` (collapsed stacks) file, inclusive and self, over the busy samples.

    A sample whose innermost frame is a poll, a blocking receive or a sleep is counted as waiting; the
    percentages are of the other (busy) samples, so they say where the CPU time goes.
    """
    inclusive: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    total = idle = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = [_function(f) for f in stack.split(";")
                  if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += n
        leaf = frames[-1]
        if IDLE.match(leaf) or "poll (zmq" in leaf or leaf.startswith("sleep") or "Connection._recv" in leaf:
            idle += n
            continue
        self_[leaf] += n
        for frame in set(frames):
            inclusive[frame] += n
    busy = total - idle
    if not busy:
        return "  (no busy samples)"
    out = [f"  samples {total}: waiting {idle / total:.0%}, busy {busy / total:.0%}; shares of the busy samples:",
           "  inclusive:"]
    out += [f"    {c / busy:6.1%}  {f}" for f, c in inclusive.most_common(top)]
    out += ["  self:"]
    out += [f"    {c / busy:6.1%}  {f}" for f, c in self_.most_common(top)]
    return "\n".join(out)


def main() -> int:
    from benchmarks import agents, hop
    from benchmarks.common import Children, open_epoch
    from sparkbus.broker.client import ControlClient
    from sparkbus.broker.config import parse_size
    from sparkbus.wire.protocol import Kind

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1KiB")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--no-verify", action="store_true", help="consumer skips the checksum check")
    parser.add_argument("--no-checksum", "--no-crc", action="store_true", dest="no_checksum",
                        help="no checksum at all: the feeder sends 0 (patched in its process), the consumer skips it")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="sparkbus-profile-")))
    parser.add_argument("--no-profile", action="store_true", help="just measure, without py-spy")
    parser.add_argument("--native", action="store_true", help="py-spy --native: C frames too (slower sampling)")
    args = parser.parse_args()
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not spy and not args.no_profile:
        print("py-spy is not installed: .venv/bin/pip install py-spy", file=sys.stderr)
        return 2
    size = parse_size(args.size)
    args.out.mkdir(parents=True, exist_ok=True)
    children = Children(args.out)
    recorders = []
    try:
        sender = children.agent("sender", agents.sender)
        receiver = children.agent("receiver", agents.receiver)
        broker = children.broker("256MiB")
        client = ControlClient(broker.control, 30)
        open_epoch(client, "profile", 0, 1)
        receiver.send({"mode": "sparkbus", "ranks": broker.ranks, "stream": "profile", "size": size,
                       "prefetch": args.prefetch, "verify": not (args.no_verify or args.no_checksum), "timeout": 60})
        receiver.recv(30, "ready")
        for name, pid in (("broker", broker.pid), ("feeder", sender.pid), ("consumer", receiver.pid)):
            if args.no_profile:
                break
            recorders.append((name, subprocess.Popen(
                [str(spy), "record", "--idle", *(["--native"] if args.native else ["--nonblocking"]), "--format", "raw",
                 "--rate", "250", "--duration", str(int(args.seconds)), "--pid", str(pid),
                 "--output", str(args.out / f"{name}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        if recorders:
            time.sleep(0.5)  # py-spy attaches asynchronously; this is a profile, not a timing
        sender.send({"mode": "sparkbus", "size": size, "seconds": args.seconds, "min_batches": 1,
                     "no_checksum": args.no_checksum,
                     "feed": broker.feed, "control": broker.control, "stream": "profile", "timeout": 60})
        sent = sender.recv(args.seconds + 60, "the end of its feed")
        client.request(Kind.EPOCH_CLOSE, stream="profile", epoch=0, partitions=1)
        got = receiver.recv(60, "the end of its epoch")
        seconds = got["t_last"] - sent["t_first"]
        print(f"sparkbus hop at {hop.size_label(size)}, prefetch {args.prefetch}: {got['received']:,} batches in "
              f"{seconds:.2f} s = {got['received'] / seconds:,.0f} batches/s, "
              f"{got['received'] * size / seconds / 1e6:,.1f} MB/s; consumer waited "
              f"{got['wait_seconds'] / got['seconds']:.0%} of its epoch")
        for _, proc in recorders:
            proc.wait(args.seconds + 30)
        client.close()
    finally:
        for _, proc in recorders:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        children.stop_all()
    for name, _ in recorders:
        path = args.out / f"{name}.txt"
        print(f"\n== {name} ({path})")
        print(summarize(path, args.top) if path.exists() else "  (py-spy wrote nothing: ptrace not allowed?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
