"""``sparkbus demo``: a broker, a Spark feed job and MPI ranks on this machine, with live figures and a summary.

    sparkbus demo [--quick] [--rows N] [--epochs E] [--features K] [--batch-size B] [--partitions P] ...

Starts ``python -m sparkbus.broker`` on three free loopback ports, ``mpiexec -n 2 python .../sparkbus/demo/ranks.py``
and ``spark-submit --master local[2] .../sparkbus/demo/feed.py`` (files of the installed package); shows the broker's
live figures while they run and a summary at the end. ``sparkbus demo --images [--decode rank|spark]`` runs the
image example (``sparkbus.examples.train_images``) on both sides instead: digits as PNG bytes in Spark, a small CNN
on the ranks. ``sparkbus demo --text`` runs the text example (``sparkbus.examples.train_text``): sentences tokenized
in Spark, ragged token ids, a small sequence model. Every child is ended on success, on failure and on Ctrl-C; the
exit status is non-zero if any part failed. Logs and JSON figures are left in --out. Epochs are numbered from 0
in everything printed, as the API numbers them, with their place in the run: "epoch 0 (1 of 2)". An epoch's
wait for its first batch (in the first epoch, Spark's start-up) is shown apart as "start-up"; the data wait and
the throughput are over the time after the first batch (``sparkbus.progress``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sparkbus.examples
from sparkbus.broker.client import fetch_stats
from sparkbus.cli_help import HelpFormatter
from sparkbus.launch.broker import BrokerProcess
from sparkbus.launch.mpi import loopback_env, mpiexec_python
from sparkbus.launch.processes import ChildProcess, LaunchError
from sparkbus.launch.spark import local_env, submit_command
from sparkbus.progress import EpochTimes, epoch_label, wait_share
from sparkbus.wire.errors import BrokerError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

HERE = Path(__file__).resolve().parent
RANKS = HERE / "ranks.py"                    # run as files of the installed package: mpiexec and spark-submit
FEED = HERE / "feed.py"                      # take a script path
EXAMPLES = Path(sparkbus.examples.__file__).resolve().parent
IMAGES = EXAMPLES / "train_images.py"
TEXT = EXAMPLES / "train_text.py"
SIZES = {"default": {"rows": 1_000_000, "epochs": 3, "batch_size": 1024, "partitions": 8},
         "quick": {"rows": 20_000, "epochs": 2, "batch_size": 256, "partitions": 8},
         "images": {"rows": 20_000, "epochs": 3, "batch_size": 128, "partitions": 4},
         "images-quick": {"rows": 3_000, "epochs": 2, "batch_size": 64, "partitions": 4},
         "text": {"rows": 50_000, "epochs": 3, "batch_size": 64, "partitions": 4},
         "text-quick": {"rows": 6_000, "epochs": 2, "batch_size": 64, "partitions": 4}}
IMAGE_VAL_ROWS = 1_000
TEXT_VAL_ROWS = 1_000
# Each demo reads and feeds streams of its own, so that two runs on one broker never take each other's batches.
STREAMS = {"default": ("demo", None), "images": ("images", "images-val"), "text": ("text", "text-val")}


class DemoFailed(Exception):
    """A part of the demo failed; the message says which and why."""


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparkbus demo", description="A broker, a Spark feed job and MPI ranks on "
                                     "this machine, with live figures and a summary. Logs go to --out. Needs "
                                     "pip install 'sparkbus[demo]' and Java 17+.",
                                     formatter_class=HelpFormatter)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--images", action="store_true",
                      help="images instead: digits as PNG bytes in Spark, a small CNN on the ranks "
                           "(sparkbus.examples.train_images; 20,000 images, 3 epochs; --quick 3,000, 2)")
    kind.add_argument("--text", action="store_true",
                      help="text instead: sentences tokenized in Spark, ragged token ids, a small sequence model "
                           "(sparkbus.examples.train_text; 50,000 sentences, 3 epochs; --quick 6,000, 2)")
    parser.add_argument("--quick", action="store_true",
                        help="a small fast run (20,000 rows, 2 epochs, batches of 256)")
    parser.add_argument("--rows", type=positive, help="rows of the data set (1,000,000; see --images, --text)")
    parser.add_argument("--epochs", type=positive, help="epochs (3; --quick 2)")
    parser.add_argument("--features", type=positive, default=64, help="float32 features per row")
    parser.add_argument("--classes", type=positive, default=10, help="classes of the synthetic set")
    parser.add_argument("--batch-size", type=positive, help="rows per batch (1024; --quick 256; --images 128 "
                                                            "(--quick 64); --text 64)")
    parser.add_argument("--partitions", type=positive,
                        help="Spark partitions of the set and of each epoch's shuffle (8; 4 with --images, --text)")
    parser.add_argument("--decode", choices=("rank", "spark"), default="rank",
                        help="with --images: decode the PNGs on the ranks (a thread pool) or in Spark")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data, the shuffles and the model")
    parser.add_argument("--np", type=positive, default=2, help="MPI ranks")
    parser.add_argument("--master", default="local[2]", help="Spark master")
    parser.add_argument("--driver-memory", default="2g", help="Spark driver memory; holds the cached set")
    parser.add_argument("--max-buffer", default="256MiB", help="bytes the broker holds before it throttles Spark")
    parser.add_argument("--min-accuracy", type=float, default=0.5, help="fail below this final accuracy")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the whole demo may take")
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="directory for logs and JSON figures")
    args = parser.parse_args(argv)
    args.kind = "images" if args.images else "text" if args.text else "default"
    sizes = SIZES[args.kind if not args.quick else "quick" if args.kind == "default" else f"{args.kind}-quick"]
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.out = args.out.resolve()
    args.stream, args.val_stream = STREAMS[args.kind]
    return args


class Demo:
    """The three children, started in order, watched until done, and always stopped."""

    def __init__(self, args: argparse.Namespace, console: Console):
        self.args, self.console = args, console
        self.children: dict[str, ChildProcess] = {}
        self.stopping = False
        self.out: Path = args.out
        self.started = time.monotonic()
        self.deadline = self.started + args.timeout

    # ---- starting ---------------------------------------------------------------------------------------

    def start_broker(self) -> BrokerProcess:
        """Start the broker on loopback ports it picks itself; return it once it is listening."""
        broker = BrokerProcess(self.out / "broker.log", "--max-buffer", self.args.max_buffer,
                               ready_file=self.out / "broker-ready.json", cwd=self.out)
        try:
            broker.start(timeout=min(30.0, self.remaining()))
        except LaunchError as exc:      # nothing of it is left running
            raise DemoFailed(f"the broker did not become ready: {exc}") from None
        if broker.child is not None:      # started: it has one
            self.children["broker"] = broker.child
        return broker

    def start_ranks(self, ranks: str) -> None:
        """``mpiexec -n NP python ranks.py`` (or the example) at the broker's ranks address; rank 0 writes
        summary.json."""
        a = self.args
        common = ("--ranks", ranks, "--stream", a.stream, "--epochs", str(a.epochs), "--seed", str(a.seed),
                  "--summary", str(self.out / "summary.json"))
        if a.images:
            command = mpiexec_python(a.np, IMAGES, *common, "--val-stream", a.val_stream, "--decode", a.decode)
        elif a.text:
            command = mpiexec_python(a.np, TEXT, *common, "--val-stream", a.val_stream)
        else:
            command = mpiexec_python(a.np, RANKS, *common, "--features", str(a.features), "--classes", str(a.classes))
        self.children["ranks"] = ChildProcess("ranks", command, self.out / "ranks.log",
                                              echo=self._echo("ranks", "cyan"), cwd=self.out,
                                              env={**loopback_env(), "PYTHONUNBUFFERED": "1"})

    def start_feed(self, feed: str) -> None:
        """``spark-submit feed.py`` (or the example), local mode, loopback, the venv's Python on the executors."""
        a = self.args
        common = ("--feed", feed, "--stream", a.stream, "--rows", str(a.rows), "--epochs", str(a.epochs),
                  "--batch-size", str(a.batch_size), "--partitions", str(a.partitions), "--seed", str(a.seed))
        if a.images:
            command = submit_command(IMAGES, *common, "--val-stream", a.val_stream, "--decode", a.decode,
                                     "--val-rows", str(IMAGE_VAL_ROWS), "--master", a.master,
                                     "--report", str(self.out / "feed-report.json"),
                                     master=a.master, driver_memory=a.driver_memory)
        elif a.text:
            command = submit_command(TEXT, *common, "--val-stream", a.val_stream, "--val-rows", str(TEXT_VAL_ROWS),
                                     "--master", a.master, master=a.master, driver_memory=a.driver_memory)
        else:
            command = submit_command(FEED, *common, "--features", str(a.features), "--classes", str(a.classes),
                                     "--report", str(self.out / "feed-report.json"),
                                     master=a.master, driver_memory=a.driver_memory)
        self.children["feed"] = ChildProcess("feed", command, self.out / "feed.log",
                                             echo=self._echo("spark", "magenta"), cwd=self.out,
                                             env={**local_env(), "PYTHONUNBUFFERED": "1"})

    def _echo(self, label: str, colour: str):
        from rich.text import Text

        def echo(line: str) -> None:
            if not self.stopping:     # what children say while being stopped is in their logs
                self.console.print(Text.assemble((f"{label:>6} │ ", colour), line))
        return echo

    # ---- watching ---------------------------------------------------------------------------------------

    def remaining(self) -> float:
        """Seconds left of --timeout."""
        return max(0.0, self.deadline - time.monotonic())

    def check_children(self) -> bool:
        """True once the feed job and the ranks have both succeeded. Raises DemoFailed if any part failed."""
        for name, child in self.children.items():
            code = child.returncode
            if code is not None and (code != 0 or name == "broker"):
                raise DemoFailed(f"the {name} process exited with status {code}; the end of "
                                 f"{child.log}:\n{child.tail()}")
        return all(self.children[name].returncode == 0 for name in ("feed", "ranks"))

    def watch(self, control: str) -> None:
        """Show the broker's live figures every half second until the feed and the ranks are done."""
        from rich.live import Live

        view = LiveLine(self.args.epochs, self.args.np, self.args.stream)
        live = Live(console=self.console, refresh_per_second=4, transient=False) \
            if self.console.is_terminal else None
        last_plain = 0.0
        if live:
            live.start()
        try:
            while not self.check_children():
                if self.remaining() <= 0:
                    raise DemoFailed(f"the demo did not finish within --timeout {self.args.timeout:g} s")
                try:
                    stats = fetch_stats(control, timeout=min(1.0, self.remaining() + 0.01))
                except BrokerError:
                    stats = None
                line = view.render(stats, time.monotonic() - self.started)
                if live:
                    live.update(line)
                elif time.monotonic() - last_plain >= 10:     # a log, not an animation, when piped
                    self.console.print(line)
                    last_plain = time.monotonic()
                time.sleep(0.5)
        finally:
            if live:
                live.stop()

    def stop_all(self) -> None:
        """End every child: the feed job and the ranks first, the broker last (SIGTERM, bounded wait, SIGKILL)."""
        for name in ("feed", "ranks", "broker"):
            if name in self.children:
                self.children[name].stop()

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every child's process group now, without waiting (safe in a signal handler)."""
        self.stopping = True
        for child in self.children.values():
            child.signal_group(sig)


class LiveLine:
    """One line of live figures from the broker's stats: epoch, batches in and out, MB/s, buffer use."""

    def __init__(self, epochs: int, ranks: int, stream: str):
        self.epochs, self.ranks, self.stream = epochs, ranks, stream
        self.samples: deque[tuple[float, int]] = deque()

    def rate(self, now: float, bytes_out: int) -> float:
        """MB/s out to the ranks over the last three seconds."""
        self.samples.append((now, bytes_out))
        while now - self.samples[0][0] > 3.0:
            self.samples.popleft()
        t0, b0 = self.samples[0]
        return (bytes_out - b0) / 1e6 / (now - t0) if now > t0 else 0.0

    def render(self, stats: dict[str, Any] | None, elapsed: float) -> Text:
        """The line for one ``fetch_stats`` reply (None: the broker did not answer)."""
        from rich.text import Text

        clock = (f"{elapsed:5.0f} s", "bold")
        if stats is None:
            return Text.assemble(clock, " │ ", ("the broker is not answering", "yellow"))
        try:
            return self._figures(clock, stats)
        except (KeyError, TypeError, ValueError) as exc:   # a broker whose figures have another shape
            return Text.assemble(clock, " │ ", (f"unexpected figures from the broker ({exc!r})", "yellow"))

    def _figures(self, clock: tuple[str, str], stats: dict[str, Any]) -> Text:
        from rich.text import Text

        broker, stream = stats["broker"], stats["streams"].get(self.stream)
        joined = len(stream["ranks"]) if stream else 0
        epochs = {int(n): e for n, e in stream["epochs"].items()} if stream else {}
        if not epochs:
            return Text.assemble(clock, f" │ ranks joined {joined}/{self.ranks} │ ",
                                 ("waiting for Spark: start-up, data generation, first shuffle…", "dim"))
        live = [n for n, e in epochs.items() if not e["ended"]]
        current = min(live) if live else max(epochs)
        e = epochs[current]
        state = "done" if e["ended"] else "closed" if e["closed"] else f"{e['committed']}/{e['partitions']} partitions"
        total = {k: sum(ep[k] for ep in epochs.values()) for k in ("batches_in", "batches_out", "bytes_out")}
        rate = self.rate(time.monotonic(), total["bytes_out"])
        used = broker["buffered_bytes"] / max(broker["max_buffer"], 1)
        return Text.assemble(
            clock, f" │ {epoch_label(current, self.epochs)}, {state}",
            f" │ batches in {total['batches_in']:,} out {total['batches_out']:,}",
            " │ ", (f"{rate:6.1f} MB/s", "green"),
            f" │ buffer {broker['buffered_bytes'] / 2**20:,.1f} MiB ({used:.0%})",
            (" feed paused" if broker["feed_paused"] else "", "yellow"),
            f" │ ranks {joined}/{self.ranks}")


# ---- the summary ------------------------------------------------------------------------------------------

def rank_times(ranks: list[dict], number: int) -> list[EpochTimes]:
    """Every rank's epoch ``number`` (0-based, in the order trained) of the demo's summary.json, split at its first
    batch."""
    return [EpochTimes.split(e["wait_seconds"], e["first_batch_seconds"], e["seconds"])
            for e in (r["epochs"][number] for r in ranks)]


def summarize(args: argparse.Namespace, console: Console, wall: float) -> None:
    """Print the summary tables from the feed job's and rank 0's JSON; raise DemoFailed if a check fails."""
    from rich.table import Table

    try:
        feed = json.loads((args.out / "feed-report.json").read_text())
        ranks = json.loads((args.out / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise DemoFailed(f"a part finished without writing its figures: {exc}") from None

    # Spark's side (rows and MB per second of the feed job), then the ranks': the wait for the epoch's first batch
    # (start-up; in the first epoch, Spark's) and the data wait after it, over every rank.
    epochs = Table(title="Epochs", title_justify="left")
    for column in ("epoch", "rows fed", "feed s", "rows/s", "MB/s", "start-up s", "data wait", "loss", "train acc",
                   "held-out acc"):
        epochs.add_column(column, justify="right")
    for number, (fed, trained) in enumerate(zip(feed["epochs"], ranks["epochs"])):
        times = rank_times(ranks["ranks"], number)
        epochs.add_row(epoch_label(fed["epoch"], args.epochs), f"{fed['rows']:,}", f"{fed['seconds']:.1f}",
                       f"{fed['rows'] / fed['seconds']:,.0f}", f"{fed['bytes'] / 1e6 / fed['seconds']:,.1f}",
                       f"{max(t.start_up for t in times):.1f}", f"{wait_share(times):.0%}",
                       f"{trained['loss']:.4f}", f"{trained['train_accuracy']:.1%}",
                       f"{trained['holdout_accuracy']:.1%}" if "holdout_accuracy" in trained else "-")

    per_rank = Table(title="Ranks", title_justify="left")
    for column in ("rank", "batches", "rows", "MB", "dropped", "start-up s", "streaming s", "waited s",
                   "wait share"):
        per_rank.add_column(column, justify="right")
    for r in ranks["ranks"]:
        # The wait for the first batch is Spark starting up and generating the set: shown apart, so that the
        # wait share is the part of the streaming time (first batch to last step) this rank had no data.
        first = r["first_batch_seconds"]
        streaming = max(r["seconds"] - first, 1e-9)
        per_rank.add_row(str(r["rank"]), f"{r['batches']:,}", f"{r['rows']:,}", f"{r['bytes'] / 1e6:,.1f}",
                         f"{r['dropped_batches']}", f"{first:.1f}", f"{streaming:.1f}",
                         f"{r['wait_seconds'] - first:.1f}", f"{(r['wait_seconds'] - first) / streaming:.0%}")

    # End to end: from the moment Spark began the first epoch's shuffle to the ranks' last step.
    span = ranks["finished_at"] - feed["epochs"][0]["started"]
    rows = sum(r["rows"] for r in ranks["ranks"])
    nbytes = sum(r["bytes"] for r in ranks["ranks"])
    accuracy = ranks["final_accuracy"]
    totals = Table(title="End to end", title_justify="left", show_header=False)
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    totals.add_row("data generation in Spark (cached, once)", f"{feed['generate_seconds']:.1f} s")
    totals.add_row(f"streaming {args.epochs} epochs, first shuffle to last step", f"{span:.1f} s")
    totals.add_row("rows / s to the ranks", f"{rows / span:,.0f}")
    totals.add_row("MB / s to the ranks", f"{nbytes / 1e6 / span:,.1f}")
    totals.add_row(f"final accuracy ({ranks['final_accuracy_kind']}; chance {1 / args.classes:.0%})",
                   f"{accuracy:.1%}")
    totals.add_row("largest weight difference between ranks", f"{ranks['model_spread_across_ranks']:g}")
    totals.add_row("demo wall time", f"{wall:.1f} s")
    console.print(epochs, per_rank, totals)

    problems = []
    for number in range(args.epochs):
        seen = sum(r["epochs"][number]["rows"] + r["epochs"][number]["dropped_rows"] for r in ranks["ranks"])
        if seen != args.rows:
            problems.append(f"{epoch_label(number, args.epochs)}: the ranks received {seen:,} rows, "
                            f"Spark fed {args.rows:,}")
    if accuracy is None or accuracy < args.min_accuracy:
        problems.append(f"final accuracy {accuracy} is below --min-accuracy {args.min_accuracy}")
    if ranks["model_spread_across_ranks"] > 1e-6:
        problems.append("the ranks' models diverged: the gradient averaging is broken")
    if problems:
        raise DemoFailed("; ".join(problems))


def summarize_images(args: argparse.Namespace, console: Console, wall: float) -> None:
    """``--images``: the tables from examples/train_images.py's JSON (feed and rank 0); raise DemoFailed if a check
    fails."""
    from rich.table import Table

    try:
        feed = json.loads((args.out / "feed-report.json").read_text())["epochs"]
        ranks = json.loads((args.out / "summary.json").read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise DemoFailed(f"a part finished without writing its figures: {exc}") from None
    epochs = Table(title=f"Epochs (images {ranks['size']}x{ranks['size']} PNG, decoded on the {args.decode} side)",
                   title_justify="left")
    # train s: the ranks' epoch; start-up: its wait for the first batch (in the first epoch, Spark's); images/s and
    # data wait: over the time after the first batch (the example's figures, sparkbus.progress)
    for column in ("epoch", "images", "feed s", "MB fed", "train s", "start-up s", "images/s", "data wait", "loss",
                   "train acc", "held-out acc"):
        epochs.add_column(column, justify="right")
    for fed, trained in zip(feed, ranks["epochs"]):
        report = fed[args.stream]
        epochs.add_row(epoch_label(fed["epoch"], args.epochs), f"{report['rows']:,}", f"{report['seconds']:.1f}",
                       f"{report['bytes'] / 1e6:,.1f}", f"{trained['seconds']:.1f}",
                       f"{trained['start_up_seconds']:.1f}", f"{trained['images_per_second']:,.0f}",
                       f"{trained['data_wait_share']:.0%}", f"{trained['loss']:.4f}",
                       f"{trained['accuracy']:.1%}", f"{trained['val_accuracy']:.1%}")
    accuracy = ranks["final"].get("val_accuracy")
    totals = Table(title="End to end", title_justify="left", show_header=False)
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    streaming = sum(e["streaming_seconds"] for e in ranks["epochs"])      # each epoch after its first batch
    totals.add_row("images / s to the CNN, after each epoch's start-up",
                   f"{sum(e['images'] for e in ranks['epochs']) / max(streaming, 1e-9):,.0f}")
    totals.add_row("final held-out accuracy (chance 10%)", f"{accuracy:.1%}")
    totals.add_row("demo wall time", f"{wall:.1f} s")
    console.print(epochs, totals)

    problems = []
    for fed, trained in zip(feed, ranks["epochs"]):
        # every image once: the epoch's last batches are shared out by rows, none dropped (BatchStream's default)
        if trained["images"] != fed[args.stream]["rows"] or sum(trained["dropped_batches"]):
            problems.append(f"{epoch_label(fed['epoch'], args.epochs)}: the ranks trained {trained['images']:,} "
                            f"images and dropped {sum(trained['dropped_batches'])} batches, Spark fed "
                            f"{fed[args.stream]['rows']:,}")
        if trained["val_images"] != IMAGE_VAL_ROWS:
            problems.append(f"{epoch_label(fed['epoch'], args.epochs)}: {trained['val_images']} held-out images, "
                            f"not {IMAGE_VAL_ROWS}")
    if len(ranks["epochs"]) != args.epochs:
        problems.append(f"the ranks trained {len(ranks['epochs'])} epochs, not {args.epochs}")
    if accuracy is None or accuracy < args.min_accuracy:
        problems.append(f"final held-out accuracy {accuracy} is below --min-accuracy {args.min_accuracy}")
    if len(set(ranks["param_checksums"])) != 1:
        problems.append("the ranks' models diverged: the gradient averaging is broken")
    if problems:
        raise DemoFailed("; ".join(problems))



def summarize_text(args: argparse.Namespace, console: Console, wall: float) -> None:
    """``--text``: the tables from the text example's JSON (rank 0); raise DemoFailed if a check fails."""
    from rich.table import Table

    try:
        ranks = json.loads((args.out / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise DemoFailed(f"the ranks finished without writing their figures: {exc}") from None
    epochs = Table(title="Epochs (sentences as ragged token ids, padded per batch)", title_justify="left")
    # start-up: the ranks' wait for the epoch's first batch (in the first epoch, Spark's); sentences/s and data
    # wait: over the time after it (the example's figures, sparkbus.progress)
    for column in ("epoch", "batching", "steps", "sentences", "dropped", "start-up s", "sentences/s", "data wait",
                   "padding", "loss", "train acc", "held-out acc"):
        epochs.add_column(column, justify="right")
    for trained in ranks["epochs"]:
        epochs.add_row(epoch_label(trained["epoch"], args.epochs), "bucketed" if trained["bucketed"] else "plain",
                       f"{trained['steps']}", f"{trained['rows']:,}", f"{sum(trained['dropped_batches'])}",
                       f"{trained['start_up_seconds']:.1f}", f"{trained['rows_per_second']:,.0f}",
                       f"{trained['data_wait_share']:.0%}", f"{trained['padding_share']:.1%}",
                       f"{trained['loss']:.4f}", f"{trained['accuracy']:.1%}", f"{trained['val_accuracy']:.1%}")
    accuracy = ranks["final"].get("val_accuracy")
    totals = Table(title="End to end", title_justify="left", show_header=False)
    totals.add_column(justify="left")
    totals.add_column(justify="right")
    totals.add_row(f"final held-out accuracy (chance {1 / 4:.0%})", f"{accuracy:.1%}")
    padding = ranks["padding"]
    if padding["ratio"] is not None:
        totals.add_row("padding share, bucketed / plain", f"{padding['ratio']:.2f}")
    totals.add_row("demo wall time", f"{wall:.1f} s")
    console.print(epochs, totals)

    problems = []
    if len(ranks["epochs"]) != args.epochs:
        problems.append(f"the ranks trained {len(ranks['epochs'])} epochs, not {args.epochs}")
    for trained in ranks["epochs"]:
        if trained["val_rows"] != TEXT_VAL_ROWS:
            problems.append(f"{epoch_label(trained['epoch'], args.epochs)}: {trained['val_rows']} held-out "
                            f"sentences, not {TEXT_VAL_ROWS}")
    if accuracy is None or accuracy < args.min_accuracy:
        problems.append(f"final held-out accuracy {accuracy} is below --min-accuracy {args.min_accuracy}")
    if len(set(ranks["param_checksums"])) != 1:
        problems.append("the ranks' models diverged: the gradient averaging is broken")
    if problems:
        raise DemoFailed("; ".join(problems))

def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:         # an import hook that refuses it, or a parent package that fails
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [name for name in ("rich", "pyspark", "mpi4py", *(("torch",) if args.images or args.text else ()),
                                 *(("PIL", "sklearn") if args.images else ()))
               if not installed(name)]
    if missing:
        print(f"sparkbus demo: error: {', '.join(missing)} not installed: pip install 'sparkbus[demo]'",
              file=sys.stderr)
        return 2
    if not shutil.which("java") and not os.environ.get("JAVA_HOME"):
        print("sparkbus demo: error: Spark needs Java 17 or later (no java on PATH, JAVA_HOME not set)",
              file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.text import Text

    console = Console()
    if not console.is_terminal:
        console.width = 120     # a log file: no wrapping at 80 columns
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "feed-report.json"):
        (args.out / stale).unlink(missing_ok=True)
    demo = Demo(args, console)
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        unwind = not demo.stopping          # once cleaning up, let the cleanup finish
        demo.signal_all(signal.SIGTERM)     # at once: `sparkbus demo` SIGKILLs this process 0.25 s after ^C
        if unwind:
            interrupted.append(signum)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if args.text:
        console.print(f"[bold]sparkbus demo --text[/]: {args.rows:,} sentences tokenized in Spark, ragged token ids, "
                      f"{args.epochs} epochs, batches of {args.batch_size}, Spark {args.master}, {args.np} MPI ranks; "
                      f"logs in {args.out}")
    elif args.images:
        console.print(f"[bold]sparkbus demo --images[/]: {args.rows:,} digit images as PNG, decoded on the "
                      f"{args.decode} side, {args.epochs} epochs, batches of {args.batch_size}, Spark {args.master}, "
                      f"{args.np} MPI ranks; logs in {args.out}")
    else:
        console.print(f"[bold]sparkbus demo[/]: {args.rows:,} rows × {args.features} features, {args.classes} "
                      f"classes, {args.epochs} epochs, batches of {args.batch_size}, Spark {args.master}, "
                      f"{args.np} MPI ranks; logs in {args.out}")
    try:
        broker = demo.start_broker()
        console.print(f"broker pid {broker.pid}: feed {broker.feed}, ranks {broker.ranks}, control {broker.control}")
        demo.start_ranks(broker.ranks)
        demo.start_feed(broker.feed)
        for child in demo.children.values():
            child.start_echo()
        demo.watch(broker.control)
        wall = time.monotonic() - demo.started
        demo.stop_all()
        (summarize_images if args.images else summarize_text if args.text else summarize)(args, console, wall)
    except (DemoFailed, OSError) as exc:     # OSError: a program that could not be started
        demo.stopping = True
        console.print(Text.assemble(("demo failed: ", "bold red"), str(exc)))
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the broker, the feed job and the ranks[/]")
        return 128 + (interrupted[0] if interrupted else signal.SIGINT)
    finally:
        demo.stopping = True
        demo.stop_all()
    console.print("[bold green]demo passed[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
