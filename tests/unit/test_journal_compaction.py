"""A standing broker's journal stays bounded (broker/journal.py compaction) and a restart still knows every epoch
it delivered: a re-feed of any of them is refused, its late batches counted as late duplicates."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import msgpack
import pytest

from sparkbus.broker.books import Outcome
from sparkbus.broker.journal import DeliveredEpochs, EpochRanges, Journal
from sparkbus.broker.ledger import Ledger, Rejected
from sparkbus.wire import codec, protocol
from sparkbus.wire.errors import ProtocolError

PREFIX = struct.Struct("<II")


def hello(stream):
    return {"req": 1, "role": "rank", "stream": stream, "rank": 0, "size": 1, "even": False, "session": "",
            "resume": False, "ended": -1}


def deliver_empty_epoch(ledger: Ledger, stream: str, epoch: int) -> None:
    """Open, close and deliver an epoch of no partitions: it retires at once (the cheapest full epoch)."""
    ledger.open_epoch(stream, epoch, 0, "stream")
    ledger.close_epoch(stream, epoch, 0)
    ledger.dispatch(ledger.streams[stream], lambda identity, frames: Outcome.SENT)
    assert epoch in ledger.streams[stream].finished and epoch not in ledger.streams[stream].epochs


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def late_batch(stream, epoch):
    frames = codec.encode_batch(stream, epoch, 0, 0, {"x": __import__("numpy").arange(2, dtype="<i8")}, attempt=9)
    return protocol.unpack_header(frames[0]), frames


def assert_refuses_again(ledger: Ledger, stream: str, epoch: int) -> None:
    with pytest.raises(ProtocolError, match="already delivered epoch"):
        ledger.open_epoch(stream, epoch, 0, "stream")
    header, frames = late_batch(stream, epoch)
    with pytest.raises(Rejected) as late:
        ledger.accept_batch(header, frames)
    assert late.value.reason == "late_duplicate"


def test_two_thousand_epochs_keep_the_journal_small_and_a_restart_knows_each_one(tmp_path, monkeypatch):
    # 6,000 real fsyncs take half a minute on this disk; what is under test is the size and the replay
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    journal = Journal(tmp_path, compact_at=200, keep_stats=16)
    live = Ledger(journal)
    streams = ("train", "val")
    for stream in streams:
        live.join_rank(stream.encode(), hello(stream))
    largest = 0
    for epoch in range(1000):
        for stream in streams:                 # interleaved, as two jobs on one broker
            deliver_empty_epoch(live, stream, epoch)
        largest = max(largest, directory_bytes(tmp_path))
    figures = live.streams["train"].finished.figures[999]
    uncompacted = 2000 * len(_record({"stream": "train", "epoch": 999, "stats": figures}))
    # 200 records at most between compactions: about a tenth of what 2,000 records would take
    assert largest < uncompacted / 5, (largest, uncompacted)
    live.open_epoch("train", 1000, 1, "stream")           # an epoch in progress survives beside the compaction
    journal.close()

    again = Ledger(Journal(tmp_path, compact_at=200, keep_stats=16))
    again.replay()
    for stream in streams:
        finished = again.streams[stream].finished
        assert all(epoch in finished for epoch in range(1000)) and 1000 not in finished
        kept = sorted(finished.figures)           # the epochs that kept their figures: the last ones
        assert kept == list(range(1000 - len(kept), 1000)) and 16 <= len(kept) <= 200
        assert finished.figures[999] == live.streams[stream].finished.figures[999]
    for epoch in (0, 1, 500, 983, 999):
        assert_refuses_again(again, "train", epoch)
    assert list(again.streams["train"].epochs) == [1000]
    again.open_epoch("val", 1000, 0, "stream")            # a new epoch is welcome

    third = Ledger(Journal(tmp_path, compact_at=200, keep_stats=16))   # a restart of a restart, after more work
    again.join_rank(b"val", hello("val"))
    again.close_epoch("val", 1000, 0)
    again.dispatch(again.streams["val"], lambda identity, frames: Outcome.SENT)
    third.replay()
    assert all(epoch in third.streams["val"].finished for epoch in range(1001))


def _record(record):
    body = msgpack.packb(record, use_bin_type=True)
    return PREFIX.pack(len(body), zlib.crc32(body)) + body


def retired_records(directory: Path) -> list[dict]:
    return list(Journal(directory).retired())


def test_compaction_keeps_ranges_and_the_last_figures_per_stream_in_crc_checked_records(tmp_path):
    journal = Journal(tmp_path, compact_at=10, keep_stats=3)
    for epoch in [0, 1, 2, 3, 5, 6, 7, 9, 10, 11]:
        journal.record_retired("s", epoch, {"batches_out": epoch})
    journal.record_retired("t", 4, {"batches_out": 4})        # the 11th record: compaction
    records = retired_records(tmp_path)
    assert records == [{"stream": "s", "delivered": [[0, 3], [5, 7]]},
                       {"stream": "s", "epoch": 9, "stats": {"batches_out": 9}},
                       {"stream": "s", "epoch": 10, "stats": {"batches_out": 10}},
                       {"stream": "s", "epoch": 11, "stats": {"batches_out": 11}},
                       {"stream": "t", "epoch": 4, "stats": {"batches_out": 4}}]
    assert (tmp_path / "retired.log").read_bytes() == b"".join(_record(r) for r in records)
    assert not (tmp_path / "retired.log.tmp").exists()
    journal.record_retired("s", 12, {"batches_out": 12})      # appended after a compaction as before
    assert retired_records(tmp_path)[-1] == {"stream": "s", "epoch": 12, "stats": {"batches_out": 12}}


def test_a_compacted_log_is_compacted_again_and_the_ranges_merge(tmp_path):
    journal = Journal(tmp_path, compact_at=4, keep_stats=1)
    for epoch in range(30):
        journal.record_retired("s", epoch, {})
    records = retired_records(tmp_path)
    delivered = [r for r in records if "delivered" in r]
    assert len(delivered) == 1 and delivered[0]["delivered"][0][0] == 0
    assert len(records) <= 8
    epochs = EpochRanges(delivered[0]["delivered"])
    for r in records:
        if "epoch" in r:
            epochs.add(r["epoch"])
    assert epochs.ranges() == [[0, 29]]


def test_an_old_journal_without_compaction_is_compacted_when_it_grows_past_the_limit(tmp_path):
    (tmp_path / "retired.log").write_bytes(b"".join(_record({"stream": "s", "epoch": n, "stats": {}})
                                                    for n in range(50)))
    journal = Journal(tmp_path, compact_at=20, keep_stats=5)
    journal.record_retired("s", 50, {})
    records = retired_records(tmp_path)
    assert records[0] == {"stream": "s", "delivered": [[0, 45]]} and len(records) == 6


def test_a_leftover_temporary_file_from_a_crash_in_a_compaction_is_ignored_and_replaced(tmp_path):
    (tmp_path / "retired.log.tmp").write_bytes(b"half a compaction")
    journal = Journal(tmp_path, compact_at=2, keep_stats=1)
    for epoch in range(3):
        journal.record_retired("s", epoch, {})
    assert retired_records(tmp_path)[0] == {"stream": "s", "delivered": [[0, 1]]}
    assert not (tmp_path / "retired.log.tmp").exists()


def test_a_torn_tail_is_cut_before_a_compaction_reads_the_log(tmp_path):
    whole = b"".join(_record({"stream": "s", "epoch": n, "stats": {}}) for n in range(5))
    (tmp_path / "retired.log").write_bytes(whole + _record({"stream": "s", "epoch": 5, "stats": {}})[:-3])
    journal = Journal(tmp_path, compact_at=5, keep_stats=2)
    journal.record_retired("s", 6, {})
    records = retired_records(tmp_path)
    assert records[0] == {"stream": "s", "delivered": [[0, 3]]}        # 5 was torn: never retired
    assert [r["epoch"] for r in records[1:]] == [4, 6]


def test_epoch_ranges_merge_neighbours_and_answer_membership():
    ranges = EpochRanges([[10, 12], [0, 2]])
    for epoch in (5, 4, 3):
        ranges.add(epoch)
    assert ranges.ranges() == [[0, 5], [10, 12]]
    ranges.add_range(6, 9)
    assert ranges.ranges() == [[0, 12]] and len(ranges) == 13
    assert 0 in ranges and 12 in ranges and 13 not in ranges and -1 not in ranges and "3" not in ranges
    with pytest.raises(ValueError):
        EpochRanges([[3, 1]])
    with pytest.raises(ValueError):
        EpochRanges([[0, "9"]])


def test_delivered_epochs_keep_figures_of_the_last_ones_and_know_all():
    delivered = DeliveredEpochs([[0, 9]], keep=2)
    for epoch in (10, 11, 12):
        delivered.add(epoch, {"batches_out": epoch})
    assert delivered.figures == {11: {"batches_out": 11}, 12: {"batches_out": 12}}
    assert all(e in delivered for e in range(13)) and 13 not in delivered
    assert delivered.ranges.ranges() == [[0, 10]] and delivered.delivered == 13
    assert DeliveredEpochs(figures={1: {}, 2: {}}, keep=None).figures == {1: {}, 2: {}}
    # a resume forgets one epoch (with figures or in a range), or every epoch after one
    assert delivered.forget(5) and not delivered.forget(5) and delivered.ranges.ranges() == [[0, 4], [6, 10]]
    assert delivered.forget(12) and 12 not in delivered and 11 in delivered
    delivered.forget_after(3)
    assert delivered.ranges.ranges() == [[0, 3]] and delivered.figures == {} and delivered.delivered == 4
