"""Prometheus metrics (``--metrics-port``): the broker's last published figures, served over HTTP from a thread.

The broker loop calls :meth:`MetricsExporter.publish` with :meth:`Broker.stats` once per heartbeat: one reference
swap, no work per message. A scrape renders that snapshot (:class:`StatsCollector`) in the HTTP server's thread,
so the loop never waits for a scraper and a scraper never sees a half-updated figure.

The metrics are declared once, in :mod:`broker.figures` (:data:`~broker.figures.METRICS`: name, type, labels, help,
the field of the figures each renders); this module renders them, and docs/OPERATIONS.md ("Monitoring") lists
them, which a unit test holds to the declaration. Names follow Prometheus conventions: counters end in
``_total``, sizes in ``_bytes``, times in ``_seconds``. Labels: ``stream``, ``rank``, ``socket``, ``reason`` and
``version``. No label takes a value per epoch: a stream's counters add up its epochs (those the figures list and the
``earlier`` ones, summed), its gauges are the current epoch's (``sparkbus_epoch``), so the series stay as many as
streams and ranks however long a broker runs.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

try:
    from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.core import Metric as Family
    from prometheus_client.registry import Collector
except ImportError as exc:     # the daemon imports this module only for --metrics-port
    raise ImportError(f"the broker's --metrics-port needs prometheus-client ({exc}): "
                      "pip install 'sparkbus[broker]'") from exc

from sparkbus.broker.figures import (
    BROKER_METRICS,
    EPOCH_METRICS,
    METRIC,
    OLDER,
    OVER_EPOCHS,
    RANK_METRICS,
    STREAM_METRICS,
    VERDICTS,
    BrokerFigures,
    Figures,
    Metric,
    StreamFigures,
)
from sparkbus.wire.verdict import of_stream

log = logging.getLogger("sparkbus.metrics")


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
        self._stats: Figures | None = None
        self._published = 0.0

    def publish(self, stats: Figures) -> None:
        """Make ``stats`` the snapshot scrapes render. The dict must not be changed afterwards (Broker.stats()
        builds a new one each call)."""
        self._stats, self._published = stats, time.time()      # one reference each: atomic under the GIL

    def collect(self) -> Iterator[Family]:
        stats, published = self._stats, self._published
        if stats is None:
            return
        yield from self._broker(stats.get("broker", {}), published, len(stats.get("streams", {})))
        streams = stats.get("streams", {})
        yield from self._streams(streams)
        yield from self._epochs(streams)
        yield from self._ranks(streams)

    def _broker(self, broker: BrokerFigures, published: float, streams: int) -> Iterator[Family]:
        info = _family(METRIC["sparkbus_info"])
        info.add_metric([str(broker.get("version", "")), str(broker.get("incarnation", ""))], 1)
        yield info
        buffered, limit = _number(broker.get("buffered_bytes")), _number(broker.get("max_buffer"))
        derived = {"sparkbus_stats_published_timestamp_seconds": published,
                   "sparkbus_buffer_use_ratio": buffered / limit if buffered is not None and limit else None,
                   "sparkbus_streams": streams}
        for metric in BROKER_METRICS:
            if metric.labels:
                continue
            value = _number(broker.get(metric.field) if metric.field else derived[metric.name])
            if value is not None:
                yield _family(metric, value)
        older = _family(METRIC["sparkbus_older_peers"])
        for version, count in sorted(broker.get("older_peers", {}).items()):
            older.add_metric([version], count)
        yield older
        refused = _family(METRIC["sparkbus_refused_messages"])
        for sock, reasons in sorted(broker.get("rejected", {}).items()):
            for reason, count in sorted(reasons.items()):
                refused.add_metric([sock, reason], count)
        yield refused

    def _streams(self, streams: dict[str, StreamFigures]) -> Iterator[Family]:
        derived: dict[str, Callable[[StreamFigures], float | None]] = {
            "sparkbus_ranks_joined": lambda s: len(s.get("ranks", [])),
            "sparkbus_batches_in_flight": lambda s: sum(r.get("inflight", 0) for r in s.get("ranks", [])) +
            sum(o.get("inflight", 0) for o in s.get("orphans", [])),
            "sparkbus_orphaned_ranks": lambda s: len(s.get("orphans", [])),
            "sparkbus_epoch": lambda s: _current(s)[0],
        }
        for metric in STREAM_METRICS:
            family = _family(metric)
            if metric.name == "sparkbus_stream_verdict":        # bounded: three series a stream
                for name, stream in sorted(streams.items()):
                    verdict = of_stream([stream])
                    if verdict.kind == "unknown":
                        continue
                    said = "window-round-trip" if verdict.window else verdict.kind
                    for label in VERDICTS:
                        family.add_metric([name, label], 1 if label == said else 0)
                yield family
                continue
            for name, stream in sorted(streams.items()):
                value = _number(stream.get(metric.field, 0)) if metric.field else derived[metric.name](stream)
                if value is not None:
                    family.add_metric([name], value)
            yield family

    def _epochs(self, streams: dict[str, StreamFigures]) -> Iterator[Family]:
        for metric in EPOCH_METRICS:
            family, field = _family(metric), metric.field or ""
            for stream_name, stream in sorted(streams.items()):
                epochs = stream.get("epochs", {})
                value: float | None
                if metric.kind == "counter" or field in OVER_EPOCHS:
                    figures = [*epochs.values(), stream.get("earlier", {})]
                    # figures of an older broker may lack it, or have it as another figure (OLDER)
                    values = [v for f in figures if (v := _number(f.get(field, f.get(OLDER.get(field, field)))))
                              is not None]
                    if not values:
                        continue               # figures retired by an older broker may lack it
                    value = float(sum(values))
                else:
                    current = _current(stream)[1]
                    value = _number(current.get(field)) if current is not None else None
                    if value is None:
                        continue
                family.add_metric([stream_name], value)
            yield family

    def _ranks(self, streams: dict[str, StreamFigures]) -> Iterator[Family]:
        for metric in RANK_METRICS:
            family, combine = _family(metric), metric.combine or sum
            for stream_name, stream in sorted(streams.items()):
                # independent consumers all say rank 0: one series per (stream, rank), their figures combined
                values: dict[int, list[float]] = defaultdict(list)
                for rank in stream.get("ranks", []):
                    value = _number(rank.get(metric.field or ""))
                    if value is not None:
                        values[rank.get("rank", 0)].append(value)
                for number in sorted(values):
                    family.add_metric([stream_name, str(number)], combine(values[number]))
            yield family


def _current(stream: StreamFigures) -> tuple[int | None, dict[str, Any] | None]:
    """A stream's current epoch and its figures: the lowest not ended, else the last one (None: no epoch listed)."""
    epochs = stream.get("epochs", {})
    if not epochs:
        return None, None
    numbers = sorted(int(n) for n in epochs)
    live = [n for n in numbers if not epochs[str(n)].get("ended")]
    number = live[0] if live else numbers[-1]
    return number, dict(epochs[str(number)])


def _family(metric: Metric, value: float | None = None) -> CounterMetricFamily | GaugeMetricFamily:
    """An empty family of ``metric``'s kind and labels, or with ``value`` for one without labels."""
    kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
    if value is not None:
        return kind(metric.name, metric.help, value=value)
    return kind(metric.name, metric.help, labels=list(metric.labels))


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

    def publish(self, stats: Figures) -> None:
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

    def __enter__(self) -> MetricsExporter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["MetricsExporter", "StatsCollector", "EPOCH_METRICS", "RANK_METRICS"]     # the lists: broker.figures
