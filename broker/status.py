"""Human-readable rendering of the broker's figures for ``sparkbus status``."""

from __future__ import annotations

from typing import Any


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def render_stats(stats: dict[str, Any]) -> str:
    """Per stream and epoch: batches and bytes in and out; buffer use; ranks with their windows and counts."""
    b = stats["broker"]
    lines = [f"sparkbus broker v{b['version']} pid {b['pid']}, up {b['uptime_s']:.0f} s; "
             f"buffer {_mib(b['buffered_bytes'])} of {_mib(b['max_buffer'])}"
             f"{' (feed paused)' if b['feed_paused'] else ''}"]
    for socket, reasons in sorted(b["rejected"].items()):
        lines.append(f"  rejected on {socket}: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    for name, s in sorted(stats["streams"].items()):
        lines.append(f"stream {name!r}: {len(s['ranks'])} of {s['expected_ranks']} ranks")
        for number, e in sorted(s["epochs"].items(), key=lambda kv: int(kv[0])):
            state = "ended" if e["ended"] else "closed" if e["closed"] else "open"
            lines.append(f"  epoch {number} ({state}): partitions {e['committed']}/{e['partitions']}, "
                         f"in {e['batches_in']} batches {_mib(e['bytes_in'])} {e['rows_in']} rows, "
                         f"out {e['batches_out']} batches {_mib(e['bytes_out'])}, acked {e['acked']}, "
                         f"queued {e['queued']}, duplicates {e['duplicates']}, "
                         f"redelivered {e.get('redelivered', 0)}")
        for r in sorted(s["ranks"], key=lambda r: r["rank"]):
            lines.append(f"  rank {r['rank']}/{r['size']}: window {r['window']} / {_mib(r['window_bytes'])}, "
                         f"in flight {r['inflight']}, "
                         f"batches {r['batches']} ({_mib(r['bytes'])}), acked {r['acked']}, "
                         f"idle {r['idle_s']:.1f} s")
    return "\n".join(lines)


def totals(stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Figures added up over several brokers (by address): buffer, and per stream batches, rows and ranks."""
    total: dict[str, Any] = {"brokers": len(stats), "buffered_bytes": 0, "max_buffer": 0, "streams": {}}
    for one in stats.values():
        total["buffered_bytes"] += one["broker"]["buffered_bytes"]
        total["max_buffer"] += one["broker"]["max_buffer"]
        for name, s in one["streams"].items():
            t = total["streams"].setdefault(name, {"batches_in": 0, "rows_in": 0, "batches_out": 0, "acked": 0,
                                                   "queued": 0, "ranks": 0})
            t["ranks"] = max(t["ranks"], len(s["ranks"]))
            for e in s["epochs"].values():
                for key in ("batches_in", "rows_in", "batches_out", "acked", "queued"):
                    t[key] += e[key]
    return total


def render_totals(total: dict[str, Any]) -> str:
    lines = [f"all {total['brokers']} brokers: buffer {_mib(total['buffered_bytes'])} of {_mib(total['max_buffer'])}"]
    for name, t in sorted(total["streams"].items()):
        lines.append(f"stream {name!r}: {t['ranks']} ranks; in {t['batches_in']} batches {t['rows_in']} rows, "
                     f"out {t['batches_out']}, acked {t['acked']}, queued {t['queued']}")
    return "\n".join(lines)
