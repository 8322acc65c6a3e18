"""Mistakes fail fast and say what to do: an address where nothing listens, an epoch fed twice, a feed and its
ranks on different streams. Each with its message and an upper bound on its delay (generous: a loaded machine),
through a real broker process and, where the check is that no Spark job ran, a real Spark session."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time

import pytest

from sparkbus.broker.client import ControlClient
from sparkbus.feeder import NoRanksWarning, feed
from sparkbus.wire.errors import BrokerError, BrokerUnreachable
from sparkbus.wire.protocol import Kind
from sparkbus.worker import BatchStream

from harness import free_port_triple
from sources import labelled_frame

pytestmark = pytest.mark.timeout(90)

PROMPT = 15.0       # "within about 5 s", with room for a loaded machine


class NoJobs:
    """An RDD stand-in that fails the test if the feed touches it: what is checked before Spark is checked first."""

    def mapPartitionsWithIndex(self, *args, **kwargs):      # noqa: N802 (the RDD's name)
        raise AssertionError("the feed built its Spark job before its checks")


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """The child's stderr lines, read by a thread as they come (``None`` at its end)."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r} within {timeout:g} s; stderr:\n{''.join(seen)[-3000:]}")


def test_a_feed_to_a_refused_address_fails_fast_naming_the_address_typed_and_the_derived_one():
    port = free_port_triple()
    address = f"tcp://127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(BrokerUnreachable) as refused:
        feed(NoJobs(), address, stream="s")           # timeout: the default 60 s
    took = time.monotonic() - started
    message = str(refused.value)
    assert f"no sparkbus broker at {address}: its control address tcp://127.0.0.1:{port + 2} (the feed port + 2) " \
           f"refused every connection for 3 s" in message
    assert "Start the broker" in message and "control=" in message
    assert 2.5 < took < PROMPT, took
    # a control address given with control= is named as given
    control = f"tcp://127.0.0.1:{free_port_triple()}"
    with pytest.raises(BrokerUnreachable, match=re.escape(f"the control address {control} (given with control=, "
                                                          f"for the feed address {address})")):
        feed(NoJobs(), address, stream="s", control=control)


def test_a_refused_address_fails_the_feed_before_spark_runs_a_job(spark):
    from pyspark.sql import functions as F

    tracker = spark.sparkContext.statusTracker()
    # a shuffle below the feed: planning its RDD would run the map stage (adaptive execution)
    df = labelled_frame(spark, 100, 2).groupBy((F.col("id") % 7).alias("id")).agg(F.count("*").alias("n"))
    jobs = set(tracker.getJobIdsForGroup())
    address = f"tcp://127.0.0.1:{free_port_triple()}"
    started = time.monotonic()
    with pytest.raises(BrokerUnreachable, match=f"no sparkbus broker at {address}: its control address"):
        feed(df, address, stream="s")
    assert time.monotonic() - started < PROMPT
    assert set(tracker.getJobIdsForGroup()) == jobs, "a Spark job ran before the broker was found absent"


def test_a_connected_but_slow_broker_keeps_the_timeout():
    """A peer that accepts connections and never answers (a broker stopped with SIGSTOP, say) is waited for."""
    import zmq

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)
    silent.linger = 0
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        started = time.monotonic()
        with pytest.raises(BrokerError, match="no reply from the sparkbus broker") as caught:
            feed(NoJobs(), "tcp://127.0.0.1:1", stream="s", control=f"tcp://127.0.0.1:{port}", timeout=5)
        assert not isinstance(caught.value, BrokerUnreachable)
        assert 4.5 < time.monotonic() - started < PROMPT
    finally:
        silent.close()
        context.term()


def test_an_epoch_delivered_and_a_stream_name_refused_are_refused_before_any_job(start_broker_process):
    broker = start_broker_process()
    with BatchStream(broker.ranks, stream="s", timeout=10) as rank, ControlClient(broker.control, 10) as control:
        control.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=0, delivery="stream")
        control.request(Kind.EPOCH_CLOSE, stream="s", epoch=0, partitions=0)
        assert list(rank.epoch()) == []                # delivered: its end reached the rank
    with pytest.raises(BrokerError, match="stream 's' has already delivered epoch 0; feed a new epoch number"):
        feed(NoJobs(), broker.feed, stream="s", epoch=0)
    with pytest.raises(BrokerError, match="a stream name must have 1 to 256 characters"):
        feed(NoJobs(), broker.feed, stream="x" * 300)


RANK_WITHOUT_BROKER = """
import logging, sys
import sparkbus.worker.connection as connection
from sparkbus import BatchStream, BrokerError
if sys.argv[2] == "basic":
    logging.basicConfig()
connection.UNANSWERED_REPEAT = 0.5      # the test's patience: 30 s by default
try:
    BatchStream(sys.argv[1], timeout=7)
except BrokerError as exc:
    print("failed:", exc, file=sys.stderr)
"""


def test_a_rank_whose_broker_does_not_answer_warns_naming_it_and_again_until_its_timeout():
    """With no logging set up (Python's last resort handler prints warnings) and with ``logging.basicConfig()``."""
    address = f"tcp://127.0.0.1:{free_port_triple() + 1}"
    ranks = {setup: subprocess.Popen([sys.executable, "-c", RANK_WITHOUT_BROKER, address, setup],
                                     stderr=subprocess.PIPE, text=True) for setup in ("none", "basic")}
    for setup, rank in ranks.items():
        _, stderr = rank.communicate(timeout=60)
        warned = re.findall(rf"rank 0: no answer from a sparkbus broker at {re.escape(address)} after (\d+) s: is "
                            r"it running, and is this its ranks address \(the feed port \+ 1\)\? Trying until its "
                            r"timeout", stderr)
        assert warned, (setup, stderr)
        assert 4 <= int(warned[0]) <= PROMPT and len(warned) >= 2, warned      # then again, every UNANSWERED_REPEAT
        assert f"failed: no answer from a sparkbus broker at {address} within 7 s" in stderr, stderr


RANK_ON_STREAM_A = """
import sys
from sparkbus import BatchStream
with BatchStream(sys.argv[1], stream="a", timeout=60) as stream:
    print("joined", file=sys.stderr, flush=True)
    for batch in stream.epoch():
        pass
"""


def test_a_rank_waiting_on_one_stream_is_told_the_streams_that_hold_data_no_rank_reads(start_broker_process):
    broker = start_broker_process()
    rank = subprocess.Popen([sys.executable, "-c", RANK_ON_STREAM_A, broker.ranks], stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = lines_of(rank)
        wait_for_line(lines, "joined", 30)
        with ControlClient(broker.control, 10) as control:      # a feed of stream "b": an epoch closed
            control.request(Kind.EPOCH_OPEN, stream="b", epoch=0, partitions=0, delivery="stream")
            control.request(Kind.EPOCH_CLOSE, stream="b", epoch=0, partitions=0)
        closed = time.monotonic()
        line = wait_for_line(lines, "no rank reads", PROMPT)
        assert time.monotonic() - closed < PROMPT
        assert (f"rank 0 waits for an epoch of stream 'a' at the broker {broker.ranks}, which holds data of streams "
                f"that no rank reads: 'b'. Is the feed's stream= the same as the ranks' stream=?") in line
    finally:
        rank.kill()
        rank.communicate(timeout=10)
    assert "stream 'b' epoch 0 is closed, but no rank reads stream 'b' (ranks read: 'a')" in broker.log.read_text()


def test_a_feed_on_a_stream_no_rank_reads_warns_after_its_grace(spark, start_broker_process):
    broker = start_broker_process()
    with BatchStream(broker.ranks, stream="a", timeout=60):
        started = time.monotonic()
        with pytest.warns(NoRanksWarning, match=re.escape(
                f"stream 'b' epoch 0 is fed, but no rank reads stream 'b' at {broker.control} (ranks read 'a') 5 s "
                f"after the feed began")):
            report = feed(labelled_frame(spark, 200, 2), broker.feed, stream="b", batch_size=50)
        took = time.monotonic() - started
    assert report.rows == 200
    assert 5 <= took < 5 + 2 * PROMPT, took        # the grace, and the job itself


def test_ranks_that_read_a_short_epoch_and_left_before_its_close_are_no_mistake(spark, start_broker_process):
    """An epoch the ranks read whole and left before the feed closed it (nobody reads the stream any more) was
    delivered: no NoRanksWarning."""
    import warnings

    from sparkbus.feeder.driver import warn_if_no_ranks

    broker = start_broker_process()
    ids: list[int] = []

    def read() -> None:
        with BatchStream(broker.ranks, stream="short", timeout=60) as stream:
            ids.extend(int(i) for batch in stream.epoch() for i in batch["id"])

    reader = threading.Thread(target=read)
    reader.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoRanksWarning)
        feed(labelled_frame(spark, 200, 2), broker.feed, stream="short", batch_size=50)
        reader.join(60)
        assert sorted(ids) == list(range(200))
        with ControlClient(broker.control, 10) as client:
            assert client.hello("feeder", "short")["ranks"] == 0          # the reader has left the stream
            warn_if_no_ranks([client], set(), "short", 0, time.monotonic() - 60)      # past the grace: no warning
