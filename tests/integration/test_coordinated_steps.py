"""Coordinated buckets across ranks (``feed(bucket_by=, bucket_bounds=)``), end to end: Spark in local mode, a broker
started through its CLI, two ranks with granted steps (tests/integration/bucket_rank.py). Every step's two batches
hold rows of one bucket (the epoch's remainder step excepted), every row arrives once, the steps are equal; and a
batch whose ``bucket`` is out of range is refused as malformed, counted, and the broker serves on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from sparkbus.broker.client import ControlClient
from sparkbus.feeder import feed
from sparkbus.launch.mpi import loopback_env
from sparkbus.wire import codec
from sparkbus.wire.protocol import Kind

from harness import Children, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RANK = Path(__file__).resolve().parent / "bucket_rank.py"
BOUNDS = (8, 32)
PARTITIONS, ROWS_PER_PARTITION, BATCH_SIZE = 3, 90, 10


def bucket_of(length: int) -> int:
    return sum(length > b for b in BOUNDS)


def documents(spark):
    """90 rows a partition: 40 of lengths 1-7 (bucket 0), 20 of 10-29 (bucket 1), 30 of 40-89 (bucket 2). In batches
    of 10 rows: 4, 2 and 3 a partition, 12, 6 and 9 in all: 13 steps of one bucket, and one batch of bucket 2 left
    over, the epoch's remainder, shared out by rows."""
    length = ("case when id % 90 < 40 then 1 + id % 7 when id % 90 < 60 then 10 + id % 20 "
              "else 40 + id % 50 end")
    return spark.range(PARTITIONS * ROWS_PER_PARTITION, numPartitions=PARTITIONS).selectExpr(
        "id", f"array_repeat(cast(id as int), cast({length} as int)) as tokens")


def start_ranks(children: Children, address: str, stream: str, out: Path) -> list[subprocess.Popen]:
    return [children.spawn([sys.executable, RANK, "--ranks", address, "--stream", stream, "--group", f"{r}/2",
                            "--out", out, "--timeout", "60"], env=loopback_env(), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True) for r in range(2)]


def test_each_step_of_two_ranks_holds_one_bucket_and_every_row_arrives_once(spark, start_broker_process, children,
                                                                            tmp_path):
    broker = start_broker_process()
    procs = start_ranks(children, broker.ranks, "coordinated", tmp_path)
    wait_for(lambda: len(broker.stats()["streams"].get("coordinated", {}).get("ranks", [])) == 2, 60,
             "both ranks to join")
    report = feed(documents(spark), broker.feed, stream="coordinated", batch_size=BATCH_SIZE, columns=["id", "tokens"],
                  ragged=["tokens"], bucket_by="tokens", bucket_bounds=BOUNDS, timeout=60)
    assert report.rows == PARTITIONS * ROWS_PER_PARTITION
    for proc in procs:
        _, err = Children.finish(proc, 90, "a rank")
        assert proc.returncode == 0, err[-3000:]
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(2)]
    assert len(steps[0]) == len(steps[1]) == 14, "equal steps: 13 of one bucket, then the remainder"
    for i, (a, b) in enumerate(zip(*steps)):
        buckets = {bucket_of(n) for n in a["lengths"] + b["lengths"]}
        if i < 13:
            assert len(buckets) == 1 and len(a["ids"]) == len(b["ids"]) == BATCH_SIZE, (i, a, b)
        else:                    # the remainder: one batch of bucket 2 cut by rows into a piece for each rank
            assert buckets == {2} and len(a["ids"]) + len(b["ids"]) == BATCH_SIZE, (i, a, b)
    per_bucket = [sum(1 for s in steps[0][:13] if bucket_of(s["lengths"][0]) == k) for k in range(3)]
    assert per_bucket == [6, 3, 4]
    ids = np.sort([n for rank in steps for s in rank for n in s["ids"]])
    np.testing.assert_array_equal(ids, np.arange(PARTITIONS * ROWS_PER_PARTITION))
    epoch = broker.stats()["streams"]["coordinated"]["epochs"]["0"]
    assert (epoch["steps"], epoch["dropped"], epoch["cut"], epoch["pieces"]) == (14, 0, 1, 2)


def test_a_bucket_out_of_range_is_refused_as_malformed_and_counted(start_broker_process, sockets):
    broker = start_broker_process()
    with ControlClient(broker.control, 10) as control:
        control.request(Kind.EPOCH_OPEN, stream="bad", epoch=0, partitions=1, delivery="stream")
    push = sockets(zmq.PUSH, broker.feed)
    values = {"x": np.arange(4)}
    bad = [codec.encode_batch("bad", 0, 0, 0, values, bucket=64),
           codec.encode_batch("bad", 0, 0, 1, values, bucket=-1),
           codec.encode_batch("bad", 0, 0, 2, values, splits=[2, 2], bucket=0)]
    typed = codec.encode_batch("bad", 0, 0, 3, values)
    header = msgpack.unpackb(typed[0])
    header["bucket"] = "0"
    bad.append([msgpack.packb(header), *typed[1:]])
    for frames in bad:
        push.send_multipart(frames)
    push.send_multipart(codec.encode_batch("bad", 0, 0, 4, values, bucket=3))
    wait_for(lambda: broker.stats()["streams"]["bad"]["epochs"]["0"]["batches_in"] == 1, 20, "the good batch")
    rejected = broker.stats()["broker"]["rejected"]
    assert rejected["feed"] == {"malformed": 4}, rejected


def test_two_brokers_each_coordinate_their_own_batches_and_every_row_arrives_once(spark, start_broker_process,
                                                                                  children, tmp_path):
    brokers = [start_broker_process(), start_broker_process()]
    procs = start_ranks(children, ",".join(b.ranks for b in brokers), "two", tmp_path)
    feed(documents(spark), [b.feed for b in brokers], stream="two", batch_size=BATCH_SIZE, columns=["id", "tokens"],
         ragged=["tokens"], bucket_by="tokens", bucket_bounds=BOUNDS, timeout=60)
    for proc in procs:
        _, err = Children.finish(proc, 90, "a rank")
        assert proc.returncode == 0, err[-3000:]
    steps = [json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(2)]
    assert len(steps[0]) == len(steps[1]), "equal steps"
    ids = np.sort([n for rank in steps for s in rank for n in s["ids"]])
    np.testing.assert_array_equal(ids, np.arange(PARTITIONS * ROWS_PER_PARTITION))
    granted = [b.stats()["streams"]["two"]["epochs"]["0"]["steps"] for b in brokers]
    assert sum(granted) == len(steps[0]) and min(granted) > 0
    # each broker's groups are of one bucket; a rank's i-th step may come from either broker (docs/DECISIONS.md)
    for rank in steps:
        assert all(len({bucket_of(n) for n in s["lengths"]}) == 1 for s in rank if len(s["ids"]) == BATCH_SIZE)
