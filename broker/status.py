"""The broker's figures (``broker.figures``) for ``sparkbus status``: rendered for a human, and cut into pages that
each fit a header (:func:`paginate`, :func:`merge_pages`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypedDict

import msgpack

from sparkbus.broker.figures import Figures
from sparkbus.wire.protocol import MAX_HEADER_BYTES
from sparkbus.wire.verdict import Verdict, of_pipeline, of_rank, of_stream, rank_waits

PAGE_BYTES = MAX_HEADER_BYTES - 1024     # of figures per STATS_REPLY: room for the rest of the header

# Summed over brokers per stream by totals(); "ranks" is the most any one broker has.
TOTALLED = ("batches_in", "rows_in", "batches_out", "rows_out", "acked", "queued")


class StreamTotals(TypedDict):
    verdict: dict[str, Any]      # why the stream's training waits (:func:`stream_verdict`)
    batches_in: int
    rows_in: int
    batches_out: int
    rows_out: int
    acked: int
    queued: int
    ranks: int


class Totals(TypedDict):
    brokers: int
    buffered_bytes: int
    max_buffer: int
    streams: dict[str, StreamTotals]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def render_stats(stats: Figures) -> str:
    """Per stream and epoch: batches and bytes in and out; buffer use; ranks with their windows and counts."""
    b = stats["broker"]
    lines = [f"sparkbus broker v{b['version']} pid {b['pid']}, up {b['uptime_s']:.0f} s; "
             f"buffer {_mib(b['buffered_bytes'])} of {_mib(b['max_buffer'])}"
             f"{' (feed paused)' if b['feed_paused'] else ''}"]
    if b.get("versions"):          # figures of an older broker lack these
        older = ", ".join(f"{n} connections at v{v}" for v, n in sorted(b.get("older_peers", {}).items()))
        lines.append(f"  serves protocol v{', v'.join(str(v) for v in b['versions'])}"
                     f"{f' ({older})' if older else ''}; {len(stats['streams'])} streams, "
                     f"{b.get('retired_streams', 0)} retired")
    for socket, reasons in sorted(b["rejected"].items()):
        lines.append(f"  rejected on {socket}: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    for name, s in sorted(stats["streams"].items()):
        lines.append(f"stream {name!r}: {len(s['ranks'])} of {s['expected_ranks']} ranks"
                     f"{f', idle {idle:.0f} s' if (idle := s.get('idle_s', 0)) else ''}")
        earlier = s.get("earlier") or {}
        if earlier.get("epochs"):
            lines.append(f"  {earlier['epochs']} earlier epochs: in {earlier['batches_in']} batches "
                         f"{_mib(earlier['bytes_in'])} {earlier['rows_in']} rows, out {earlier['batches_out']} "
                         f"batches, acked {earlier['acked']}, duplicates {earlier['duplicates']}, "
                         f"redelivered {earlier['redelivered']}, diverged partitions {earlier['diverged']}")
        for number, e in sorted(s["epochs"].items(), key=lambda kv: int(kv[0])):
            state = "ended" if e["ended"] else "closed" if e["closed"] else "open"
            # the broker's epoch numbers: the epoch= a feed and a rank's state name (0-based), unlike the demo's and
            # the examples' progress lines ("epoch 1/3")
            lines.append(f"  epoch {number} ({state}): partitions {e['committed']}/{e['partitions']}, "
                         f"in {e['batches_in']} batches {_mib(e['bytes_in'])} {e['rows_in']} rows, "
                         f"out {e['batches_out']} batches {_mib(e['bytes_out'])} {e.get('rows_out', 0)} rows, "
                         f"acked {e['acked']}, "
                         f"queued {e['queued']}, duplicates {e['duplicates']}, "
                         f"redelivered {e.get('redelivered', 0)}{_recovery(e)}")
        waits = {w.rank: w for w in rank_waits(s)}
        for r in sorted(s["ranks"], key=lambda r: r["rank"]):
            w = waits.get(r["rank"])
            lines.append(f"  rank {r['rank']}/{r['size']}: window {r['window']} / {_mib(r['window_bytes'])}, "
                         f"in flight {r['inflight']}, "
                         f"batches {r['batches']} ({_mib(r['bytes'])}), acked {r['acked']}, "
                         f"idle {r['idle_s']:.1f} s"
                         f"{'' if w is None else f', {of_rank(w.data_wait, w.peer_wait, w.step)}'}")
        if waits:
            lines.append(f"  why training waits: {of_pipeline(list(waits.values()))}")
    return "\n".join(lines)


def stream_verdict(figures: Mapping[str, Mapping[str, Any]], stream: str) -> Verdict:
    """Why ``stream``'s training waits, over one or more brokers' figures (by address): every rank's own figures
    through :func:`sparkbus.wire.verdict.of_stream`. The broker does not know Spark's backpressure: the feed's
    ``FeedReport.verdict`` does, and tells ``balanced`` from ``compute-bound``."""
    return of_stream([one["streams"].get(stream, {}) for one in figures.values()])


def with_verdicts(stats: Figures) -> dict[str, Any]:
    """One broker's figures with ``verdicts``: per stream, :func:`stream_verdict` as a record (``sparkbus status
    --json``)."""
    return {**stats, "verdicts": {name: _verdict_record(stream_verdict({"": stats}, name))
                                  for name in stats["streams"]}}


def _verdict_record(verdict: Verdict) -> dict[str, Any]:
    return {"kind": verdict.kind, "data_wait_share": round(verdict.data_wait_share, 4),
            "slowest_rank": verdict.slowest_rank, "window": verdict.window, "line": str(verdict)}


def _recovery(epoch: Mapping[str, Any]) -> str:
    """An epoch's recovery figures, once it has any (docs/PROTOCOL.md "Recovery"): nothing otherwise."""
    held, adopted, unassigned = (epoch.get(k, 0) for k in ("held", "adopted", "unassigned"))
    if not (held or adopted or unassigned):
        return ""
    return f"; recovery: held {held}, adopted {adopted}, unassigned {unassigned}"


def totals(stats: dict[str, Figures]) -> Totals:
    """Figures added up over several brokers (by address): buffer, and per stream batches, rows and ranks."""
    total: Totals = {"brokers": len(stats), "buffered_bytes": 0, "max_buffer": 0, "streams": {}}
    for one in stats.values():
        total["buffered_bytes"] += one["broker"]["buffered_bytes"]
        total["max_buffer"] += one["broker"]["max_buffer"]
        for name, s in one["streams"].items():
            t = total["streams"].setdefault(name, {"batches_in": 0, "rows_in": 0, "batches_out": 0, "rows_out": 0,
                                                   "acked": 0, "queued": 0, "ranks": 0,
                                                   "verdict": {}})
            t["ranks"] = max(t["ranks"], len(s["ranks"]))
            for e in [*s["epochs"].values(), *([s["earlier"]] if s.get("earlier") else [])]:
                for key in TOTALLED:
                    t[key] += _figure(e, key)      # type: ignore[literal-required]
    for name, t in total["streams"].items():
        t["verdict"] = _verdict_record(stream_verdict(stats, name))
    return total


def _figure(epoch: Mapping[str, Any], key: str) -> int:
    """One figure of an epoch; 0 for one that figures retired by an older broker lack (``rows_out``)."""
    figures: Mapping[str, Any] = epoch
    return figures.get(key, 0)


# ---- pages ---------------------------------------------------------------------------------------------------


def paginate(stats: Figures, limit: int = PAGE_BYTES) -> list[Figures]:
    """The figures as one or more pages, each ``limit`` bytes or fewer of msgpack: the figures themselves when they
    fit, else pages with ``page = [index, count]`` that :func:`merge_pages` puts back together. Each page has the
    broker's record and part of the streams; a stream too large for one page is cut between its epochs, ranks and
    lost ranks (every page's part of it a dict with some of its keys)."""
    if len(msgpack.packb(stats, use_bin_type=True)) <= limit:
        return [stats]
    room = limit - len(msgpack.packb({"broker": stats["broker"], "streams": {}, "page": [2**31, 2**31]},
                                     use_bin_type=True))
    pages: list[dict[str, Any]] = []
    used = room + 1
    for name, piece, size in _pieces(stats, room):
        streams = pages[-1] if pages else {}
        if used + size > room or name in streams:
            pages.append({})
            used = 0
        pages[-1][name] = piece
        used += size
    count = len(pages) or 1
    return [{"broker": stats["broker"], "streams": streams, "page": [i, count]}
            for i, streams in enumerate(pages or [{}])]


def _size(value: Any) -> int:
    return len(msgpack.packb(value, use_bin_type=True))


def _pieces(stats: Figures, room: int) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Per stream, its figures in parts of at most ``room`` bytes each (their size with the name's): the scalars and
    as many epochs, ranks and lost ranks as fit first, then the rest of those, in order."""
    for name, stream in stats["streams"].items():
        whole: Mapping[str, Any] = stream
        overhead = _size(name) + 8
        size = _size(whole) + overhead
        if size <= room:
            yield name, dict(whole), size
            continue
        piece: dict[str, Any] = {k: v for k, v in whole.items() if k not in ("epochs", "ranks", "orphans")}
        used = _size(piece) + overhead
        for key in ("epochs", "ranks", "orphans"):
            items = list(whole[key].items()) if key == "epochs" else list(whole[key])
            piece.setdefault(key, {} if key == "epochs" else [])
            for item in items:
                cost = _size(item) + len(key) + 2
                if used + cost > room and used > overhead:
                    yield name, piece, used
                    piece, used = {key: {} if key == "epochs" else []}, overhead + len(key) + 2
                if key == "epochs":
                    piece[key][item[0]] = item[1]
                else:
                    piece[key].append(item)
                used += cost
        yield name, piece, used


def merge_pages(pages: list[dict[str, Any]]) -> Figures:
    """The figures from the pages of one reply (:func:`paginate`), in any order; a page with no ``page`` is whole."""
    merged: dict[str, Any] = {"broker": pages[0]["broker"], "streams": {}}
    for page in sorted(pages, key=lambda p: p.get("page", [0])[0]):
        for name, piece in page["streams"].items():
            stream = merged["streams"].get(name)
            if stream is None:
                merged["streams"][name] = {**piece, **{k: type(v)(v) for k, v in piece.items()
                                                       if isinstance(v, (list, dict)) and k != "earlier"}}
                continue
            for key, value in piece.items():
                if isinstance(value, list):
                    stream.setdefault(key, []).extend(value)
                elif isinstance(value, dict) and key == "epochs":
                    stream.setdefault(key, {}).update(value)
                else:
                    stream[key] = value
    return merged       # type: ignore[return-value]


def render_totals(total: Totals) -> str:
    lines = [f"all {total['brokers']} brokers: buffer {_mib(total['buffered_bytes'])} of {_mib(total['max_buffer'])}"]
    for name, t in sorted(total["streams"].items()):
        lines.append(f"stream {name!r}: {t['ranks']} ranks; in {t['batches_in']} batches {t['rows_in']} rows, "
                     f"out {t['batches_out']} batches {t['rows_out']} rows, acked {t['acked']}, "
                     f"queued {t['queued']}")
        if t["verdict"].get("kind") not in (None, "unknown"):
            lines.append(f"  why training waits: {t['verdict']['line']}")
    return "\n".join(lines)


def watch(fetch: Callable[[], dict[str, Figures]], interval: float) -> None:
    """Redraw the figures of one or more brokers (``fetch`` returns them by address) until Ctrl-C (rich Live).

    Each rank's wait share is the part of the last interval its training loop spent waiting for data, from the
    ``wait_s`` it reports on its acknowledgements and heartbeats; ``why`` says what held it over that interval
    (:func:`why_it_waits`).
    """
    from rich.live import Live

    previous: dict[tuple[str, str, int], tuple[float, ...]] = {}
    try:
        with Live(_watch_table(fetch(), previous), refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(_watch_table(fetch(), previous))
    except KeyboardInterrupt:
        pass


def why_it_waits(data_wait: float, peer_wait: float, step: float) -> str:
    """A rank's verdict over some interval (:func:`sparkbus.wire.verdict.of_rank`, the rule of
    ``EpochStats.verdict``), from the seconds its loop waited for data, for peers, and spent on its own batches."""
    return of_rank(data_wait, peer_wait, step)


def _watch_table(stats: dict[str, Figures], previous: dict[tuple[str, str, int], tuple[float, ...]]) -> Any:
    from rich.console import Group
    from rich.table import Table

    now = time.monotonic()
    tables = []
    for address, one in stats.items():
        b = one["broker"]
        table = Table(title=f"{address}: buffer {_mib(b['buffered_bytes'])} of {_mib(b['max_buffer'])}"
                            f"{' (feed paused)' if b['feed_paused'] else ''}", title_justify="left")
        for column in ("stream", "epoch", "in", "out", "acked", "queued", "rank", "in flight", "consumed",
                       "wait share", "why"):
            table.add_column(column, justify="left" if column == "stream" else "right", no_wrap=True)
        for name, s in sorted(one["streams"].items()):
            live = [(n, e) for n, e in s["epochs"].items() if not e["ended"] or e["queued"]] or \
                list(s["epochs"].items())[-1:]
            for number, e in live:
                table.add_row(name, number, str(e["batches_in"]), str(e["batches_out"]), str(e["acked"]),
                              str(e["queued"]), "", "", "", "", "")
            for r in sorted(s["ranks"], key=lambda r: r["rank"]):
                key = (address, name, r["rank"])
                wait = float(r.get("wait_s", 0.0))
                peer, step = float(r.get("peer_wait_s", 0.0)), float(r.get("step_s", 0.0))
                before = previous.get(key)
                share, why = "-", "-"
                if before and now > before[1]:
                    share = f"{(wait - before[0]) / (now - before[1]):.0%}"
                    waited, peers, own = wait - before[0], peer - before[2], step - before[3]
                    why = why_it_waits(waited - peers, peers, own) if waited + own > 0 else "idle"
                previous[key] = (wait, now, peer, step)
                table.add_row(name, "", "", "", "", "", str(r["rank"]), str(r["inflight"]),
                              str(r.get("consumed", "-")), share, why)
        tables.append(table)
    return Group(*tables)
