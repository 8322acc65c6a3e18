"""sparkbus benchmark, the peer comparisons of a checkout: every figure of benchmarks/README.md, each a section.

Runs the chosen sections in order, writing each section's figures as JSON lines to ``OUT/figures.jsonl`` as it
ends, then the one report of ``sparkbus.bench.figures`` (``RESULTS.md``, ``results.json``, ``ratios.png``: the
targets of ``sparkbus/bench/targets.py`` with PASS/MISS, every figure beside its anchor). Exit status 0 when every
figure was measured, whatever the verdicts; 1 when a part failed; 130 on Ctrl-C. Every child is stopped on the way out.
"""

from __future__ import annotations

# Keep the imports at the top light: spawned agents re-import this file as __mp_main__.
import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def all_sections() -> list[Any]:
    """Every section, in the order they run."""
    from benchmarks import faults, soak
    from benchmarks.brokers import BrokersSection
    from benchmarks.cluster import ClusterSection
    from benchmarks.datawait import DataWaitSection
    from benchmarks.end_to_end import EndToEndSection
    from benchmarks.hop import HopSection
    from benchmarks.images import ImagesSection
    from benchmarks.lm import LmSection
    from benchmarks.remainder import RemainderSection
    from benchmarks.scaling import RssSection, ScalingSection
    from benchmarks.spark_configs import SparkSection
    from benchmarks.torchrun import TorchrunSection
    from benchmarks.varlen import VarlenSection

    # hop and rss first: in a quick run Spark starts in the background meanwhile
    return [HopSection(), RssSection(), EndToEndSection(), ClusterSection(), ScalingSection(), DataWaitSection(),
            BrokersSection(), VarlenSection(), LmSection(), SparkSection(), ImagesSection(), TorchrunSection(),
            RemainderSection(), soak.SoakSection(), faults.FaultsSection()]


def parse_args(argv: list[str] | None = None, sections: list[Any] | None = None) -> argparse.Namespace:
    sections = all_sections() if sections is None else sections
    names = [s.name for s in sections]
    quick = [s.name for s in sections if s.quick]
    parser = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and 1 repetition (minutes on 2 cores)")
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "bench",
                        help="directory for figures.jsonl, RESULTS.md, results.json (default docs/bench)")
    parser.add_argument("--only", help=f"comma-separated sections (default all: {','.join(names)}; with --quick: "
                                       f"{','.join(quick)})")
    parser.add_argument("--reps", type=int, help="repetitions per figure (default 3, --quick 1)")
    parser.add_argument("--rows", type=int, help="rows of the cached DataFrame (default 4,194,304; --quick 100,000)")
    parser.add_argument("--rss-bytes", help="bytes pushed through the broker for its peak RSS (e.g. 1GiB)")
    parser.add_argument("--hop-seconds", type=float, help="minimum length of each broker-hop measurement")
    parser.add_argument("--spark-configs", default="local,1x1,2x1,1x2",
                        help="Spark set-ups of the spark section: local (local[2]) and standalone EXECUTORSxCORES")
    parser.add_argument("--spark-partitions", default="4,16", help="partitions per epoch in the spark section")
    parser.add_argument("--spark-rows", type=int, help="rows fed by each Spark set-up (default 1,048,576)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the children's logs (printed path)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in (args.only or ",".join(quick if args.quick else names)).split(",")
                     if s.strip()]
    if set(args.sections) - set(names):
        parser.error(f"unknown sections {sorted(set(args.sections) - set(names))}; choose from {', '.join(names)}")
    try:
        from benchmarks.spark_configs import parse_configs

        parse_configs(args.spark_configs)
        args.spark_partitions = tuple(int(p) for p in args.spark_partitions.split(",") if p.strip())
    except ValueError as exc:
        parser.error(f"--spark-configs or --spark-partitions: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    sections = all_sections()
    args = parse_args(argv, sections)
    import dataclasses
    import shutil
    import tempfile
    import traceback

    from benchmarks import common
    from benchmarks.sections import Context, Run
    from sparkbus.bench.figures import Recorder, machine, write_report
    from sparkbus.broker.config import parse_size

    overrides = {"reps": args.reps, "cluster_reps": args.reps, "rows": args.rows, "hop_seconds": args.hop_seconds,
                 "spark_rows": args.spark_rows, "rss_bytes": parse_size(args.rss_bytes) if args.rss_bytes else None}
    sizes = dataclasses.replace(common.QUICK if args.quick else common.FULL,
                                **{k: v for k, v in overrides.items() if v is not None})
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="sparkbus-bench-"))
    children = common.Children(work)
    started = time.monotonic()
    about = machine()

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:5.1f} s] {text}", flush=True)

    run = Run(sizes)
    ctx = Context(children, sizes, work, log, args, results=run.results)
    record = Recorder(args.out / "figures.jsonl")
    run.figures = record.figures
    chosen = [s for s in sections if s.name in args.sections]
    needs = {s.name: s.needs(args) for s in chosen}
    failed = None
    try:
        for section in chosen:
            if needs[section.name] and ctx.spark is None:
                start_spark(ctx, "frame" in needs.values())
            log(section.title)
            run.results[section.name] = section.measure(ctx)
            record.add(*section.figures(run, run.results[section.name]))
    except KeyboardInterrupt as exc:
        failed = f"interrupted ({exc or 'Ctrl-C'})"
    except Exception as exc:
        traceback.print_exc()
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):     # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        children.stop_all()
        if ctx.spark is not None:
            try:
                ctx.spark.stop()
            except Exception:
                pass
    notes = [*ctx.notes, *([f"the run did not complete: {failed.splitlines()[0]}"] if failed else [])]
    extra: dict[str, Any] = {"sizes": dataclasses.asdict(sizes), "seconds": time.monotonic() - started}
    for section in chosen:                 # a section that failed part-way: what it measured
        if section.name in run.results:
            try:
                if not any(f.section == section.name for f in run.figures):
                    record.add(*section.figures(run, run.results[section.name]))
                extra |= section.json(run, run.results[section.name])
            except Exception as exc:  # noqa: BLE001 - the other sections' figures still stand
                notes.append(f"{section.name}: no figures ({type(exc).__name__}: {exc})")
    print("\n" + write_report(args.out, run.figures, {s.name: s.title for s in sections}, about, notes, extra))
    if args.keep_logs or failed:
        print(f"children's logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        print(f"benchmark failed: {failed}", file=sys.stderr)
        return 130 if failed.startswith("interrupted") else 1
    return 0


def start_spark(ctx: Any, frame: bool) -> None:
    """The run's local[2] SparkSession into ``ctx`` and, if ``frame``, the cached DataFrame of the sections that
    share it (scanned once through Python: the workers started, the scan warm)."""
    from benchmarks import spark_data
    from sparkbus.bench.e2e import hand_off
    from sparkbus.launch.spark import local_session

    ctx.log("starting Spark (local[2])" + (" and caching the DataFrame" if frame else ""))
    started = time.monotonic()
    # the process's first session: the driver memory is a setting of the JVM
    ctx.spark = local_session("local[2]", "sparkbus-bench", {"spark.driver.memory": ctx.sizes.driver_memory})
    ctx.session_seconds = time.monotonic() - started
    if frame:
        ctx.df, info = spark_data.cached_frame(ctx.spark, ctx.sizes.rows, ctx.sizes.partitions)
        hand_off(ctx.df.limit(1000))
        ctx.rows = info["rows"]
        ctx.log(f"  {ctx.rows:,} rows cached: {info['cached_memory_bytes'] / 2**30:.2f} GiB in memory, "
                f"{info['cached_disk_bytes'] / 2**30:.2f} GiB on disk")


if __name__ == "__main__":
    # Run as a script (python benchmarks/bench.py, make bench): Python put this directory first on sys.path, where
    # its module names (common, ...) would shadow others; the checkout's root takes its place.
    sys.path[0] = str(HERE.parent)
    from benchmarks.bench import main as package_main

    sys.exit(package_main())
