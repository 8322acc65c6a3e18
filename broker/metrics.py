"""Prometheus metrics (``--metrics-port``): the broker's last published figures, served over HTTP from a thread.

The broker loop calls :meth:`MetricsExporter.publish` with :meth:`Broker.stats` once per heartbeat: one reference
swap, no work per message. A scrape renders that snapshot (:class:`StatsCollector`) in the HTTP server's thread,
so the loop never waits for a scraper and a scraper never sees a half-updated figure.

Names follow Prometheus conventions: counters end in ``_total``, sizes in ``_bytes``, times in ``_seconds``.
Labels: ``stream``, ``epoch`` (a stream's epoch number), ``rank``, ``socket`` and ``reason``. The full list with
what each means is in docs/OPERATIONS.md ("Monitoring").
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("sparkbus.metrics")

# (stats field of an epoch, metric name, kind, help). Counters drop their "_total" here: the family adds it.
EPOCH_METRICS: list[tuple[str, str, str, str]] = [
    ("batches_in", "sparkbus_batches_in", "counter", "Batches taken from the feed socket (first copies)."),
    ("rows_in", "sparkbus_rows_in", "counter", "Rows in the batches taken from the feed socket."),
    ("bytes_in", "sparkbus_bytes_in", "counter", "Payload bytes taken from the feed socket."),
    ("batches_out", "sparkbus_batches_out", "counter", "Batches handed to ranks (a requeued batch counts once)."),
    ("rows_out", "sparkbus_rows_out", "counter", "Rows in the batches handed to ranks."),
    ("bytes_out", "sparkbus_bytes_out", "counter", "Payload bytes handed to ranks (a requeued batch counts once)."),
    ("acked", "sparkbus_batches_acked", "counter", "Batches the ranks acknowledged."),
    ("duplicates", "sparkbus_duplicate_batches", "counter",
     "Copies of batches already held, dropped (Spark task retries and speculative copies)."),
    ("redelivered", "sparkbus_redelivered_batches", "counter",
     "Sends of a batch that had gone out before (its rank died or left)."),
    ("queued", "sparkbus_batches_queued", "gauge", "Batches waiting in the broker for a rank."),
    ("partitions", "sparkbus_partitions", "gauge", "Partitions of the epoch."),
    ("committed", "sparkbus_partitions_committed", "gauge", "Partitions whose Spark task committed."),
    ("diverged", "sparkbus_diverged_partitions", "gauge",
     "Partitions whose attempts sent different data (Spark recomputed them differently)."),
    ("closed", "sparkbus_epoch_closed", "gauge", "1 once the driver closed the epoch (every partition in)."),
    ("ended", "sparkbus_epoch_ended", "gauge", "1 once the ranks were told the epoch ended."),
]

# (stats field of a rank, metric name, kind, help, how entries with the same stream and rank number combine)
RANK_METRICS: list[tuple[str, str, str, str, Callable[[list[float]], float]]] = [
    ("batches", "sparkbus_rank_batches_sent", "counter", "Batches sent to the rank's connection.", sum),
    ("bytes", "sparkbus_rank_bytes_sent", "counter", "Payload bytes sent to the rank's connection.", sum),
    ("acked", "sparkbus_rank_batches_acked", "counter", "Batches the rank acknowledged.", sum),
    ("inflight", "sparkbus_rank_batches_in_flight", "gauge", "Batches the rank holds unacknowledged.", sum),
    ("idle_s", "sparkbus_rank_idle_seconds", "gauge", "Seconds since the rank's last message.", min),
    ("consumed", "sparkbus_rank_batches_consumed", "counter",
     "Batches the rank's training loop took, as the rank reports.", sum),
    ("wait_s", "sparkbus_rank_data_wait_seconds", "counter",
     "Seconds the rank's training loop waited for data, as the rank reports.", sum),
    ("first_batch_s", "sparkbus_rank_first_batch_seconds", "gauge",
     "Seconds from the rank's start to its first batch, as the rank reports.", min),
]

# Counters that the ledger lowers when it requeues a batch (it undoes the send): rendered as their high-water mark
# within this broker process, so that Prometheus does not mistake the undo for a counter reset.
HIGH_WATER = {"batches_out", "bytes_out", "rows_out"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (list, tuple, set, dict)):
        return float(len(value))          # e.g. the list of diverged partitions
    return None


class StatsCollector(Collector):
    """A Prometheus collector of the last :meth:`publish`\\ ed ``Broker.stats()`` snapshot."""

    def __init__(self) -> None:
        self._stats: dict[str, Any] | None = None
        self._published = 0.0
        self._lock = threading.Lock()              # scrapes may run side by side; they share the high-water marks
        self._high: dict[tuple[str, str, str, str], float] = {}

    def publish(self, stats: dict[str, Any]) -> None:
        """Make ``stats`` the snapshot scrapes render. The dict must not be changed afterwards (Broker.stats()
        builds a new one each call)."""
        self._stats, self._published = stats, time.time()      # one reference each: atomic under the GIL

    def collect(self) -> Iterator[Metric]:
        stats, published = self._stats, self._published
        if stats is None:
            return
        with self._lock:
            yield from self._broker(stats.get("broker", {}), published)
            streams = stats.get("streams", {})
            yield from self._streams(streams)
            yield from self._epochs(streams)
            yield from self._ranks(streams)

    def _broker(self, broker: dict[str, Any], published: float) -> Iterator[Metric]:
        info = GaugeMetricFamily("sparkbus_info", "The broker's protocol version and incarnation (new at each start).",
                                 labels=["version", "incarnation"])
        info.add_metric([str(broker.get("version", "")), str(broker.get("incarnation", ""))], 1)
        yield info
        gauges = [("sparkbus_uptime_seconds", "Seconds since the broker started.", broker.get("uptime_s")),
                  ("sparkbus_buffered_bytes", "Bytes of batches held (queued or unacknowledged).",
                   broker.get("buffered_bytes")),
                  ("sparkbus_max_buffer_bytes", "--max-buffer: bytes held before the feed is paused.",
                   broker.get("max_buffer")),
                  ("sparkbus_feed_paused", "1 while the feed socket is not read (the buffer is full).",
                   broker.get("feed_paused")),
                  ("sparkbus_stats_published_timestamp_seconds",
                   "Unix time of the snapshot these figures come from (the broker publishes one per heartbeat).",
                   published)]
        buffered, limit = _number(broker.get("buffered_bytes")), _number(broker.get("max_buffer"))
        if buffered is not None and limit:
            gauges.append(("sparkbus_buffer_use_ratio", "buffered_bytes / max_buffer_bytes.", buffered / limit))
        for name, doc, value in gauges:
            if _number(value) is not None:
                yield GaugeMetricFamily(name, doc, value=_number(value))
        refused = CounterMetricFamily("sparkbus_refused_messages",
                                      "Messages and connections refused, by socket and reason.",
                                      labels=["socket", "reason"])
        for sock, reasons in sorted(broker.get("rejected", {}).items()):
            for reason, count in sorted(reasons.items()):
                refused.add_metric([sock, reason], count)
        yield refused

    def _streams(self, streams: dict[str, Any]) -> Iterator[Metric]:
        joined = GaugeMetricFamily("sparkbus_ranks_joined", "Ranks connected to the stream.", labels=["stream"])
        expected = GaugeMetricFamily("sparkbus_ranks_expected", "The communicator size the stream's ranks announced.",
                                     labels=["stream"])
        inflight = GaugeMetricFamily("sparkbus_batches_in_flight",
                                     "Batches sent and not acknowledged, including those held for a lost rank.",
                                     labels=["stream"])
        orphans = GaugeMetricFamily("sparkbus_orphaned_ranks",
                                    "Lost ranks whose batches wait --rejoin-grace for them.", labels=["stream"])
        rejoins = CounterMetricFamily("sparkbus_rejoins", "Ranks that came back and were reconciled.",
                                      labels=["stream"])
        for name, stream in sorted(streams.items()):
            ranks, lost = stream.get("ranks", []), stream.get("orphans", [])
            joined.add_metric([name], len(ranks))
            expected.add_metric([name], stream.get("expected_ranks", 0))
            inflight.add_metric([name], sum(r.get("inflight", 0) for r in ranks) +
                                sum(o.get("inflight", 0) for o in lost))
            orphans.add_metric([name], len(lost))
            rejoins.add_metric([name], stream.get("rejoins", 0))
        yield from (joined, expected, inflight, orphans, rejoins)

    def _epochs(self, streams: dict[str, Any]) -> Iterator[Metric]:
        for field, name, kind, doc in EPOCH_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc,
                                                                                        labels=["stream", "epoch"])
            for stream_name, stream in sorted(streams.items()):
                for epoch, figures in sorted(stream.get("epochs", {}).items(), key=lambda e: int(e[0])):
                    value = _number(figures.get(field))
                    if value is None:
                        continue
                    if field in HIGH_WATER:
                        key = (field, stream_name, epoch, "")
                        value = self._high[key] = max(value, self._high.get(key, value))
                    family.add_metric([stream_name, str(epoch)], value)
            yield family
        live = {(s, e) for s, stream in streams.items() for e in stream.get("epochs", {})}
        for key in [k for k in self._high if (k[1], k[2]) not in live]:
            del self._high[key]                  # epochs no longer in the figures: forget their marks

    def _ranks(self, streams: dict[str, Any]) -> Iterator[Metric]:
        for field, name, kind, doc, combine in RANK_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc,
                                                                                        labels=["stream", "rank"])
            for stream_name, stream in sorted(streams.items()):
                # independent consumers all say rank 0: one series per (stream, rank), their figures combined
                values: dict[int, list[float]] = defaultdict(list)
                for rank in stream.get("ranks", []):
                    value = _number(rank.get(field))
                    if value is not None:
                        values[rank.get("rank", 0)].append(value)
                for number in sorted(values):
                    family.add_metric([stream_name, str(number)], combine(values[number]))
            yield family


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True      # a slow scraper never holds up a stopping broker


class _IPv6Server(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:    # scrapes are not worth a log line each
        pass


class MetricsExporter:
    """``GET /metrics`` on ``host:port`` from a daemon thread, rendering the last published ``Broker.stats()``.

    Args:
        port: TCP port; 0 lets the system choose (see :attr:`port` after :meth:`start`).
        host: address to listen on; loopback by default (the figures name streams and show traffic).
    """

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.collector = StatsCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        ProcessCollector(registry=self.registry)          # process_resident_memory_bytes, CPU, open fds
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Listen and serve from a daemon thread. Returns the port.

        Raises:
            OSError: the address cannot be bound (in use, or not an address of this host).
        """
        server_class = _IPv6Server if ":" in self.host else _ThreadingServer
        self._server = make_server(self.host, self.port, make_wsgi_app(self.registry), server_class,
                                   handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="sparkbus-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self.host if ":" not in self.host else f"[{self.host}]",
                 self.port)
        return self.port

    def publish(self, stats: dict[str, Any]) -> None:
        """Hand over the figures to serve until the next call (once per heartbeat); the loop's only metrics work."""
        self.collector.publish(stats)

    def stop(self) -> None:
        """Stop serving and close the listening socket; returns within about a second."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(2)
            self._server = self._thread = None

    def __enter__(self) -> "MetricsExporter":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["MetricsExporter", "StatsCollector", "EPOCH_METRICS", "RANK_METRICS"]
