"""``sparkbus bench``: what sparkbus does on this machine, each figure beside the anchor it is compared with."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sparkbus.cli_help import HelpFormatter

from . import e2e, hop
from .figures import Recorder, machine, verdicts, write_report

DESCRIPTION = """\
Measure how fast sparkbus moves data on this machine, each figure beside an anchor measured in the same run:

  hop    one hop through the broker: batches of 2^10, 2^16 and 2^20 bytes from a sender process to a
         receiver process over loopback TCP; MB/s (and batches/s for the smallest) against zmq.proxy,
         the C broker of libzmq, the most a hop can do; at 2^20, the CPU-s per GB of each process
  e2e    end to end: a cached Spark dataframe (id + 64 float32 features) in local mode, fed through a
         broker to 2 ranks; rows/s against Spark's own hand-off to Python (mapInArrow, nothing done: no
         sink is faster), and the time to the first and the last batch against staging it as Parquet
  table  the same end to end for your own data (--parquet PATH: a Parquet file or directory)

Each figure is the median of --reps repetitions, written as it is measured as one JSON line to
OUT/figures.jsonl (section, name, value, unit, the anchor and the ratio to it); then OUT/RESULTS.md and
OUT/results.json list the figures and each target (the ratio to reach) with PASS or MISS. Exit status: 0
when every figure was measured, whatever the verdicts; 1 when a section failed; 2 on a usage error.
e2e and table need pyspark and Java (pip install 'sparkbus[spark]'). Comparisons with other ways of
feeding (several brokers, Spark set-ups, fault tables, ...) are in a source checkout's benchmarks/."""

TITLES = {"hop": "The hop: sparkbus's broker vs zmq.proxy",
          "e2e": "End to end from Spark: sparkbus vs Spark's hand-off and Parquet staging",
          "table": "Your own data, end to end"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparkbus bench", description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, one repetition (about a minute)")
    p.add_argument("--only", help="comma-separated: hop, e2e, table (default: hop and e2e, and table with --parquet)")
    p.add_argument("--parquet", metavar="PATH", help="your own data: a Parquet file or directory, fed end to end")
    p.add_argument("--rows", type=int, help="rows of the synthetic DataFrame (default 2,097,152; 100,000 quick)")
    p.add_argument("--reps", type=int, help="repetitions of each figure (default 3; 1 quick)")
    p.add_argument("--hop-seconds", type=float, help="how long each hop run sends (default 1; 0.12 quick)")
    p.add_argument("--no-staging", action="store_true", help="leave out the Parquet staging comparison")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take")
    p.add_argument("--out", default="sparkbus-bench", help="directory for figures.jsonl, RESULTS.md, results.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    sections = args.only.split(",") if args.only else ["hop", "e2e", *(["table"] if args.parquet else [])]
    unknown = set(sections) - set(TITLES)
    if unknown or ("table" in sections and not args.parquet):
        print(f"sparkbus bench: error: {'unknown sections ' + ', '.join(sorted(unknown)) if unknown else ''}"
              f"{'' if unknown else 'table needs --parquet PATH'}", file=sys.stderr)
        return 2
    if args.parquet and not Path(args.parquet).exists():
        print(f"sparkbus bench: error: --parquet {args.parquet}: no such file or directory", file=sys.stderr)
        return 2
    reps = args.reps or (1 if args.quick else 3)
    out = Path(args.out)
    record = Recorder(out / "figures.jsonl")
    about = machine()
    failed = missing = False
    spark = None
    with tempfile.TemporaryDirectory(prefix="sparkbus-bench-") as tmp:
        work = Path(tmp)
        for section in sections:
            print(f"== {TITLES[section]}", flush=True)
            try:
                if section == "hop":
                    seconds = args.hop_seconds or (0.12 if args.quick else 1.0)
                    record.add(*hop.measure(work, reps, seconds, args.timeout))
                    continue
                if spark is None:
                    from sparkbus.launch.spark import local_session

                    spark = local_session(app="sparkbus-bench", conf={"spark.ui.enabled": "false"})
                if section == "e2e":
                    rows = args.rows or (100_000 if args.quick else 2_097_152)
                    record.add(*e2e.measure("e2e", e2e.synthetic_frame(spark, rows), work, reps, args.timeout,
                                            parquet=not args.no_staging, row_bytes=8 + 64 * 4))
                else:
                    df = spark.read.parquet(str(Path(args.parquet).resolve()))
                    record.add(*e2e.measure("table", df, work, reps, args.timeout, parquet=not args.no_staging))
            except ImportError as exc:          # an extra not installed (pyspark): said, the other sections run
                missing = True
                record.notes.append(f"{section} not run: {exc}")
                print(f"sparkbus bench: error: {section}: {exc}", file=sys.stderr)
            except Exception as exc:  # noqa: BLE001 - a failed section is reported; the others still run
                failed = True
                record.notes.append(f"{section} failed: {exc}")
                print(f"sparkbus bench: {section} failed: {exc}", file=sys.stderr)
        if spark is not None:
            spark.stop()
    write_report(out, record.figures, TITLES, about, record.notes)
    print()
    for v in verdicts(record.figures):
        print(f"{v['verdict']}  {v['what']}: {v['measured']:.3g} (goal {v['goal']})")
    print(f"figures: {out / 'figures.jsonl'}; report: {out / 'RESULTS.md'}")
    return 2 if missing else 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
