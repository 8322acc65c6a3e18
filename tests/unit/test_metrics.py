"""The Prometheus exporter (broker/metrics.py): a published stats snapshot, scraped over HTTP and parsed back.

The snapshot has the shape of ``Broker.stats()`` (docs/PROTOCOL.md, "Statistics"), with the figures ranks report
(``wait_s``, ``first_batch_s``, ``consumed``) on some ranks only.
"""

from __future__ import annotations

import copy
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkbus.broker.figures import no_earlier
from sparkbus.broker.metrics import MetricsExporter


def epoch(**figures):
    base = {"partitions": 4, "delivery": "stream", "committed": 0, "closed": False, "ended": False, "queued": 0,
            "batches_in": 0, "bytes_in": 0, "rows_in": 0, "batches_out": 0, "bytes_out": 0, "acked": 0,
            "duplicates": 0, "redelivered": 0, "diverged": [], "adopted": 0, "unassigned": 0, "held": 0,
            "commit": "driver", "superseded": 0}
    return {**base, **figures}


def rank(number, **figures):
    return {"rank": number, "size": 2, "even": True, "inflight": 0, "batches": 0, "bytes": 0, "acked": 0,
            "idle_s": 0.5, **figures}


STATS = {
    "broker": {"version": 3, "pid": 4242, "incarnation": "abcd", "uptime_s": 12.5, "buffered_bytes": 256 << 20,
               "max_buffer": 1 << 30, "feed_paused": True, "journal": None,
               "endpoints": {"feed": "tcp://127.0.0.1:5555", "ranks": "tcp://127.0.0.1:5556",
                             "control": "tcp://127.0.0.1:5557"},
               "rejected": {"feed": {"malformed": 3, "unknown_key": 2}, "ranks": {"wrong_role": 1}},
               "versions": [4, 5], "older_peers": {"4": 3}, "retired_streams": 5},
    "streams": {
        "train": {"expected_ranks": 2, "rejoins": 1, "delivered": 4, "idle_s": 0.0,
                  # three epochs before 0 whose figures are no longer listed, summed
                  "earlier": {"epochs": 3, "batches_in": 300, "bytes_in": 307200, "rows_in": 30000,
                              "batches_out": 300, "bytes_out": 307200, "rows_out": 30000, "acked": 300,
                              "duplicates": 7, "redelivered": 1, "given_twice": 0, "diverged": 1, "dropped": 0,
                              "moved": 0, "unassigned": 0, "adopted": 0, "superseded": 0},
                  "epochs": {"0": epoch(committed=4, closed=True, ended=True, batches_in=40, bytes_in=40960,
                                        rows_in=4000, batches_out=40, bytes_out=40960, acked=40, duplicates=5,
                                        redelivered=2, diverged=[1, 3]),
                             "1": epoch(committed=1, queued=6, batches_in=10, bytes_in=10240, rows_in=1000,
                                        batches_out=4, bytes_out=4096, acked=1)},
                  "ranks": [rank(0, inflight=2, batches=23, bytes=23552, acked=21, wait_s=1.25,
                                 first_batch_s=0.75, consumed=21),
                            rank(1, inflight=1, batches=21, bytes=21504, acked=20)],
                  "orphans": [{"rank": 3, "inflight": 4, "expires_in_s": 2.0}]},
        "val": {"expected_ranks": 1, "rejoins": 0, "epochs": {}, "delivered": 0, "idle_s": 0.0,
                "earlier": no_earlier(),
                # independent consumers all say rank 0
                "ranks": [rank(0, size=1, even=False, inflight=1, batches=5, wait_s=2.0, first_batch_s=0.5,
                               consumed=4, idle_s=3.0),
                          rank(0, size=1, even=False, inflight=2, batches=7, wait_s=0.5, first_batch_s=0.25,
                               consumed=6, idle_s=1.0)],
                "orphans": []},
    },
}


@pytest.fixture
def exporter():
    made = MetricsExporter(0)
    made.start()
    yield made
    made.stop()


def scrape(exporter) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


def test_the_published_figures_are_served_with_exact_values(exporter):
    exporter.publish(STATS)
    got = scrape(exporter)
    assert value(got, "sparkbus_info", version="3", incarnation="abcd") == 1
    assert value(got, "sparkbus_uptime_seconds") == 12.5
    assert value(got, "sparkbus_buffered_bytes") == 256 << 20
    assert value(got, "sparkbus_max_buffer_bytes") == 1 << 30
    assert value(got, "sparkbus_buffer_use_ratio") == 0.25
    assert value(got, "sparkbus_feed_paused") == 1
    assert value(got, "sparkbus_refused_messages_total", socket="feed", reason="malformed") == 3
    assert value(got, "sparkbus_refused_messages_total", socket="feed", reason="unknown_key") == 2
    assert value(got, "sparkbus_refused_messages_total", socket="ranks", reason="wrong_role") == 1
    assert value(got, "sparkbus_streams") == 2 and value(got, "sparkbus_retired_streams_total") == 5
    assert value(got, "sparkbus_older_peers", version="4") == 3

    # counters: the stream's epochs added up (the earlier ones' sums, epoch 0 and epoch 1); no epoch label
    train = {"stream": "train"}
    for name, total in [("sparkbus_batches_in_total", 300 + 40 + 10), ("sparkbus_rows_in_total", 30000 + 4000 + 1000),
                        ("sparkbus_bytes_in_total", 307200 + 40960 + 10240),
                        ("sparkbus_batches_out_total", 300 + 40 + 4),
                        ("sparkbus_bytes_out_total", 307200 + 40960 + 4096),
                        ("sparkbus_batches_acked_total", 300 + 40 + 1), ("sparkbus_duplicate_batches_total", 7 + 5),
                        ("sparkbus_redelivered_batches_total", 1 + 2), ("sparkbus_diverged_partitions_total", 1 + 2),
                        ("sparkbus_rows_out_total", 30000),       # only the earlier sums have it in these figures
                        ("sparkbus_epochs_delivered_total", 4),
                        # gauges: the current epoch's (1, the lowest not ended); queued over every epoch
                        ("sparkbus_epoch", 1), ("sparkbus_batches_queued", 6), ("sparkbus_partitions", 4),
                        ("sparkbus_partitions_committed", 1), ("sparkbus_epoch_closed", 0),
                        ("sparkbus_epoch_ended", 0)]:
        assert value(got, name, **train) == total, name
    assert not [labels for name, labels in got if "epoch" in dict(labels)]
    assert ("sparkbus_epoch", (("stream", "val"),)) not in got               # no epoch listed: no current epoch
    assert value(got, "sparkbus_batches_in_total", stream="val") == 0          # the earlier sums are 0 there

    assert value(got, "sparkbus_ranks_joined", stream="train") == 2
    assert value(got, "sparkbus_ranks_joined", stream="val") == 2
    assert value(got, "sparkbus_ranks_expected", stream="train") == 2
    assert value(got, "sparkbus_batches_in_flight", stream="train") == 2 + 1 + 4       # orphan's included
    assert value(got, "sparkbus_orphaned_ranks", stream="train") == 1
    assert value(got, "sparkbus_rejoins_total", stream="train") == 1

    r0, r1 = {"stream": "train", "rank": "0"}, {"stream": "train", "rank": "1"}
    assert value(got, "sparkbus_rank_data_wait_seconds_total", **r0) == 1.25
    assert value(got, "sparkbus_rank_first_batch_seconds", **r0) == 0.75
    assert value(got, "sparkbus_rank_batches_consumed_total", **r0) == 21
    assert value(got, "sparkbus_rank_batches_sent_total", **r1) == 21
    assert value(got, "sparkbus_rank_bytes_sent_total", **r1) == 21504
    assert value(got, "sparkbus_rank_batches_acked_total", **r1) == 20
    assert value(got, "sparkbus_rank_batches_in_flight", **r1) == 1
    assert ("sparkbus_rank_data_wait_seconds_total", tuple(sorted(r1.items()))) not in got   # rank 1 said nothing

    val0 = {"stream": "val", "rank": "0"}            # two consumers, one series: sums, and the earliest first batch
    assert value(got, "sparkbus_rank_data_wait_seconds_total", **val0) == 2.5
    assert value(got, "sparkbus_rank_batches_consumed_total", **val0) == 10
    assert value(got, "sparkbus_rank_first_batch_seconds", **val0) == 0.25
    assert value(got, "sparkbus_rank_idle_seconds", **val0) == 1.0
    assert value(got, "sparkbus_rank_batches_in_flight", **val0) == 3
    assert value(got, "process_resident_memory_bytes") > 0


def test_a_scrape_before_any_figures_serves_no_sparkbus_metrics(exporter):
    assert not [name for name, _ in scrape(exporter) if name.startswith("sparkbus_")]


def test_each_scrape_renders_the_last_published_snapshot(exporter):
    exporter.publish(STATS)
    later = copy.deepcopy(STATS)
    later["broker"]["buffered_bytes"] = 0
    later["broker"]["feed_paused"] = False
    later["streams"]["train"]["epochs"]["1"]["batches_in"] = 30
    exporter.publish(later)
    got = scrape(exporter)
    assert value(got, "sparkbus_buffered_bytes") == 0 and value(got, "sparkbus_feed_paused") == 0
    assert value(got, "sparkbus_batches_in_total", stream="train") == 300 + 40 + 30
    stamp = value(got, "sparkbus_stats_published_timestamp_seconds")
    assert stamp == value(scrape(exporter), "sparkbus_stats_published_timestamp_seconds")


def test_a_requeued_batch_does_not_make_the_out_counters_go_back(exporter):
    """The ledger lowers batches_out when it requeues a batch; Prometheus would read a drop as a reset. Its figures
    keep the most that was out (``batches_handed``, which only grows): the counters are drawn from it."""
    figures = copy.deepcopy(STATS)
    exporter.publish(figures)
    assert value(scrape(exporter), "sparkbus_batches_out_total", stream="train") == 344
    figures = copy.deepcopy(figures)
    figures["streams"]["train"]["epochs"]["1"].update(batches_out=3, bytes_out=3072, batches_handed=4,
                                                      bytes_handed=4096)
    exporter.publish(figures)
    got = scrape(exporter)
    assert value(got, "sparkbus_batches_out_total", stream="train") == 344
    assert value(got, "sparkbus_bytes_out_total", stream="train") == 307200 + 40960 + 4096
    figures = copy.deepcopy(figures)
    figures["streams"]["train"]["epochs"]["1"].update(batches_out=6, batches_handed=6)
    exporter.publish(figures)
    assert value(scrape(exporter), "sparkbus_batches_out_total", stream="train") == 346


def test_an_epoch_folded_into_the_earlier_sums_leaves_the_counters_where_they_were(exporter):
    """Bounded history: when an epoch's figures leave the list for the stream's ``earlier`` sums, no counter moves,
    and the series stay one per stream."""
    from sparkbus.broker.figures import fold

    exporter.publish(STATS)
    before = scrape(exporter)
    folded = copy.deepcopy(STATS)
    fold(folded["streams"]["train"]["earlier"], folded["streams"]["train"]["epochs"].pop("0"))
    exporter.publish(folded)
    after = scrape(exporter)
    sparkbus = {k: v for k, v in before.items() if k[0].startswith("sparkbus_") and k[0].endswith("_total")}
    assert {k: after[k] for k in sparkbus} == sparkbus
    assert len([k for k in after if k[0].startswith("sparkbus_")]) == len([k for k in before
                                                                           if k[0].startswith("sparkbus_")])


def test_streams_that_left_the_figures_leave_the_metrics(exporter):
    exporter.publish(STATS)
    assert ("sparkbus_batches_in_total", (("stream", "val"),)) in scrape(exporter)
    fewer = copy.deepcopy(STATS)
    del fewer["streams"]["val"]                   # retired
    exporter.publish(fewer)
    got = scrape(exporter)
    assert not [labels for name, labels in got if dict(labels).get("stream") == "val"]
    assert value(got, "sparkbus_batches_in_total", stream="train") == 350


def test_stop_closes_the_port_and_the_exporter_listens_on_loopback_by_default():
    exporter = MetricsExporter(0)
    assert exporter.host == "127.0.0.1"
    port = exporter.start()
    assert port == exporter.port > 0
    exporter.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    exporter.stop()                      # twice is harmless


def test_a_port_in_use_is_an_os_error():
    with MetricsExporter(0) as first:
        with pytest.raises(OSError):
            MetricsExporter(first.port).start()


def test_the_grafana_dashboard_parses_and_plots_only_metrics_the_exporter_serves(exporter):
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "sparkbus.json").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert expressions
    exporter.publish(STATS)
    served = {name for name, _ in scrape(exporter)}
    plotted = {name for e in expressions for name in re.findall(r"\b((?:sparkbus|process)_[a-z_]+)", e)}
    assert plotted <= served, plotted - served
    assert {"sparkbus_bytes_in_total", "sparkbus_bytes_out_total", "sparkbus_buffer_use_ratio",
            "sparkbus_feed_paused", "sparkbus_ranks_joined", "sparkbus_redelivered_batches_total",
            "sparkbus_refused_messages_total", "sparkbus_rank_data_wait_seconds_total", "sparkbus_epoch",
            "sparkbus_adopted_batches_total", "sparkbus_batches_held_for_recovery"} <= plotted
    assert not [e for e in expressions if re.search(r"\bepoch\b[^_]", e.replace("sparkbus_epoch", ""))]  # no label


def test_the_stream_verdict_is_one_gauge_per_answer(exporter):
    """Why a stream's training waits, from its ranks' figures (as sparkbus status says it): three series a stream,
    1 for the verdict; a stream whose ranks reported nothing has none."""
    figures = copy.deepcopy(STATS)
    ranks = figures["streams"]["train"]["ranks"]
    ranks[0].update(wait_s=2.25, first_batch_s=0.75, peer_wait_s=0.0, step_s=2.0)   # 1.5 s for data over 2 + 8
    ranks[1].update(wait_s=0.0, first_batch_s=0.0, peer_wait_s=0.0, step_s=8.0)
    exporter.publish(figures)
    got = scrape(exporter)
    verdict = {label: value(got, "sparkbus_stream_verdict", stream="train", verdict=label)
               for label in ("input-bound", "window-round-trip", "compute-bound")}
    assert verdict == {"input-bound": 0, "window-round-trip": 1, "compute-bound": 0}    # epoch 1 has 6 queued
    figures["streams"]["train"]["epochs"]["1"]["queued"] = 0
    exporter.publish(figures)
    got = scrape(exporter)
    assert value(got, "sparkbus_stream_verdict", stream="train", verdict="input-bound") == 1
    ranks[0].update(wait_s=0.8)                                                     # 0.05 s over 10 s: no longer
    exporter.publish(figures)
    got = scrape(exporter)
    assert value(got, "sparkbus_stream_verdict", stream="train", verdict="compute-bound") == 1
    assert not [k for k in got if k[0] == "sparkbus_stream_verdict" and ("stream", "val") in k[1]]
