"""Figure 2b, end to end shaped like a cluster: Spark on one core, the broker and the ranks on the other.

On a cluster the broker and the ranks have hosts of their own, and only the feeder's work (in Spark's Python
workers) competes with Spark for the executors' cores. On one 2-core machine that is simulated by pinning:

* a Spark driver process of its own (``spark_driver.py --cpus 0``, ``local[1]``) calls ``os.sched_setaffinity``
  before its session starts, so its JVM and the JVM's Python workers, where the feeder runs, stay on CPU 0;
* the broker and ``mpiexec -n 2 rank_consumer.py`` (hydra and both ranks) run under ``taskset -c 1``.

Per data kind (``fixed``: the ``id`` + float32[64] rows of figure 2; ``tokens``: ``id`` + int arrays of 1..127
elements, as many bytes a row on average), cached in that driver, and per batch size (1 MiB and 64 KiB of payload:
``batch_size`` = size / mean row bytes, ``max_batch_bytes`` = size), each repetition measures the Arrow hand-off
limit (``mapInArrow`` + drop, on the same one core) and one epoch fed by ``feeder.feed`` to the 2 ranks, in an
order that alternates from one repetition to the next. Figures: rows/s of each (all rows / time from the call to
the last batch at any rank), the ratio of their medians, and the CPU seconds of each process group; from these,
the feeder's CPU seconds per GB in Spark's Python workers above what the hand-off alone costs them.

A kind the feeder refuses (variable-length arrays before protocol v4) is reported as not measured, with the
feeder's own words. The driver checks once, from inside a task, which sparkbus Spark's Python workers import and
where they run; the ranks report theirs with their figures.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import end_to_end
import spark_data
from common import KiB, MiB, ROOT, BenchError, Children, Sizes, median, on_cpus
from end_to_end import RANKS, CpuMeter, Series
from spark_configs import Config, DriverProcess

BATCH_BYTES = (MiB, 64 * KiB)
KINDS = ("fixed", "tokens")
PARTITIONS = 4
MAX_BUFFER = "256MiB"
CONFIG = Config("cluster", 0, 1)        # local[1]: one task slot, as one executor core on a cluster
_streams = itertools.count()


def cpus() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Spark's CPUs, the broker's and the ranks' CPUs): the first two this process may use.

    Raises:
        BenchError: fewer than 2 CPUs.
    """
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        raise BenchError(f"the cluster-shaped runs need 2 CPUs, this process may use {mine}")
    return (mine[0],), (mine[1],)


def batch_options(size: int, row_bytes: float) -> tuple[int, dict]:
    """``(batch_size, feed options)`` for batches of about ``size`` bytes of rows of ``row_bytes`` on average."""
    return max(1, int(size // row_bytes)), {"max_batch_bytes": size}


def run(children: Children, sizes: Sizes, work: Path, kinds: tuple[str, ...] = KINDS, log=print,
        out: dict | None = None) -> dict:
    """Every (kind, batch size) point; fills and returns ``out``:

    ``{"rows", "cpus": {"spark", "bus"}, "where": {...}, "kinds": {kind: stored info}, "refused": {kind: why},
    "points": {(kind, size): {"limit": Series, "sparkbus": Series}}}`` (filled as it goes).
    """
    out = {} if out is None else out
    spark_cpus, bus_cpus = cpus()
    out.update(rows=sizes.cluster_rows, reps=sizes.cluster_reps, cpus={"spark": list(spark_cpus),
                                                                       "bus": list(bus_cpus)},
               kinds={}, refused={}, points={})
    bus = on_cpus(bus_cpus)
    broker = children.broker(MAX_BUFFER, prefix=bus)
    driver = DriverProcess(children, CONFIG, "local[1]", sizes, work, cpus=spark_cpus,
                           conf={"spark.driver.memory": sizes.driver_memory})
    try:
        info = driver.wait_ready()
        where = out["where"] = {**driver.where(), "session_seconds": info["session_seconds"]}
        log(f"  Spark local[1] pinned to CPU {spark_cpus[0]} up after {info['session_seconds']:.1f} s; its Python "
            f"workers import sparkbus from {Path(where['feeder']).parent} and run on CPUs {where['affinity']}; "
            f"broker and ranks on CPU {bus_cpus[0]}")
        if Path(where["feeder"]).resolve() != (ROOT / "feeder").resolve():
            raise BenchError(f"Spark's Python workers import the feeder from {where['feeder']}, not from {ROOT}: "
                             "set PYTHONPATH to the tree being measured")
        if where["affinity"] != list(spark_cpus):
            raise BenchError(f"Spark's Python workers run on CPUs {where['affinity']}, not {list(spark_cpus)}")
        for kind in kinds:
            try:
                stored = driver.prepare(rows=sizes.cluster_rows, partitions=PARTITIONS, feed=broker.feed, kind=kind)
            except BenchError as exc:
                if kind == "fixed":
                    raise
                out["refused"][kind] = _cause(str(exc))
                log(f"  {kind}: not measured, the feeder refused it: {out['refused'][kind]}")
                continue
            out["kinds"][kind] = stored
            row_bytes = stored["payload_bytes"] / stored["rows"]
            log(f"  {kind} ({spark_data.KINDS[kind]}): {stored['rows']:,} rows, {stored['payload_bytes'] / 1e6:,.0f} "
                f"MB cached and warmed up")
            points = {size: out["points"].setdefault((kind, size), {"limit": Series(f"{kind} limit"),
                                                                    "sparkbus": Series(f"{kind} sparkbus")})
                      for size in BATCH_BYTES}
            for rep in range(sizes.cluster_reps):
                for i, size in enumerate(BATCH_BYTES if rep % 2 == 0 else BATCH_BYTES[::-1]):
                    order = ("limit", "sparkbus") if (rep + i) % 2 == 0 else ("sparkbus", "limit")
                    for way in order:
                        if way == "limit":
                            run_ = _limit(driver)
                        else:
                            run_ = _sparkbus(children, broker, driver, stored, size, row_bytes, bus, work, sizes)
                        points[size][way].runs.append(run_)
                    lim, s = points[size]["limit"].runs[-1], points[size]["sparkbus"].runs[-1]
                    log(f"  cluster-shaped {kind}, {size // KiB:,} KiB batches, rep {rep + 1}/{sizes.cluster_reps}: "
                        f"limit {lim['rows_per_s']:,.0f} rows/s, sparkbus {s['rows_per_s']:,.0f} rows/s "
                        f"({s['rows_per_s'] / lim['rows_per_s']:.2f} x); Python workers {lim['cpu']['workers']:.2f} "
                        f"vs {s['cpu']['workers']:.2f} CPU-s")
    except BaseException:
        driver.stop(polite=False)
        raise
    finally:
        children.discard(broker)
    driver.stop()
    return out


def _limit(driver: DriverProcess) -> dict:
    meter = CpuMeter(spark_root=driver.child.pid)
    limit = driver.limit()
    return {"first": None, "last": limit["seconds"], "rows": limit["rows"],
            "rows_per_s": limit["rows"] / limit["seconds"], "cpu": meter.stop()}


def _sparkbus(children: Children, broker, driver: DriverProcess, stored: dict, size: int, row_bytes: float,
              bus: list[str], work: Path, sizes: Sizes) -> dict:
    stream = f"cluster-{next(_streams)}"
    batch_size, options = batch_options(size, row_bytes)

    def start():
        fed = driver.feed(feed=broker.feed, stream=stream, batch_size=batch_size, timeout=min(sizes.timeout, 120.0),
                          options=options)
        return fed["t0"], fed["t_fed"], fed["report"]

    meter = CpuMeter([broker], spark_root=driver.child.pid)
    result = end_to_end.run_fed_ranks(children, [broker], stream, start, stored["rows"], RANKS, work, sizes.timeout,
                                      prefix=bus)
    result["cpu"] = {**meter.stop(), "ranks": result["ranks_cpu"]}
    result["batch_size"] = batch_size
    expected = str((ROOT / "worker").resolve())
    if any(str(Path(m).resolve()) != expected for m in result["rank_modules"]):
        raise BenchError(f"the ranks imported sparkbus's worker from {result['rank_modules']}, not {expected}")
    return result


def _cause(text: str) -> str:
    """The last ``SomeError: message`` line of a driver's traceback, shortened."""
    lines = [line.strip() for line in text.splitlines() if "Error:" in line or "Exception:" in line]
    return (lines[-1] if lines else text.strip().splitlines()[-1])[:300]


def ratio(point: dict) -> float:
    """sparkbus rows/s / limit rows/s, medians of the repetitions."""
    return point["sparkbus"].med("rows_per_s") / point["limit"].med("rows_per_s")


def feeder_cpu_per_gb(point: dict, payload_bytes: int) -> float:
    """CPU seconds per GB of payload in Spark's Python workers above the hand-off's (medians)."""
    def workers(series: Series) -> float:
        return median([r["cpu"]["workers"] for r in series.runs])

    return (workers(point["sparkbus"]) - workers(point["limit"])) / (payload_bytes / 1e9)


def spark_cpu_ratio(point: dict) -> float:
    """Spark's CPU-s (JVM + Python workers) in the hand-off / in the sparkbus run (medians): the wall-clock ratio
    one core would allow if nothing else ran on it."""
    def spark(series: Series) -> float:
        return median([r["cpu"]["jvm"] + r["cpu"]["workers"] for r in series.runs])

    return spark(point["limit"]) / spark(point["sparkbus"])


__all__ = ["run", "BATCH_BYTES", "KINDS", "ratio", "feeder_cpu_per_gb", "spark_cpu_ratio", "batch_options"]
