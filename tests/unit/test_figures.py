"""The figures are defined once (broker/figures.py): the ledger fills in exactly those records, the exporter serves
exactly the declared metrics, and the docs list both (docs/PROTOCOL.md "Statistics", docs/OPERATIONS.md
"Monitoring"), as test_protocol_doc.py holds the message table to ``protocol.SCHEMAS``."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkbus.broker.books import Outcome
from sparkbus.broker.config import BrokerConfig
from sparkbus.broker.daemon import Broker
from sparkbus.broker.figures import (
    BROKER_METRICS,
    EPOCH_METRICS,
    METRICS,
    RANK_METRICS,
    STREAM_METRICS,
    BrokerFigures,
    EarlierFigures,
    EpochFigures,
    OrphanFigures,
    RankFigures,
    StreamFigures,
)
from sparkbus.broker.metrics import MetricsExporter

from harness import STREAM, end, hello, join, push, window

DOCS = Path(__file__).resolve().parents[2] / "docs"


def keys(record) -> set[str]:
    return set(record.__annotations__)


@pytest.fixture
def figures():
    """``Broker.stats()`` of a broker (not running) whose ledger has an epoch, two ranks and an orphan."""
    broker = Broker(BrokerConfig(feed="inproc://figures-feed", ranks="inproc://figures-ranks",
                                 control="inproc://figures-control", rejoin_grace=60.0))
    ledger = broker.ledger
    ledger.open_epoch(STREAM, 0, 1, "stream")
    for seq in range(3):
        push(ledger, 0, 0, seq)
    end(ledger, 0, 0, 0, 3)
    join(ledger, b"a", dict(hello(0, 2), session="a"), prefetch=2)
    join(ledger, b"b", dict(hello(1, 2), session="b"), prefetch=2)
    ledger.report(ledger.rank(b"a"), {"wait_s": 0.5, "first_batch_s": 0.25, "consumed": 1, "peer_wait_s": 0.125,
                                      "step_s": 2.0})
    ledger.dispatch(ledger.streams[STREAM], lambda identity, frames: Outcome.SENT)
    window(ledger, b"b", 2)
    ledger.rank_gone(b"b", "disconnected")          # a lost rank holding batches: an orphan
    broker.rejected["feed"]["malformed"] += 1
    broker.peers.heard("ranks", b"old", 4, 0.0)      # a connection of the version before
    return broker.stats()


def test_the_ledger_fills_in_exactly_the_declared_records(figures):
    assert set(figures["broker"]) == keys(BrokerFigures)
    stream = figures["streams"][STREAM]
    assert set(stream) == keys(StreamFigures)
    assert set(stream["epochs"]["0"]) == keys(EpochFigures)
    assert set(stream["earlier"]) == keys(EarlierFigures)
    assert [set(r) for r in stream["ranks"]] == [keys(RankFigures)]      # rank a, which reported its figures
    assert [set(o) for o in stream["orphans"]] == [keys(OrphanFigures)]  # rank b, lost


def test_each_metric_reads_a_declared_field():
    for metrics, record in [(BROKER_METRICS, BrokerFigures), (STREAM_METRICS, StreamFigures),
                            (EPOCH_METRICS, EpochFigures), (RANK_METRICS, RankFigures)]:
        for metric in metrics:
            assert metric.field is None or metric.field in keys(record), metric.name
    assert all(m.field is not None for m in EPOCH_METRICS + RANK_METRICS)
    # bounded series: no label takes a value per epoch, and each counter of the epochs adds up in ``earlier``
    assert not [m.name for m in METRICS if "epoch" in m.labels]
    assert {m.field for m in EPOCH_METRICS if m.kind == "counter"} <= keys(EarlierFigures)
    assert len({m.name for m in METRICS}) == len(METRICS)


def test_the_exporter_serves_exactly_the_declared_metrics(figures):
    with MetricsExporter(0) as exporter:
        exporter.publish(figures)
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5) as response:
            text = response.read().decode()
    served = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("sparkbus_"):
                served[sample.name] = (family.type, set(sample.labels))
    assert served == {m.exposed: (m.kind, set(m.labels)) for m in METRICS}


def operations_metric_table() -> dict[str, tuple[str, set[str]]]:
    rows = {}
    for line in (DOCS / "OPERATIONS.md").read_text().splitlines():
        if not line.startswith("| `sparkbus_"):
            continue
        names, kind, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
        for name in re.findall(r"`(sparkbus_\w+)`", names):
            rows[name] = (kind, set(re.findall(r"`(\w+)`", labels)))
    return rows


def test_the_operations_page_lists_every_metric_with_its_type_and_labels():
    assert operations_metric_table() == {m.exposed: (m.kind, set(m.labels)) for m in METRICS}


def protocol_statistics() -> dict[str, set[str]]:
    text = (DOCS / "PROTOCOL.md").read_text()
    block = text[text.index("## Statistics"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]

    def names(fields: str) -> set[str]:
        while re.search(r"\{[^{}]*\}", fields):
            fields = re.sub(r"\{[^{}]*\}", "", fields)           # endpoints{...}, rejected{...}: the name only
        return {f.strip() for f in fields.replace("\n", " ").split(",") if f.strip()}

    stream = re.search(r"\{name: \{([a-z_, ]+),\s*\n", block).group(1)
    return {
        "broker": names(block[block.index("broker:") + 7:block.index("streams:")]),
        "stream": names(stream) | {"earlier", "epochs", "ranks", "orphans"},
        "earlier": names(re.search(r"earlier: \{([^}]*)\}", block).group(1)),
        "epoch": names(re.search(r'"<epoch>": \{([^}]*)\}', block).group(1)),
        "rank": names(re.search(r"ranks: \[\{([^}]*)\}\]", block).group(1)),
        "orphan": names(re.search(r"orphans: \[\{([^}]*)\}\]", block).group(1)),
    }


def test_the_protocol_page_lists_the_fields_of_every_record():
    assert protocol_statistics() == {"broker": keys(BrokerFigures), "stream": keys(StreamFigures),
                                     "earlier": keys(EarlierFigures),
                                     "epoch": keys(EpochFigures), "rank": keys(RankFigures),
                                     "orphan": keys(OrphanFigures)}


def test_the_table_parsers_see_a_missing_metric_and_field():
    # The checks above must be able to fail.
    assert "sparkbus_rows_out_total" in operations_metric_table()
    assert "rows_out" in protocol_statistics()["epoch"] and "rows_out" in keys(EpochFigures)


def test_what_a_rank_reports_is_what_ack_and_heartbeat_may_carry():
    from sparkbus.broker.figures import REPORTED
    from sparkbus.wire.protocol import OPTIONAL, Kind

    # ACK's upto is progress in packs, not a figure; HEARTBEAT's unread goes the other way (broker -> rank)
    assert set(REPORTED) == set(OPTIONAL[Kind.ACK]) - {"upto"} == set(OPTIONAL[Kind.HEARTBEAT]) - {"unread"} == \
        RankFigures.__optional_keys__
