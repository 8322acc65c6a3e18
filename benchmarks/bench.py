"""sparkbus benchmark: hop, end to end (also cluster-shaped), scaling, memory, data-wait, brokers, varlen, Spark set-ups.

    .venv/bin/python benchmarks/bench.py [--quick] [--out docs/bench]
        [--only hop,rss,e2e,cluster,scaling,wait,brokers,varlen,spark]

Prints each figure as it is measured, then the tables and every target with its measured value and PASS/MISS,
and writes ``OUT/RESULTS.md``, ``OUT/throughput.png`` and ``OUT/results.json``. Exit status 0 when every
figure was measured (whatever the verdicts: this is a report, not a test), 1 when a part failed, 130 on
Ctrl-C. Every child process (brokers, agents, mpiexec and its ranks, Spark's JVM) is stopped on the way out.
See benchmarks/README.md.
"""

from __future__ import annotations

# Keep the imports at the top light: spawned agents re-import this file as __mp_main__.
import argparse
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SECTIONS = ("hop", "rss", "e2e", "cluster", "scaling", "wait", "brokers", "varlen", "spark")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and 1 repetition (under a minute on 2 cores)")
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "bench",
                        help="directory for RESULTS.md, throughput.png and results.json (default docs/bench)")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    parser.add_argument("--reps", type=int, help="repetitions per figure (default 3, --quick 1)")
    parser.add_argument("--rows", type=int, help="rows of the cached DataFrame (default 4,194,304; --quick 100,000)")
    parser.add_argument("--rss-bytes", help="bytes pushed through the broker for its peak RSS (e.g. 1GiB)")
    parser.add_argument("--hop-seconds", type=float, help="minimum length of each broker-hop measurement")
    parser.add_argument("--spark-configs", default="local,1x1,2x1,1x2",
                        help="Spark set-ups of the spark section: local (local[2]) and standalone EXECUTORSxCORES "
                             "(default local,1x1,2x1,1x2)")
    parser.add_argument("--spark-partitions", default="4,16",
                        help="partitions per epoch in the spark section (default 4,16)")
    parser.add_argument("--spark-rows", type=int, help="rows fed by each Spark set-up (default 1,048,576; "
                                                       "--quick 100,000)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the children's logs (printed path)")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    try:
        args.spark_partitions = tuple(int(p) for p in args.spark_partitions.split(",") if p.strip())
    except ValueError:
        parser.error(f"--spark-partitions takes comma-separated numbers, not {args.spark_partitions!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    import dataclasses
    import os
    import shutil
    import tempfile

    import common
    import report
    from broker.config import parse_size

    sizes = common.QUICK if args.quick else common.FULL
    import spark_configs

    try:
        configs = spark_configs.parse_configs(args.spark_configs)
    except ValueError as exc:
        print(f"benchmarks/bench.py: error: --spark-configs: {exc}", file=sys.stderr)
        return 2
    overrides = {"reps": args.reps, "cluster_reps": args.reps, "rows": args.rows, "hop_seconds": args.hop_seconds,
                 "spark_rows": args.spark_rows,
                 "rss_bytes": parse_size(args.rss_bytes) if args.rss_bytes else None}
    sizes = dataclasses.replace(sizes, **{k: v for k, v in overrides.items() if v is not None})
    if any(v is not None for v in overrides.values()):
        sizes = dataclasses.replace(sizes, name=f"{sizes.name}, custom")

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="sparkbus-bench-"))
    children = common.Children(work)
    started = time.monotonic()
    results: dict = {"sizes": sizes, "machine": report.machine(), "notes": []}
    spark = prep = None
    failed = None

    def log(text: str) -> None:
        print(f"[{time.monotonic() - started:5.1f} s] {text}", flush=True)

    log(f"sparkbus benchmark, {sizes.name} size, {sizes.reps} repetition(s); work dir {work}")
    sections = set(args.sections)
    # The cached DataFrame serves sections 2-5; the session alone also serves local[2] in section 6.
    needs_frame = bool({"e2e", "scaling", "wait", "brokers"} & sections)
    needs_session = needs_frame or "varlen" in sections or ("spark" in sections and
                                                            any(not c.executors for c in configs))
    # --quick: Spark's start-up (JVM, caching, warm-up) overlaps the hop and RSS sections, whose figures get
    # noisier but the run fits in a minute. At full size Spark starts after them, on a quiet machine.
    prep = SparkPrep(sizes, needs_frame, log) if needs_session and args.quick else None
    try:
        if "hop" in sections:
            import hop

            log("1. broker hop")
            results["hop"] = hop.run(children, sizes, log)
        if "rss" in sections:
            import scaling

            log("3b. broker peak RSS")
            results["rss"] = scaling.run_rss(children, sizes, log)
        df = info = None
        if needs_session:
            prep = prep or SparkPrep(sizes, needs_frame, log)
            spark, df, info = prep.result(sizes.timeout * 2)
        if needs_frame:
            results["dataset"] = info
            log(f"  {info['rows']:,} rows, {info['payload_bytes'] / 2**30:.2f} GiB payload, cached "
                f"{info['cached_memory_bytes'] / 2**30:.2f} GiB in memory / {info['cached_disk_bytes'] / 2**30:.2f} "
                f"GiB on disk, built in {info['build_seconds']:.1f} s")
            if info["cached_disk_bytes"]:
                results["notes"].append("part of the cached DataFrame spilled to disk: raise the driver memory")
        rate = None
        if "e2e" in sections:
            import end_to_end

            log("2. end to end")
            results["e2e"] = end_to_end.run(children, df, info["rows"], sizes, work, log)
            rate = results["e2e"]["sparkbus"].med("rows_per_s")
        if "cluster" in sections:
            import cluster

            log("2b. end to end, cluster-shaped (Spark on one core, the broker and the ranks on the other)")
            results["cluster"] = {}
            cluster.run(children, sizes, work, log=log, out=results["cluster"])
        if "scaling" in sections:
            import scaling

            log("3. scaling")
            results["scaling"] = scaling.run(children, df, info["rows"], sizes, work, results.get("e2e", {})
                                             .get("sparkbus"), log)
        if "wait" in sections:
            import datawait

            log("4. data-wait")
            results["datawait"] = datawait.run(children, spark, df, info["rows"], sizes, work, rate, log)
        if "brokers" in sections:
            import brokers

            log("5. several brokers")
            results["brokers"] = brokers.run(children, df, info["rows"], sizes, work, log)
        if "varlen" in sections:
            import varlen

            log("7. variable-length columns")
            results["varlen"] = {}
            varlen.run(children, spark, sizes, work, log=log, out=results["varlen"])
        if "spark" in sections:
            log("6. Spark configurations")
            results["spark"] = {}
            spark_configs.run(children, spark, prep.session_seconds if prep else None, sizes, work, configs,
                              args.spark_partitions, log, out=results["spark"])
            spilled = [f"{key} at {parts} partitions" for (key, parts), stored in results["spark"]["storage"].items()
                       if stored.get("cached_disk_bytes")]
            if spilled:
                results["notes"].append(f"Spark set-ups whose cached data spilled to disk: {', '.join(spilled)} "
                                        "(raise the executors' memory)")
    except KeyboardInterrupt as exc:
        failed = f"interrupted ({exc or 'Ctrl-C'})"
    except Exception as exc:
        import traceback

        traceback.print_exc()
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):     # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        children.stop_all()
        if prep is not None:
            spark = prep.session(30.0)
        if spark is not None:
            try:
                spark.stop()
            except Exception:
                pass
    results["seconds"] = time.monotonic() - started
    results["machine"]["load_end"] = os.getloadavg()
    if failed:
        results["notes"].append(f"the run did not complete: {failed.splitlines()[0]}")
    results["targets"] = report.targets(results)
    md, png = report.write(results, args.out)
    print()
    print(report.markdown(results))
    print(report.console_targets(results))
    print(f"\nwrote {md} and {png} ({results['seconds']:.0f} s)")
    if args.keep_logs or failed:
        print(f"children's logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if failed:
        print(f"benchmark failed: {failed}", file=sys.stderr)
        return 130 if failed.startswith("interrupted") else 1
    return 0


class SparkPrep:
    """The SparkSession and (if ``frame``) the cached DataFrame, prepared in a thread (started at once)."""

    def __init__(self, sizes, frame: bool, log):
        import threading

        self.sizes, self.frame, self.log = sizes, frame, log
        self.spark = self.value = self.error = self.session_seconds = None
        self._thread = threading.Thread(target=self._run, name="spark-prep", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import spark_data
            from launch.spark import local_session

            self.log("starting Spark (local[2])" + (" and caching the DataFrame" if self.frame else ""))
            started = time.monotonic()
            # must be the process's first session: the driver memory is a setting of the JVM
            self.spark = local_session("local[2]", "sparkbus-bench",
                                       {"spark.driver.memory": self.sizes.driver_memory})
            self.session_seconds = time.monotonic() - started
            if not self.frame:
                self.value = (self.spark, None, None)
                return
            df, info = spark_data.cached_frame(self.spark, self.sizes.rows, self.sizes.partitions)
            spark_data.warm_up(df)
            self.value = (self.spark, df, info)
        except BaseException as exc:       # handed to the main thread by result()
            self.error = exc

    def result(self, timeout: float):
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"Spark did not start and cache the DataFrame within {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.value

    def session(self, timeout: float):
        """The session to stop, once the thread is done with it (None if it never started)."""
        self._thread.join(timeout)
        return self.spark


if __name__ == "__main__":
    sys.exit(main())
