"""The broker as a service: CURVE keys by role, refusals counted, and Prometheus metrics that match the ranks."""

import json
import socket
import threading
import urllib.request
from urllib.parse import urlsplit

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkbus.broker.client import ControlClient, fetch_stats
from sparkbus.feeder import feed
from sparkbus.wire.errors import BrokerError
from sparkbus.worker import BatchStream

from harness import key_directory, wait_for
from sources import labelled_frame

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def keys(tmp_path):
    """A key directory (the broker's pair, one allowed feeder, one allowed rank) and the clients' own pairs."""
    authority = tmp_path / "auth"
    pairs = key_directory(authority, tmp_path / "clients", {"feeder": "feeders", "rank": "ranks", "stranger": None})
    made = {name: str(secret) for name, (_, secret) in pairs.items()}
    made["broker"] = str(authority / "broker.key")
    made["dir"] = str(authority)
    return made


def consume(address, out, **kwargs):
    try:
        with BatchStream(address, stream="secure", timeout=60, **kwargs) as stream:
            out["ids"] = np.concatenate([batch["id"].copy() for batch in stream.epoch()])
    except BaseException as exc:         # reported by the test
        out["error"] = exc


def rejected(broker, keys) -> dict:
    """The broker's refusals on its ranks and control sockets, by reason."""
    stats = fetch_stats(broker.control, key=keys["feeder"], broker_key=keys["broker"])
    return {**stats["broker"]["rejected"].get("ranks", {}), **stats["broker"]["rejected"].get("control", {})}


def send_keyless_greeting(address: str) -> bytes:
    """A peer without CURVE, at the wire: a whole ZMTP 3.0 greeting naming the NULL mechanism, the connection kept
    until the broker closes it (libzmq names the mismatch "no_key" only once it has read the peer's greeting; a
    pyzmq peer on a loaded machine may close before that, and the broker counts a handshake cut short instead).
    Returns the signature the broker sent first (10 bytes)."""
    url = urlsplit(address)
    greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + bytes(32)
    with socket.create_connection((url.hostname, url.port), timeout=10) as peer:
        signature = b""
        while len(signature) < 10 and (chunk := peer.recv(10 - len(signature))):
            signature += chunk
        peer.sendall(greeting)
        try:
            while peer.recv(4096):               # until the broker closes the connection (or the 10 s timeout)
                pass
        except ConnectionResetError:
            pass
    return signature


def test_only_allowed_keys_in_their_role_get_in_and_the_allowed_stream_is_exact(spark, start_broker_process, keys):
    broker = start_broker_process("--auth", keys["dir"])
    got = {}
    consumer = threading.Thread(target=consume, args=(broker.ranks, got),
                                kwargs=dict(key=keys["rank"], broker_key=keys["broker"]))
    consumer.start()
    refusals = {
        "no key": dict(),
        "a key the broker does not know": dict(key=keys["stranger"], broker_key=keys["broker"]),
        "a feeder's key on the ranks socket": dict(key=keys["feeder"], broker_key=keys["broker"]),
    }
    for credentials in refusals.values():         # the keys say what each case is
        with pytest.raises(BrokerError, match="no answer"):
            BatchStream(broker.ranks, stream="secure", timeout=5, **credentials).close()
    # the keyless BatchStream above may have been counted as a handshake cut short: one that waits is named no_key
    signature = send_keyless_greeting(broker.ranks)
    assert signature[:1] == b"\xff" and signature[9:] == b"\x7f", signature
    wait_for(lambda: rejected(broker, keys).get("auth_no_key", 0) >= 1, 30, "the keyless greeting counted as no_key")
    with ControlClient(broker.control, 2, key=keys["rank"], broker_key=keys["broker"]) as rank_as_feeder:
        with pytest.raises(BrokerError, match="no reply"):
            rank_as_feeder.hello("feeder", "secure")
    report = feed(labelled_frame(spark, rows=5_000, partitions=2), broker.feed, stream="secure", batch_size=250,
                  timeout=60, key=keys["feeder"], broker_key=keys["broker"])
    consumer.join(60)
    assert "error" not in got, got.get("error")
    np.testing.assert_array_equal(np.sort(got["ids"]), np.arange(5_000))
    assert report.rows == 5_000
    refused = rejected(broker, keys)
    assert refused.get("auth_unknown_key", 0) >= 1 and refused.get("auth_wrong_role", 0) >= 1
    assert refused.get("auth_no_key", 0) >= 1
    log = broker.log.read_text()
    assert "refused on the ranks socket (unknown_key): peer 127.0.0.1" in log


def scrape(url):
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_over_http_match_what_the_ranks_received(spark, start_broker_process):
    broker = start_broker_process("--metrics-port", "0", "--heartbeat", "200ms")
    url = json.loads(broker.ready_file.read_text())["metrics"]
    got = {}
    with BatchStream(broker.ranks, stream="watched", timeout=60) as stream:
        consumer = threading.Thread(target=lambda: got.update(
            batches=sum(1 for _ in stream.epoch())))
        consumer.start()
        report = feed(labelled_frame(spark, rows=6_000, partitions=3), broker.feed, stream="watched",
                      batch_size=500, timeout=60)
        consumer.join(60)
        epoch = {"stream": "watched"}      # no epoch label: the stream's counters add up its epochs

        def settled():
            samples = scrape(url)
            key = ("sparkbus_batches_acked_total", tuple(sorted(epoch.items())))
            delivered = ("sparkbus_epochs_delivered_total", tuple(sorted(epoch.items())))
            return samples.get(key) == got["batches"] and samples.get(delivered) == 1 and samples

        from harness import wait_for
        samples = wait_for(settled, 10, "the published figures to catch up with the rank")
    labels = tuple(sorted(epoch.items()))
    assert samples[("sparkbus_rows_in_total", labels)] == 6_000 == report.rows
    assert samples[("sparkbus_batches_in_total", labels)] == got["batches"] == report.batches == 12
    assert samples[("sparkbus_batches_out_total", labels)] == 12
    assert samples[("sparkbus_partitions_committed", labels)] == 3
    assert samples[("sparkbus_epoch", labels)] == 0          # the last epoch, once none is in progress
    rank = tuple(sorted({"stream": "watched", "rank": "0"}.items()))
    assert samples[("sparkbus_rank_batches_consumed_total", rank)] == 12
    assert samples[("sparkbus_rank_first_batch_seconds", rank)] > 0


def test_status_watch_redraws_each_rank_until_interrupted(spark, start_broker_process, children):
    import signal
    import subprocess
    import sys
    import time

    broker = start_broker_process()
    with BatchStream(broker.ranks, stream="looked", timeout=60) as stream:
        consumer = threading.Thread(target=lambda: sum(1 for _ in stream.epoch()))
        consumer.start()
        feed(labelled_frame(spark, rows=1_000, partitions=1), broker.feed, stream="looked", batch_size=100,
             timeout=60)
        consumer.join(60)
        watcher = children.spawn([sys.executable, "-m", "sparkbus.broker.cli", "status", "--watch", "--interval", "0.2",
                                  broker.control], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env={"COLUMNS": "160"})
        time.sleep(1.0)               # the behaviour under test: it keeps redrawing (5 intervals) until Ctrl-C
        assert watcher.poll() is None, watcher.communicate(timeout=5)
        watcher.send_signal(signal.SIGINT)
        out, err = children.finish(watcher, 10, "sparkbus status --watch after Ctrl-C")
    assert watcher.returncode == 0, err
    assert "wait share" in out and "looked" in out
    assert f"{broker.control}: buffer" in out
