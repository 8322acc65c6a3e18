"""The run's figures as text: the machine, one Markdown table per figure, the targets with PASS/MISS, a PNG plot.

The same Markdown is printed and written to ``RESULTS.md``; ``results.json`` keeps every repetition.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from broker.daemon import IO_THREADS
from common import MiB, ROOT, Sizes, median
from hop import CURVE_MODE, MODES, SIZES, curve_pairs, size_label
from spark_data import ROW_BYTES

NAN = float("nan")


# ---- the machine --------------------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    """What the figures were measured on: cores, memory, CPU, versions, the code's revision, the date, load."""
    from importlib import metadata

    import psutil

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "-"

    cpu = "-"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import zmq
        libzmq = zmq.zmq_version()
    except ImportError:
        libzmq = "-"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cpu": cpu,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "java": (_run(["java", "-version"], stderr=True).splitlines() or ["-"])[0],
        "versions": {name: version(name) for name in ("pyspark", "pyzmq", "numpy", "pyarrow", "mpi4py", "mpich",
                                                      "msgpack", "psutil", "matplotlib", "sparkbus")}
                    | {"libzmq": libzmq},
        "revision": _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]).strip() or "-",
        "modified": [line[3:] for line in _run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                                                "broker", "feeder", "worker"]).splitlines()],
        "load_start": os.getloadavg(),
    }


def _run(command: list[str], stderr: bool = False) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stderr if stderr else done.stdout


# ---- targets --------------------------------------------------------------------------------------------------

@dataclass
class Target:
    what: str
    goal: str
    measured: str
    passed: bool | None      # None: not measured in this run

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else ("PASS" if self.passed else "MISS")


def _ok(value: float, test) -> bool | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else bool(test(value))


# The targets of issue 10 (and the Parquet one from before), in the order they are printed.
HOP_RATIOS = ((64 * 1024, 0.8), (MiB, 0.95))     # batch size -> sparkbus / zmq.proxy at least
HOP_SMALL_RATE = 100_000                         # batches/s at 1 KiB, delivered to the training loop
E2E_RATIO = 0.9                                  # x the Arrow hand-off limit
PARQUET_FASTER, PARQUET_FIRST = 2.5, 0.05
WAIT_SHARE = 0.02                                # data-wait with even=True, share of the epoch
RANKS_RATIO = 1.0                                # 4 ranks vs 1 rank on one broker, same data
# Issue 15: cluster-shaped end to end (x the Arrow hand-off on the same core), per batch size; the feeder's CPU
# above the hand-off's at 1 MiB; variable-length columns vs the fixed-width path at the same bytes.
CLUSTER_RATIOS = ((MiB, 0.95), (64 * 1024, 0.9))
FEEDER_CPU_PER_GB = 0.45                         # CPU-s per GB at 1 MiB batches
VARLEN_RATIOS = {"binary": 0.9, "varints": 0.8}
PADDING_RATIO = 0.3                              # padding share with bucket_by / in Spark's order, at most
KIND_LABELS = {"fixed": "fixed-width", "tokens": "variable-length (int arrays, mean 64)"}
VARLEN_LABELS = {"binary": "binary rows of 64 KiB, end to end, vs the fixed-width path at the same bytes",
                 "varints": "variable-length int arrays averaging 64 KiB, end to end, vs the fixed-width path"}


def targets(r: dict) -> list[Target]:
    out = []
    hop = {(h.mode, h.size): h for h in r.get("hop", [])}
    for size, goal in HOP_RATIOS:
        what = f"sparkbus broker throughput at {size_label(size)} batches"
        if ("sparkbus", size) in hop:
            s, p = hop["sparkbus", size].mb_per_s, hop["zmq.proxy", size].mb_per_s
            out.append(Target(what, f">= {goal} x zmq.proxy", f"{s / p:.2f} x ({s:,.0f} vs {p:,.0f} MB/s)",
                              _ok(s / p, lambda v: v >= goal)))
        else:
            out.append(Target(what, f">= {goal} x zmq.proxy", "not run", None))
    what, goal = "sparkbus broker at 1 KiB batches, delivered to the training loop", f">= {HOP_SMALL_RATE:,} batches/s"
    if ("sparkbus", 1024) in hop:
        rate = hop["sparkbus", 1024].batches_per_s
        out.append(Target(what, goal, f"{rate:,.0f} batches/s", _ok(rate, lambda v: v >= HOP_SMALL_RATE)))
    else:
        out.append(Target(what, goal, "not run", None))
    e2e = r.get("e2e")
    what_e2e, goal_e2e = "end to end from the cached DataFrame, rows/s", f">= {E2E_RATIO} x the Arrow hand-off limit"
    what_pq = "end to end vs Parquet staging"
    goal_pq = f">= {PARQUET_FASTER} x faster to the last batch; first batch in <= {PARQUET_FIRST} x staging's time"
    if e2e:
        s, p, lim = e2e["sparkbus"], e2e["parquet"], e2e["limit"]
        ratio = s.med("rows_per_s") / lim.med("rows_per_s")
        out.append(Target(what_e2e, goal_e2e,
                          f"{ratio:.2f} x ({s.med('rows_per_s'):,.0f} vs {lim.med('rows_per_s'):,.0f} rows/s)",
                          _ok(ratio, lambda v: v >= E2E_RATIO)))
        faster = p.med("last") / s.med("last")
        first = s.med("first") / p.med("first")
        out.append(Target(what_pq, goal_pq,
                          f"{faster:.2f} x faster to the last; first batch at {first:.3f} x "
                          f"({s.med('first'):.2f} s vs {p.med('first'):.2f} s)",
                          None if math.isnan(faster) or math.isnan(first)
                          else (faster >= PARQUET_FASTER and first <= PARQUET_FIRST)))
    else:
        out += [Target(what_e2e, goal_e2e, "not run", None), Target(what_pq, goal_pq, "not run", None)]
    wait = r.get("datawait")
    what = "ranks' data-wait (even=True) while the feed outpaces compute"
    goal = f"<= {WAIT_SHARE * 100:.0f} % of the epoch"
    if wait:
        share = wait["series"].med("wait_share")
        out.append(Target(what, goal, f"{share * 100:.2f} % (worst rank)", _ok(share, lambda v: v <= WAIT_SHARE)))
    else:
        out.append(Target(what, goal, "not run", None))
    scaling = r.get("scaling") or {}
    tasks = r["sizes"].partitions
    what, goal = "4 ranks vs 1 rank on one broker, same data, rows/s", f">= {RANKS_RATIO:.1f} x"
    four, one = scaling.get((4, tasks)), scaling.get((1, tasks))
    if four is not None and one is not None and four.runs and one.runs:
        ratio = four.med("rows_per_s") / one.med("rows_per_s")
        out.append(Target(what, goal, f"{ratio:.2f} x ({four.med('rows_per_s'):,.0f} vs {one.med('rows_per_s'):,.0f} "
                          f"rows/s)", _ok(ratio, lambda v: v >= RANKS_RATIO)))
    else:
        out.append(Target(what, goal, "not run", None))
    rss = r.get("rss")
    if rss:
        peak = median([x["peak_rss"] for x in rss])
        bound = rss[0]["max_buffer"] + 100 * MiB
        through = median([x["bytes"] for x in rss])
        out.append(Target(f"broker peak RSS with {_gib(through)} through it", "<= --max-buffer + 100 MiB",
                          f"{peak / MiB:,.0f} MiB (bound {bound / MiB:,.0f} MiB)", _ok(peak, lambda v: v <= bound)))
    else:
        out.append(Target("broker peak RSS with 4 GiB through it", "<= --max-buffer + 100 MiB", "not run", None))
    out += _cluster_targets(r.get("cluster"))
    out += _varlen_targets(r.get("varlen"))
    return out


def _cluster_targets(c: dict | None) -> list[Target]:
    """Figure 2b: the ratio to the hand-off per kind and batch size, and the feeder's CPU above the hand-off's."""
    import cluster

    out = []
    for kind in cluster.KINDS:
        for size, goal in CLUSTER_RATIOS:
            what = f"cluster-shaped end to end, {KIND_LABELS[kind]}, {size_label(size)} batches"
            goal_text = f">= {goal} x the Arrow hand-off on the same core"
            point = (c or {}).get("points", {}).get((kind, size))
            if point and point["sparkbus"].runs and point["limit"].runs:
                ratio = cluster.ratio(point)
                out.append(Target(what, goal_text, f"{ratio:.2f} x ({point['sparkbus'].med('rows_per_s'):,.0f} vs "
                                  f"{point['limit'].med('rows_per_s'):,.0f} rows/s)", _ok(ratio, lambda v: v >= goal)))
            else:
                out.append(Target(what, goal_text, _not_measured(c, kind), None))
    for kind in cluster.KINDS:
        for size, _ in CLUSTER_RATIOS:
            what = (f"feeder CPU-s per GB above the Arrow hand-off (Spark's Python workers), {KIND_LABELS[kind]}, "
                    f"{size_label(size)} batches, cluster-shaped")
            goal = f"<= {FEEDER_CPU_PER_GB}" if size == MiB else "printed (no target)"
            point = (c or {}).get("points", {}).get((kind, size))
            if point and point["sparkbus"].runs and point["limit"].runs:
                per_gb = cluster.feeder_cpu_per_gb(point, c["kinds"][kind]["payload_bytes"])
                out.append(Target(what, goal, f"{per_gb:.2f} CPU-s/GB",
                                  _ok(per_gb, lambda v: v <= FEEDER_CPU_PER_GB) if size == MiB else None))
            else:
                out.append(Target(what, goal, _not_measured(c, kind), None))
    return out


def _not_measured(c: dict | None, kind: str) -> str:
    if c and kind in c.get("refused", {}):
        return f"not measured: the feeder refused it ({c['refused'][kind].split('failed: ')[-1][:100]})"
    return "not run"


def _varlen_targets(v: dict | None) -> list[Target]:
    import varlen

    out = []
    for kind, goal in VARLEN_RATIOS.items():
        pair = (v or {}).get("pairs", {}).get(kind)
        goal_text = f">= {goal} x"
        if pair and pair["compared"].runs and pair["baseline"].runs:
            ratio = varlen.ratio(pair)
            out.append(Target(VARLEN_LABELS[kind], goal_text, f"{ratio:.2f} x ({pair['compared'].med('mb_per_s'):,.0f} "
                              f"vs {pair['baseline'].med('mb_per_s'):,.0f} MB/s)", _ok(ratio, lambda x: x >= goal)))
        else:
            out.append(Target(VARLEN_LABELS[kind], goal_text, _not_measured(v, kind), None))
    what = "padding share with length bucketing (bucket_by, window 64) vs Spark's order, batches of 64"
    pad = (v or {}).get("padding")
    if pad:
        out.append(Target(what, f"<= {PADDING_RATIO} x", f"{pad['ratio']:.2f} x ({pad['bucketed']:.1%} vs "
                          f"{pad['plain']:.1%})", _ok(pad["ratio"], lambda x: x <= PADDING_RATIO)))
    else:
        out.append(Target(what, f"<= {PADDING_RATIO} x", _not_measured(v, "padding"), None))
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / MiB:,.0f} MiB"


# ---- Markdown -------------------------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _f(value: float | None, fmt: str = ",.0f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def _packing_note() -> str:
    from hop import feeder_pack_bytes

    pack = feeder_pack_bytes()
    if not pack:
        return " sparkbus sends one message per batch."
    return (f" The feeder packs consecutive batches smaller than {size_label(pack // 4)} into messages of up to "
            f"{size_label(pack)} (its default); the ranks still get them one by one, and b/s counts the batches "
            "the `BatchStream` loop received.")


def _mb(value: float | None) -> str:
    """MB/s: a decimal below 10 (a 1 KiB hop moves a few MB/s)."""
    return _f(value, ",.1f" if value is not None and value < 10 else ",.0f")


def markdown(r: dict) -> str:
    sizes: Sizes = r["sizes"]
    m = r["machine"]
    parts = [f"# sparkbus benchmark ({sizes.name} size)", ""]
    parts.append(f"Measured {m['date']} by `benchmarks/bench.py{' --quick' if sizes.name.startswith('quick') else ''}` "
                 f"in {r['seconds']:.0f} s. Each figure is the median of {sizes.reps} repetition"
                 f"{'s' if sizes.reps > 1 else ''}. Nothing here is asserted: this is a report, not a test.")
    if sizes.name.startswith("quick"):
        parts += ["", "**Quick run**: small sizes, one repetition, and Spark starting in the background during the "
                  "hop and RSS sections. It checks the harness; its figures and verdicts are indicative only."]
    parts += ["", "## Machine", "",
              _table(["", ""], [
                  ["nproc", str(m["nproc"])], ["memory", f"{m['memory_gib']} GiB"], ["CPU", m["cpu"]],
                  ["OS", m["os"]], ["Python", m["python"]], ["Java", m["java"]],
                  ["libraries", ", ".join(f"{k} {v}" for k, v in m["versions"].items())],
                  ["sparkbus revision", f"`{m['revision']}`" + (f" (uncommitted changes in {', '.join(m['modified'])})"
                                                                if m["modified"] else "")],
                  ["load average (1, 5, 15 min)", f"start {_load(m['load_start'])}; end {_load(m.get('load_end'))}"],
              ]),
              "", "The machine may be shared: a load average above its core count means other work ran "
              "alongside and the figures are low and noisy."]

    parts += ["", "## Targets", "", _table(["target", "goal", "measured", "verdict"],
                                            [[t.what, t.goal, t.measured, f"**{t.verdict}**"]
                                             for t in r["targets"]])]

    if r.get("hop"):
        parts += ["", "## 1. Broker hop (between processes, loopback TCP)", "",
                  "MB/s = 10^6 bytes of payload per second, from the sender's first send to the receiver's last "
                  "receive; b/s = batches per second. Each batch is one float32 column of the given size. "
                  "`direct`: raw pyzmq PUSH -> PULL; `zmq.proxy`: through `zmq.proxy(PULL, PUSH)` in a third "
                  "process; `sparkbus`: `python -m broker`, fed by `feeder.task.stream_partition`, consumed by "
                  "`BatchStream(comm=None)` (its defaults: prefetch 4, checksum verified)." + _packing_note(), ""]
        hop = {(h.mode, h.size): h for h in r["hop"]}
        rows = []
        for size in SIZES:
            d, p, s = (hop[mode, size] for mode in MODES)
            rows.append([size_label(size), _mb(d.mb_per_s), _f(d.batches_per_s), _mb(p.mb_per_s), _f(p.batches_per_s),
                         _mb(s.mb_per_s), _f(s.batches_per_s), _f(s.mb_per_s / p.mb_per_s, ".2f"),
                         _f(s.mb_per_s / d.mb_per_s, ".2f")])
        parts.append(_table(["batch", "direct MB/s", "direct b/s", "zmq.proxy MB/s", "zmq.proxy b/s",
                             "sparkbus MB/s", "sparkbus b/s", "sparkbus / zmq.proxy", "sparkbus / direct"], rows))
        extra = [h for h in r["hop"] if h.mode not in MODES and h.mode != CURVE_MODE]
        if extra:
            parts += ["", "Diagnostics (not targets), the sparkbus hop with one default changed: " + "; ".join(
                f"`{h.mode}` at {size_label(h.size)}: {_mb(h.mb_per_s)} MB/s, {_f(h.batches_per_s)} b/s "
                f"({_f(h.mb_per_s / hop['sparkbus', h.size].mb_per_s, '.2f')} x the default)" for h in extra)
                + ". More credits in flight show how much of the 1 KiB figure is the credit round trip; "
                "`verify=False` shows what the ranks' checksum check costs" + (
                    "; `unpacked` (the feeder's `pack_bytes=0`) what packing small batches gains." if any(
                        h.mode.endswith("unpacked") for h in extra) else ".")]
        parts += _hop_cpu_markdown(r)
        parts += _curve_markdown(r)

    if r.get("e2e"):
        e2e = r["e2e"]
        ds = r["dataset"]
        parts += ["", "## 2. End to end from Spark (cached DataFrame -> 2 ranks)", "",
                  f"{ds['rows']:,} rows of `id` long + `features` float32[64] ({ds['payload_bytes'] / 2**30:.2f} GiB "
                  f"of payload; Spark's cache holds {ds['cached_memory_bytes'] / 2**30:.2f} GiB in memory, "
                  f"{ds['cached_disk_bytes'] / 2**30:.2f} GiB on disk) in {ds['partitions']} partitions, "
                  "Spark local[2]. Times from the start of the feed / the Parquet write to the first and the last "
                  "batch at any rank (ranks started and ready beforehand). The limit is the DataFrame handed to "
                  "Python by `mapInArrow` and dropped there.", ""]
        rows = []
        for name, label in (("limit", "Arrow hand-off limit (mapInArrow, no sink)"),
                            ("sparkbus", "sparkbus (broker + feed + 2 ranks)"),
                            ("parquet", "Parquet staging (write, then 2 ranks read)")):
            s = e2e[name]
            rows.append([label, _f(s.med("first"), ".2f"), _f(s.med("last"), ".2f"), _f(s.med("rows_per_s")),
                         _f(s.med("rows_per_s") * ROW_BYTES / 1e6, ",.0f")])
        parts.append(_table(["path", "first batch (s)", "last batch (s)", "rows/s", "MB/s"], rows))
        s, p, lim = e2e["sparkbus"], e2e["parquet"], e2e["limit"]
        parts += ["", f"- sparkbus rows/s / limit rows/s = **{s.med('rows_per_s') / lim.med('rows_per_s'):.2f}**",
                  f"- Parquet time to last / sparkbus time to last = **{p.med('last') / s.med('last'):.2f}**",
                  f"- sparkbus first batch / Parquet first batch = **{s.med('first') / p.med('first'):.3f}**",
                  f"- Parquet: the write alone took {p.med('write_seconds'):.2f} s "
                  f"({_f(median([x['staged_bytes'] for x in p.runs]) / 2**20)} MiB in "
                  f"{p.runs[0]['files']} files); sparkbus: `feed()` returned after {s.med('feed_seconds'):.2f} s, "
                  f"{_f(s.med('dropped_rows'))} rows dropped to keep the ranks even"]
        parts += _cpu_markdown(lim, s, ds["payload_bytes"], r["machine"].get("nproc"))
    if r.get("cluster") and r["cluster"].get("points"):
        parts += _cluster_markdown(r)

    if r.get("scaling"):
        parts += ["", "## 3. Scaling", "",
                  "The same cached DataFrame fed by sparkbus. Feeding tasks = partitions (fewer than the "
                  "cached 4 through `coalesce`, no shuffle); Spark stays local[2], so at most 2 tasks feed at "
                  "once.", ""]
        rows = []
        for (ranks, tasks), s in sorted(r["scaling"].items()):
            rows.append([str(ranks), str(tasks), _f(s.med("rows_per_s")), _f(s.med("rows_per_s") * ROW_BYTES / 1e6),
                         _f(s.med("first"), ".2f"), _f(s.med("last"), ".2f"), _f(s.med("wait_share") * 100, ".0f")])
        parts.append(_table(["ranks", "feeding tasks", "rows/s", "MB/s", "first batch (s)", "last batch (s)",
                             "ranks idle (% of epoch)"], rows))
        parts += ["", "Ranks idle = BatchStream's `wait_seconds / seconds` (worst rank) with no compute: near "
                  "100 % means the ranks are starved and the feed sets the pace."]
    if r.get("rss"):
        rss = r["rss"]
        parts += ["", "### Broker memory", "",
                  "A fresh broker per repetition, fed 1 MiB batches by two processes on the real feeder path and "
                  "drained by one `BatchStream` (checksums verified). RSS sampled every 50 ms (psutil); VmHWM is the "
                  "kernel's high-water mark.", ""]
        parts.append(_table(["bytes through", "--max-buffer", "idle RSS", "peak RSS (sampled)", "VmHWM",
                             "bound (max-buffer + 100 MiB)", "MB/s through"],
                            [[_gib(median([x["bytes"] for x in rss])), _gib(rss[0]["max_buffer"]),
                              f"{median([x['idle_rss'] for x in rss]) / MiB:,.0f} MiB",
                              f"{median([x['peak_rss'] for x in rss]) / MiB:,.0f} MiB",
                              f"{median([x['vm_hwm'] or NAN for x in rss]) / MiB:,.0f} MiB",
                              f"{(rss[0]['max_buffer'] + 100 * MiB) / MiB:,.0f} MiB",
                              _f(median([x["bytes"] / x["seconds"] / 1e6 for x in rss]))]]))
    if r.get("datawait"):
        w = r["datawait"]
        s = w["series"]
        basis = (f"half the measured end-to-end rate ({w['from_rate']:,.0f} rows/s)" if w.get("from_rate")
                 else "a default (no end-to-end figure in this run)")
        parts += ["", "## 4. Data-wait", "",
                  f"2 ranks sleep {w['compute'] * 1e3:.1f} ms per batch of 1024 rows (consumption at {basis}); "
                  f"{w['rows']:,} rows fed by `feeder.feed` into a broker with `--max-buffer 32MiB`. The ranks start "
                  "the epoch once the feed is under way. Share = `wait_seconds / seconds` of "
                  "`BatchStream.stats.epochs[-1]`, worst rank.", ""]
        rows = []
        for label, series in (("even=True (the figure)", s), ("even=False (diagnostic)", w.get("diagnostic"))):
            if series is None or not series.runs:
                continue
            empty = series.med("queue_empty_share")
            rows.append([label, _f(median([max(x["batches"]) for x in series.runs])), _f(series.med("seconds"), ".2f"),
                         _f(series.med("wait_seconds"), ".3f"), _f(series.med("wait_share") * 100, ".2f") + " %",
                         _f(series.med("wait_first"), ".3f"), _f(series.med("wait_steady"), ".3f"),
                         _f(series.med("wait_end"), ".3f"), _f(series.med("wait_steady_max") * 1e3, ".1f"),
                         _f(series.med("waits_over_1ms")), "-" if math.isnan(empty) else f"{empty * 100:.0f} %",
                         _f(series.med("queue_median"))])
        parts += [_table(["ranks", "batches / rank", "epoch (s)", "waited (s)", "share of the epoch",
                          "in next(): first (s)", "in next(): between (s)", "in next(): last (s)",
                          "longest next() between (ms)", "next() > 1 ms", "broker queue empty",
                          "broker queue (median batches)"], rows),
                  "", "`waited` and `share` are BatchStream's own figures (time waiting for a batch from the broker "
                  "and, with `even=True`, for the ranks to agree on each step). The `in next()` columns are the "
                  "worst rank's loop timing its own calls for the next batch, which also include decoding and "
                  "checking each batch's checksum: the first call, the ones in between, and the last one (which "
                  "returns when the epoch ends: `EPOCH_END` and, with `even=True`, the ranks evening out). `broker "
                  "queue`: batches waiting in the broker for the ranks, sampled every 100 ms while the feed ran; "
                  "never empty means the feed kept ahead (`-`: the feed was done before the ranks started). "
                  "`even=False`: the same run with each rank consuming on its own, without the per-step agreement "
                  "over MPI."]
    if r.get("brokers"):
        parts += _brokers_markdown(r)
    if r.get("spark") and r["spark"].get("points"):
        parts += _spark_markdown(r)
    if r.get("varlen") and (r["varlen"].get("pairs") or r["varlen"].get("refused")):
        parts += _varlen_markdown(r)
    if r.get("notes"):
        parts += ["", "## Notes", ""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(parts) + "\n"


def _cpu_markdown(limit, sparkbus, payload_bytes: int, cores: int | None) -> list[str]:
    """Where the CPU of the end-to-end runs went: the limit's and sparkbus's, per process group (medians)."""
    if not all(run.get("cpu") for run in (*limit.runs, *sparkbus.runs)):
        return []
    groups = [("jvm", "Spark JVM"), ("workers", "Spark's Python workers (the feeder)"), ("broker", "broker"),
              ("ranks", "ranks")]

    def cpu(series, group):
        return median([run["cpu"].get(group, 0.0) for run in series.runs])

    rows = []
    for series, label in ((limit, "Arrow hand-off limit"), (sparkbus, "sparkbus")):
        total = sum(cpu(series, g) for g, _ in groups)
        rows.append([label, *[_f(cpu(series, g), ".2f") for g, _ in groups], _f(total, ".2f"),
                     _f(series.med("last"), ".2f"), _f(total / series.med("last"), ".2f")])
    gb = payload_bytes / 1e9
    extra = sum(cpu(sparkbus, g) - cpu(limit, g) for g, _ in groups)
    limit_total = sum(cpu(limit, g) for g, _ in groups)
    out = ["", "CPU seconds per run (medians; user + system of each process group, psutil), and the cores they "
           "kept busy on average:", "",
           _table(["run", *[label for _, label in groups], "all", "wall (s)", "cores busy"], rows), "",
           f"sparkbus adds {extra:.2f} CPU-s to the limit's {limit_total:.2f} ({extra / gb:.2f} CPU-s per GB of "
           f"payload)."]
    feeder = (cpu(sparkbus, "workers") - cpu(limit, "workers")) / gb
    out += ["", f"The feeder's CPU in Spark's Python workers above what the hand-off costs them: **{feeder:.2f} CPU-s "
            f"per GB** ({cpu(sparkbus, 'workers'):.2f} - {cpu(limit, 'workers'):.2f} CPU-s for {gb:.2f} GB, batches "
            "of 1,024 rows = 264 KiB; section 2b gives it at 1 MiB and 64 KiB)."]
    if cores:
        best = (limit_total + extra) / cores
        out[-3] += (f" With {cores} cores shared by every process, the limit's work plus that cannot take less than "
                    f"{best:.2f} s of wall time, {limit.med('last') / best:.2f} x the limit's rate at best; 0.9 x "
                    f"would need sparkbus to add at most {(limit.med('last') / 0.9 * cores - limit_total) / gb:.2f} "
                    f"CPU-s per GB here.")
    return out


def _cluster_markdown(r: dict) -> list[str]:
    """Figure 2b: Spark pinned to one core, the broker and the ranks to the other."""
    import cluster
    import spark_data

    c = r["cluster"]
    where = c.get("where", {})
    parts = ["", "## 2b. End to end, cluster-shaped (Spark on one core, the broker and the ranks on the other)", "",
             f"A Spark driver process of its own (`local[1]`) pinned to CPU {c['cpus']['spark'][0]} before its session "
             "started (`os.sched_setaffinity`): its JVM and Spark's Python workers, where the feeder runs, inherit "
             f"it (checked from inside a task: CPUs {where.get('affinity')}, sparkbus imported from "
             f"`{Path(where.get('feeder', '?')).parent}`). The broker and `mpiexec -n 2` ranks run under `taskset -c "
             f"{c['cpus']['bus'][0]}`. So only the feeder's work competes with Spark, as on a cluster where the "
             f"broker and the ranks have hosts of their own. {c['rows']:,} rows per kind, {cluster.PARTITIONS} "
             "partitions, cached in that driver; batches of about 1 MiB and 64 KiB of payload (`batch_size` = size "
             "/ mean row bytes, `max_batch_bytes` = size). Each repetition runs the Arrow hand-off (`mapInArrow` + "
             "drop, on the same core) and the sparkbus epoch, in alternating order; figures are medians of "
             f"{c.get('reps', '?')} repetitions.", ""]
    rows = []
    for (kind, size), point in c["points"].items():
        if not (point["limit"].runs and point["sparkbus"].runs):
            continue
        lim, s = point["limit"], point["sparkbus"]

        def cpu(series, group):
            return median([run["cpu"].get(group, 0.0) for run in series.runs])

        rows.append([kind, size_label(size), _f(median([x["batch_size"] for x in s.runs])), _f(lim.med("rows_per_s")),
                     _f(s.med("rows_per_s")), f"**{cluster.ratio(point):.2f}**", _f(s.med("first"), ".2f"),
                     f"{cpu(lim, 'jvm'):.2f} / {cpu(lim, 'workers'):.2f}",
                     f"{cpu(s, 'jvm'):.2f} / {cpu(s, 'workers'):.2f} / {cpu(s, 'broker'):.2f} / {cpu(s, 'ranks'):.2f}",
                     f"**{cluster.feeder_cpu_per_gb(point, c['kinds'][kind]['payload_bytes']):.2f}**",
                     _f(cluster.spark_cpu_ratio(point), ".2f")])
    parts.append(_table(["kind", "batch", "rows a batch", "hand-off rows/s", "sparkbus rows/s", "sparkbus / hand-off",
                         "first batch (s)", "hand-off CPU-s: JVM / Python workers",
                         "sparkbus CPU-s: JVM / Python workers / broker / ranks",
                         "feeder CPU-s per GB above the hand-off", "Spark's CPU-s: hand-off / sparkbus"], rows))
    kinds = "; ".join(f"`{k}`: {spark_data.KINDS[k]}, {info['payload_bytes'] / 1e6:,.0f} MB" for k, info in
                      c["kinds"].items())
    parts += ["", f"Kinds: {kinds}. Feeder CPU-s per GB = (Python workers' CPU-s in the sparkbus run - in the "
              "hand-off run) / GB of payload (medians): what the feeder adds on Spark's cores. The last column, Spark's CPU "
              "seconds (JVM + Python workers) of the hand-off / of the sparkbus run, is the ratio the one core would "
              "allow if it were Spark's alone: a check on the wall-clock ratio, which other work on the machine "
              "(a load average above 2 here) lowers for sparkbus more than for the hand-off, since sparkbus needs "
              "the second core too."]
    for kind, why in c.get("refused", {}).items():
        parts += ["", f"`{kind}` ({spark_data.KINDS[kind]}) was not measured: the feeder refused it: {why}"]
    return parts


def _varlen_markdown(r: dict) -> list[str]:
    """Figure 7: binary and variable-length int columns vs the fixed-width path at the same bytes."""
    import spark_data
    import varlen

    v = r["varlen"]
    parts = ["", "## 7. Variable-length columns", "",
             f"{v['rows']:,} rows of `id` long plus one column of 64 KiB a row, cached in the benchmark's Spark "
             f"local[2] session, fed by `feeder.feed` (batch_size {varlen.BATCH_SIZE}, max_batch_bytes 1 MiB) "
             "through one broker to 2 ranks that add up each column's bytes (numpy `nbytes`; a `RaggedColumn`'s "
             "values and offsets) without per-row Python. MB/s = payload (id and values, not offsets) / time from "
             "the call of `feed` to the last batch at any rank. Each compared kind runs interleaved with "
             f"`{varlen.BASELINE}` (the fixed-width path), alternating which goes first.", ""]
    rows = []
    for kind, pair in v["pairs"].items():
        if not (pair["compared"].runs and pair["baseline"].runs):
            continue
        b, c = pair["baseline"], pair["compared"]
        rows.append([f"`{kind}`: {spark_data.KINDS[kind]}", _f(c.med("mb_per_s")), _f(c.med("rows_per_s")),
                     _f(c.med("first"), ".2f"), _f(b.med("mb_per_s")), f"**{varlen.ratio(pair):.2f}**",
                     f"{_f(c.med('limit_mb_per_s'))} / {_f(b.med('limit_mb_per_s'))}",
                     f"{_f(c.med('mb_per_s') / c.med('limit_mb_per_s'), '.2f')} / "
                     f"{_f(b.med('mb_per_s') / b.med('limit_mb_per_s'), '.2f')}"])
    parts.append(_table(["kind", "MB/s", "rows/s", "first batch (s)",
                         f"`{varlen.BASELINE}` ({spark_data.KINDS[varlen.BASELINE]}) MB/s, same runs", "ratio",
                         f"Spark's hand-off MB/s: kind / `{varlen.BASELINE}`",
                         f"sparkbus / hand-off: kind / `{varlen.BASELINE}`"], rows))
    parts += ["", "The hand-off columns (Spark's `mapInArrow` + drop of the same frame, right after each feed) are "
              "context, not targets: Spark turns `array<int>` rows into Arrow element by element and binary rows "
              "with one copy each, so the kinds differ before sparkbus starts."]
    pad = v.get("padding")
    if pad:
        parts += ["", f"Padding share (`benchmarks/padding.py`'s `measure`): {pad['rows']:,} `tokens` rows "
                  f"({spark_data.KINDS['tokens']}) in batches of {pad['batch_size']}, each padded to its longest row: "
                  f"**{pad['plain']:.1%}** of the slots are padding in Spark's order ({pad['batches'][0]} batches), "
                  f"**{pad['bucketed']:.1%}** with `bucket_by=\"tokens\", bucket_window={pad['bucket_window']}` "
                  f"({pad['batches'][1]} batches): **{pad['ratio']:.2f} x**."]
    for kind, why in v.get("refused", {}).items():
        parts += ["", f"`{kind}` ({spark_data.KINDS.get(kind, 'the padding share')}) was not measured: the feeder "
                  f"refused it: {why}"]
    return parts


def _hop_cpu_markdown(r: dict) -> list[str]:
    """CPU seconds per GB of payload in each process of the three hops (medians), where they were measured."""
    by = {(h.mode, h.size): h for h in r["hop"]}
    roles = ("sender", "middle", "receiver")
    rows = []
    for size in sorted({h.size for h in r["hop"]}):
        cells = []
        for mode in ("direct", "zmq.proxy", "sparkbus"):
            h = by.get((mode, size))
            per_gb = [h.cpu_per_gb(role) for role in roles] if h and h.runs else [None] * 3
            if None in per_gb:
                break
            cells.append("/".join(_f(x, ".2f") for x in per_gb) if mode != "direct"
                         else f"{_f(per_gb[0], '.2f')}/-/{_f(per_gb[2], '.2f')}")
            cells.append(_f(sum(per_gb), ".2f"))
        else:
            rows.append([size_label(size), *cells])
    if not rows:
        return []
    return ["", "CPU seconds per GB of payload in each process of a hop (medians, user + system of all its threads, "
            "psutil): sender / middle / receiver, then their sum. The sender is raw pyzmq for `direct` and "
            "`zmq.proxy` and `feeder.task.stream_partition` (encoding, checksum) for sparkbus; the middle is the "
            f"proxy process or the broker (both with {IO_THREADS} ZeroMQ I/O threads); the receiver is raw pyzmq "
            "or a `BatchStream` (checksum, acknowledgements). On a machine whose cores all three share, the hop "
            "with the larger sum is the slower one.", "",
            _table(["batch", "direct CPU-s/GB", "sum", "zmq.proxy CPU-s/GB", "sum", "sparkbus CPU-s/GB", "sum"],
                   rows)]


def _curve_markdown(r: dict) -> list[str]:
    """The CURVE rows of section 1: the sparkbus hop with and without ``--auth``. A cost, not a target."""
    pairs = curve_pairs(r["hop"])
    if not pairs:
        return []
    rows = [[size_label(plain.size), _mb(plain.mb_per_s), _f(plain.batches_per_s), _mb(curve.mb_per_s),
             _f(curve.batches_per_s), _f(curve.mb_per_s / plain.mb_per_s, ".2f")] for plain, curve in pairs]
    return ["", "### What CURVE costs (`--auth`)", "",
            "The sparkbus hop through a second broker started with `--auth DIR` (otherwise the same flags), with "
            "keys made for this run (`broker.auth.create_keypair`: the broker's pair, a feeder's key in "
            "`DIR/feeders`, a rank's in `DIR/ranks`), every client passing `key=` and `broker_key=`: each batch is "
            "encrypted by the feeder, decrypted and encrypted again by the broker, and decrypted by the rank. Each "
            "repetition runs right after the plain sparkbus hop of the same size (the `sparkbus` column above), "
            "which is the plain figure here.", "",
            _table(["batch", "plain MB/s", "plain b/s", "CURVE MB/s", "CURVE b/s", "CURVE / plain"], rows),
            "", "Diagnostic (a cost, not a target): CURVE ran at " + curve_summary(r) + "."]


def curve_summary(r: dict) -> str:
    """``0.45 x the plain rate at 64 KiB, 0.31 x at 1 MiB`` (empty if the CURVE rows were not measured)."""
    pairs = curve_pairs(r.get("hop") or [])
    return ", ".join(f"{curve.mb_per_s / plain.mb_per_s:.2f} x{' the plain rate' if i == 0 else ''} at "
                     f"{size_label(plain.size)} ({_mb(curve.mb_per_s)} vs {_mb(plain.mb_per_s)} MB/s)"
                     for i, (plain, curve) in enumerate(pairs))


def _brokers_markdown(r: dict) -> list[str]:
    b = r["brokers"]
    series = b["series"]
    one = series[1].med("rows_per_s") if 1 in series else NAN
    cores = b["cores"]
    parts = ["", "## 5. Several brokers for one stream", "",
             f"The cached DataFrame of section 2 ({r['dataset']['rows']:,} rows, {b['partitions']} partitions, "
             f"Spark local[2]) fed by `feeder.feed(df, [feed_1, ..., feed_n])`, which spreads its partitions over the "
             f"brokers, to {b['ranks']} ranks that each consume from every broker "
             "(`BatchStream(\"ranks_1,...,ranks_n\")`). rows/s = all rows / time from the call of `feed` to the "
             "last batch at any rank: the aggregate delivered to the ranks.", ""]
    rows = []
    for n, s in sorted(series.items()):
        shares = s.runs[-1].get("brokers") if s.runs else None
        rows.append([str(n), "/".join(map(str, shares)) if shares else "-", _f(s.med("rows_per_s")),
                     _f(s.med("rows_per_s") * ROW_BYTES / 1e6), _f(s.med("first"), ".2f"), _f(s.med("last"), ".2f"),
                     _f(s.med("wait_share") * 100, ".0f"), _f(s.med("rows_per_s") / one, ".2f"), str(cores)])
    parts.append(_table(["brokers", "partitions per broker", "rows/s", "MB/s", "first batch (s)", "last batch (s)",
                         "ranks idle (% of epoch)", "vs 1 broker", "cores on this machine"], rows))
    ratios = ", ".join(f"{n} brokers {s.med('rows_per_s') / one:.2f} x" for n, s in sorted(series.items()) if n > 1)
    parts += ["", f"**What this shows on {cores} cores** (here: {ratios} the rows/s of 1 broker): the brokers, "
              f"Spark's JVM and its Python workers, and the ranks all share the same {cores} cores, so a second or "
              "fourth broker brings no CPU of its own and this is not a scaling figure. It shows what spreading one "
              "stream over several broker processes costs or saves on one machine: each broker is one Python "
              "thread, so several overlap their per-batch work and their waits for credits (a gain where one "
              "broker's loop, not the CPU, sets the pace), and they add processes, sockets and context switches (a "
              "loss where the cores are saturated). On a machine shared with other work, more processes also take a "
              "larger share of its CPU, which flatters the figure. Brokers scale out when each has cores and a "
              "network link of its own, on other hosts."]
    return parts


def _spark_markdown(r: dict) -> list[str]:
    import spark_configs

    sp = r["spark"]
    points = sp["points"]
    best = spark_configs.best_points(sp)
    nproc = r["machine"]["nproc"]
    parts = ["", "## 6. Spark configurations as data suppliers", "",
             f"The same data ({sp['rows']:,} rows of `id` long + `features` float32[64], cached in the executors) fed "
             "by `feeder.feed` through one broker to 2 ranks, with Spark set up in different ways: the benchmark's "
             "own `local[2]` session, and a standalone cluster from the pyspark wheel (a Master and two Workers on "
             "127.0.0.1 and 127.0.0.2, 2 cores each) used by a driver process of its own per set-up. Partitions = "
             "feeding tasks per epoch. rows/s = all rows / time from the call of `feed` to the last batch at any "
             "rank; first batch = time from the call of `feed` to the first batch at any rank (warm executors: a "
             "scan and a small feed ran first). Spark alone = the same cached data handed to Python by "
             "`mapInArrow` and dropped, in the same set-up: what that set-up can supply at most. Session start = "
             "from the driver's start to its executors being up" + (
                 " (for local[2], the session's start, which overlaps the hop section in a quick run)."
                 if r["sizes"].name.startswith("quick") else " (for local[2], the in-process session's start)."), ""]
    rows = []
    for (key, parts_n), s in sorted(points.items(), key=lambda kv: (list(sp["configs"]).index(kv[0][0]), kv[0][1])):
        if not s.runs:
            continue
        config = sp["configs"][key]
        executors = config.get("executors") or []
        where = ", ".join(f"{e['host']} ({e['slots']})" for e in executors) if executors else "driver JVM (2)"
        marks = []
        if best.get("rows_per_s") == (key, parts_n):
            marks.append("most rows/s")
        if best.get("first") == (key, parts_n):
            marks.append("earliest first batch")
        rows.append([config["label"], where, str(parts_n), _f(s.med("rows_per_s")), _f(s.med("first"), ".2f"),
                     _f(s.med("last"), ".2f"), _f(s.med("limit_rows_per_s")),
                     _f(s.med("rows_per_s") / s.med("limit_rows_per_s"), ".2f"),
                     _f(config.get("session_seconds"), ".1f"), "**" + ", ".join(marks) + "**" if marks else ""])
    parts.append(_table(["Spark set-up", "executors on (task slots)", "partitions", "rows/s to the ranks",
                         "first batch (s)", "last batch (s)", "Spark alone rows/s", "to the ranks / Spark alone",
                         "session start (s)", "best"], rows))
    if best:
        parts += ["", f"- most rows/s to the ranks: **{spark_configs.point_name(sp, best['rows_per_s'])}**",
                  f"- earliest first batch: **{spark_configs.point_name(sp, best['first'])}**"]
    parts += ["", f"On this machine ({nproc} cores) every set-up shares the same {nproc} cores with the broker and "
              "the ranks: more executors or more cores per executor add processes and threads, not CPU, and "
              "standalone executors add a JVM each. On a cluster, where executors have cores of their own, the "
              "same table tells which set-up keeps the ranks fed for the least hardware."]
    return parts


def _load(load: Any) -> str:
    return "-" if not load else ", ".join(f"{x:.2f}" for x in load)


def console_targets(r: dict) -> str:
    """The targets as plain aligned text for the terminal."""
    ts = r["targets"]
    w1 = max(len(t.what) for t in ts)
    w2 = max(len(t.goal) for t in ts)
    lines = [f"{'target'.ljust(w1)}  {'goal'.ljust(w2)}  verdict  measured"]
    lines += [f"{t.what.ljust(w1)}  {t.goal.ljust(w2)}  {t.verdict.ljust(7)}  {t.measured}" for t in ts]
    if curve_summary(r):
        lines += ["", f"CURVE (--auth) vs plain sparkbus hop (a cost, not a target): {curve_summary(r)}"]
    return "\n".join(lines)


# ---- JSON and the plot ---------------------------------------------------------------------------------------

def to_json(r: dict) -> dict:
    out = {"sizes": r["sizes"].__dict__, "machine": r["machine"], "seconds": r["seconds"],
           "targets": [t.__dict__ | {"verdict": t.verdict} for t in r["targets"]]}
    if r.get("hop"):
        out["hop"] = [{"mode": h.mode, "size": h.size, "mb_per_s": h.mb_per_s, "batches_per_s": h.batches_per_s,
                       "runs": h.runs} for h in r["hop"]]
        out["curve"] = [{"size": plain.size, "plain_mb_per_s": plain.mb_per_s, "curve_mb_per_s": curve.mb_per_s,
                         "plain_batches_per_s": plain.batches_per_s, "curve_batches_per_s": curve.batches_per_s,
                         "ratio": curve.mb_per_s / plain.mb_per_s} for plain, curve in curve_pairs(r["hop"])]
    if r.get("e2e"):
        out["dataset"] = r["dataset"]
        out["e2e"] = {k: s.runs for k, s in r["e2e"].items()}
    if r.get("scaling"):
        out["scaling"] = [{"ranks": k[0], "tasks": k[1], "runs": s.runs} for k, s in sorted(r["scaling"].items())]
    if r.get("rss"):
        out["rss"] = r["rss"]
    if r.get("brokers"):
        b = r["brokers"]
        out["brokers"] = {"cores": b["cores"], "ranks": b["ranks"], "partitions": b["partitions"],
                          "runs": {str(n): s.runs for n, s in sorted(b["series"].items())}}
    if r.get("spark"):
        sp = r["spark"]
        out["spark"] = {"rows": sp.get("rows"), "configs": sp.get("configs"),
                        "points": [{"config": k[0], "partitions": k[1], "runs": s.runs,
                                    "storage": sp.get("storage", {}).get(k)} for k, s in sp.get("points", {}).items()]}
    if r.get("cluster"):
        c = r["cluster"]
        out["cluster"] = {"rows": c.get("rows"), "cpus": c.get("cpus"), "where": c.get("where"),
                          "kinds": c.get("kinds"), "refused": c.get("refused"),
                          "points": [{"kind": k[0], "batch_bytes": k[1], "limit": p["limit"].runs,
                                      "sparkbus": p["sparkbus"].runs} for k, p in c.get("points", {}).items()]}
    if r.get("varlen"):
        v = r["varlen"]
        out["varlen"] = {"rows": v.get("rows"), "kinds": v.get("kinds"), "refused": v.get("refused"),
                         "padding": v.get("padding"),
                         "pairs": {k: {"baseline": p["baseline"].runs, "compared": p["compared"].runs}
                                   for k, p in v.get("pairs", {}).items()}}
    if r.get("datawait"):
        w = r["datawait"]
        out["datawait"] = {"compute": w["compute"], "rows": w["rows"], "runs": w["series"].runs,
                           "diagnostic_even_false": w["diagnostic"].runs if w.get("diagnostic") else []}
    return out


def plot(r: dict, path: Path) -> None:
    """``throughput.png``: MB/s per batch size for the three hops; end-to-end, scaling, brokers and Spark set-ups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("hop", "e2e", "scaling", "brokers") if r.get(k)]
    if r.get("spark") and any(s.runs for s in r["spark"].get("points", {}).values()):
        panels.append("spark")
    if r.get("cluster") and any(p["sparkbus"].runs for p in r["cluster"].get("points", {}).values()):
        panels.append("cluster")
    if r.get("varlen") and any(p["compared"].runs for p in r["varlen"].get("pairs", {}).values()):
        panels.append("varlen")
    columns = min(3, max(1, len(panels)))
    lines = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(lines, columns, figsize=(5.2 * columns, 4.2 * lines), squeeze=False)
    axes = [ax for line in axes for ax in line]
    if not panels:
        axes[0].text(0.5, 0.5, "nothing measured", ha="center")
    for ax in axes[len(panels):]:
        if panels:
            ax.set_visible(False)
    for ax, panel in zip(axes, panels):
        {"hop": _plot_hop, "e2e": _plot_e2e, "scaling": _plot_scaling, "brokers": _plot_brokers,
         "spark": _plot_spark, "cluster": _plot_cluster, "varlen": _plot_varlen}[panel](ax, r)
    fig.suptitle(f"sparkbus benchmark ({r['sizes'].name}), {r['machine']['nproc']} cores, {r['machine']['date']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hop(ax, r: dict) -> None:
    hop = {(h.mode, h.size): h for h in r["hop"]}
    for mode, style in zip(MODES, ("o-", "s--", "^-")):
        ax.plot([s / 1024 for s in SIZES], [hop[mode, s].mb_per_s for s in SIZES], style, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([s / 1024 for s in SIZES], [size_label(s).replace(" ", "\n") for s in SIZES])
    ax.set_xlabel("batch size")
    ax.set_ylabel("MB/s (payload)")
    ax.set_title("Broker hop between processes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _plot_e2e(ax, r: dict) -> None:
    e2e = r["e2e"]
    names = ["limit", "sparkbus", "parquet"]
    labels = ["Arrow limit\n(mapInArrow)", "sparkbus\n(2 ranks)", "Parquet staging\n(2 ranks)"]
    values = [e2e[n].med("rows_per_s") / 1e3 for n in names]
    bars = ax.bar(labels, values, color=["#999999", "#1f77b4", "#ff7f0e"])
    for bar, n in zip(bars, names):
        s = e2e[n]
        text = f"last {s.med('last'):.1f} s"
        if n != "limit":
            text = f"first {s.med('first'):.2f} s\n" + text
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_ylabel("thousand rows/s")
    ax.set_title(f"End to end, {r['dataset']['rows']:,} rows")
    ax.margins(y=0.25)


def _plot_scaling(ax, r: dict) -> None:
    items = sorted(r["scaling"].items())
    ax.bar([f"{k[0]}r/{k[1]}t" for k, _ in items], [s.med("rows_per_s") / 1e3 for _, s in items], color="#1f77b4")
    ax.set_ylabel("thousand rows/s")
    ax.set_xlabel("ranks / feeding tasks")
    ax.set_title("sparkbus scaling (local[2])")


def _plot_brokers(ax, r: dict) -> None:
    b = r["brokers"]
    items = sorted(b["series"].items())
    ax.bar([str(n) for n, _ in items], [s.med("rows_per_s") / 1e3 for _, s in items], color="#2ca02c")
    ax.set_xlabel("brokers serving the stream")
    ax.set_ylabel("thousand rows/s to the ranks")
    ax.set_title(f"Several brokers, {b['ranks']} ranks, on {b['cores']} cores")


def _plot_spark(ax, r: dict) -> None:
    sp = r["spark"]
    keys = [k for k in sp["configs"] if any(p[0] == k and s.runs for p, s in sp["points"].items())]
    width = 0.8 / max(1, len(sp["partitions"]))
    for i, parts in enumerate(sp["partitions"]):
        values = [sp["points"][k, parts].med("rows_per_s") / 1e3 if (k, parts) in sp["points"] else 0 for k in keys]
        ax.bar([j + i * width for j in range(len(keys))], values, width, label=f"{parts} partitions")
    ax.set_xticks([j + width * (len(sp["partitions"]) - 1) / 2 for j in range(len(keys))],
                  [sp["configs"][k]["label"].replace("standalone, ", "standalone\n") for k in keys], fontsize=7)
    ax.set_ylabel("thousand rows/s to the ranks")
    ax.set_title(f"Spark set-ups, {sp['rows']:,} rows")
    ax.legend(fontsize=8)


def _plot_cluster(ax, r: dict) -> None:
    import cluster

    points = [(k, p) for k, p in r["cluster"]["points"].items() if p["sparkbus"].runs and p["limit"].runs]
    x = range(len(points))
    ax.bar([i - 0.2 for i in x], [p["limit"].med("rows_per_s") / 1e3 for _, p in points], 0.4, color="#999999",
           label="Arrow hand-off")
    bars = ax.bar([i + 0.2 for i in x], [p["sparkbus"].med("rows_per_s") / 1e3 for _, p in points], 0.4,
                  color="#1f77b4", label="sparkbus")
    for bar, (_, p) in zip(bars, points):
        ax.annotate(f"{cluster.ratio(p):.2f} x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{k}\n{size_label(size)}" for (k, size), _ in points], fontsize=8)
    ax.set_ylabel("thousand rows/s")
    ax.set_title("Cluster-shaped: Spark on 1 core, bus on the other", fontsize=9)
    ax.legend(fontsize=8)
    ax.margins(y=0.2)


def _plot_varlen(ax, r: dict) -> None:
    import varlen

    pairs = [(k, p) for k, p in r["varlen"]["pairs"].items() if p["compared"].runs and p["baseline"].runs]
    labels, values, colors = [], [], []
    for kind, pair in pairs:
        labels += [f"{varlen.BASELINE}\n(vs {kind})", kind]
        values += [pair["baseline"].med("mb_per_s"), pair["compared"].med("mb_per_s")]
        colors += ["#999999", "#2ca02c"]
    bars = ax.bar(labels, values, color=colors)
    for i, (_, pair) in enumerate(pairs):
        bar = bars[2 * i + 1]
        ax.annotate(f"{varlen.ratio(pair):.2f} x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("MB/s of payload to the ranks")
    ax.set_title("64 KiB rows: variable-length vs fixed width", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.2)


def write(r: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    md = out / "RESULTS.md"
    png = out / "throughput.png"
    md.write_text(markdown(r))
    plot(r, png)
    (out / "results.json").write_text(json.dumps(to_json(r), indent=1, default=str))
    return md, png


__all__ = ["machine", "targets", "markdown", "console_targets", "plot", "write"]
