"""Human-readable rendering of the broker's figures for ``sparkbus status``."""

from __future__ import annotations

from typing import Any


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def render_stats(stats: dict[str, Any]) -> str:
    """Per stream and epoch: batches and bytes in and out; buffer use; ranks with credit and counts."""
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
                         f"queued {e['queued']}, duplicates {e['duplicates']}")
        for r in sorted(s["ranks"], key=lambda r: r["rank"]):
            lines.append(f"  rank {r['rank']}/{r['size']}: credit {r['credit']}, in flight {r['inflight']}, "
                         f"batches {r['batches']} ({_mib(r['bytes'])}), acked {r['acked']}, "
                         f"idle {r['idle_s']:.1f} s")
    return "\n".join(lines)
