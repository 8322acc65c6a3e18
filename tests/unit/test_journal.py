"""The journal and `Ledger.replay`, on a temporary directory: what a restarted broker rebuilds from disk.

The rule under test: a replay rebuilds what the journal holds, as the live ledger had it (what is not journaled
on purpose: ranks and their windows, deferred PARTITION_ENDs, and whether EPOCH_END went out), packs of small
batches counting their batches as live; a torn or damaged record and everything after it replay as if never
written, and what the restarted broker journals next is read back at the restart after that.
"""

from __future__ import annotations

import os
import shutil
import struct
import zlib
from pathlib import Path

import msgpack
import pytest

from sparkbus.broker.journal import Record
from sparkbus.broker.ledger import Ledger, Rejected
from sparkbus.wire import protocol
from sparkbus.wire.errors import ProtocolError
from sparkbus.wire.protocol import Kind

from harness import STREAM, Wire, ack, batch_frames, end, hello, join, nbytes, push, window

PREFIX = struct.Struct("<II")      # a record: body length, CRC-32 of the body, then the msgpack body


def epoch_files(directory, epoch=0, stream=STREAM):
    folder = Path(directory) / stream.encode().hex()
    return folder / f"epoch-{epoch}.log", folder / f"epoch-{epoch}.data"


def snapshot(ledger):
    """What a journal must preserve, comparable across a restart.

    Batches in flight to a rank count as waiting (a restart loses the ranks, so they are queued again), in no
    particular order; each with its frames' bytes, so that payloads read back from the data file are checked too,
    and with the number of batches it carries (a pack, several). ``batches_out`` counts, as after a restart, only
    what was acknowledged.
    """
    inflight = {i: b for r in ledger.ranks.values() for i, b in r.inflight.items()}
    streams = {}
    for name, stream in ledger.streams.items():
        epochs = {}
        for number, ep in stream.epochs.items():
            waiting = [b for b in ep.queue] + [b for i, b in inflight.items() if i[0] == number]
            out = sum(b.count for i, b in inflight.items() if i[0] == number)
            epochs[number] = {
                "partitions": ep.partitions, "delivery": ep.delivery, "committed": sorted(ep.committed),
                "closed": ep.closed, "batches_in": ep.batches_in, "bytes_in": ep.bytes_in, "rows_in": ep.rows_in,
                "batches_out": ep.batches_out - out, "acked": ep.acked, "duplicates": ep.duplicates,
                "diverged": ep.diverged, "claims": ep.claims,
                "waiting": {b.id: ([bytes(f) for f in b.frames], b.count) for b in waiting},
                "parts": {p: {"attempts": {a: sorted(s) for a, s in part.attempts.items()},
                              "committed_attempt": part.committed_attempt, "checksums": part.checksums,
                              "held": {a: {b.id: [bytes(f) for f in b.frames] for b in held}
                                       for a, held in part.held.items()},
                              "diverged": part.diverged}
                          for p, part in ep.parts.items()
                          if part.attempts or part.committed_attempt is not None},   # not just a pending end
            }
        for number, ep in stream.epochs.items():
            rec = ep.recovery
            epochs[number]["recovery"] = rec and (rec.carries.pairs(), rec.recovered.pairs(), rec.lost, rec.reset,
                                                  sorted(b.id for b in rec.held), rec.matched)
        streams[name] = {"epochs": epochs, "finished": stream.finished.figures, "reclaims": stream.reclaims,
                         "awaiting_reset": stream.awaiting_reset}
    return {"streams": streams, "buffered": ledger.buffered, "held_bytes": ledger.held_bytes}


def record_bounds(log: Path) -> list[tuple[int, int]]:
    """``(start, end)`` of each record in a journal log."""
    raw, offset, bounds = log.read_bytes(), 0, []
    while offset < len(raw):
        length, _ = PREFIX.unpack_from(raw, offset)
        bounds.append((offset, offset + PREFIX.size + length))
        offset += PREFIX.size + length
    return bounds


def record_at(log: Path, start: int, stop: int) -> dict:
    return msgpack.unpackb(log.read_bytes()[start + PREFIX.size:stop], raw=False)


def raw_record(body: object) -> bytes:
    packed = msgpack.packb(body, use_bin_type=True)
    return PREFIX.pack(len(packed), zlib.crc32(packed)) + packed


class Script:
    """A live journaled ledger with a rank, driven through every kind of transition."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.wire = Wire(ledger)

    def steps(self, delivery: str):
        """``(name, step)`` pairs; each step is one transition (or a refusal, which must leave no trace)."""
        ledger, wire = self.ledger, self.wire

        def refused(step):
            def run():
                with pytest.raises(Rejected):
                    step()
            return run

        def deliver(batches):
            window(ledger, b"r", batches)
            wire.dispatch()

        def claim(part, broker):
            return {"req": 1, "stream": STREAM, "epoch": 0, "part": part, "broker": broker}

        return [
            ("open", lambda: ledger.open_epoch(STREAM, 0, 2, delivery)),
            ("open again, same terms", lambda: ledger.open_epoch(STREAM, 0, 2, delivery)),
            ("partition claimed by a broker", lambda: ledger.claim_partition(claim(1, 2))),
            ("claimed again: the first claim holds", lambda: ledger.claim_partition(claim(1, 0))),
            ("batch kept", lambda: push(ledger, 0, 0, 0, attempt=0, journalled=True)),
            ("batch of another attempt", lambda: push(ledger, 0, 0, 0, attempt=1, journalled=True)),
            ("batch diverging", lambda: push(ledger, 0, 0, 1, attempt=1, salt=3, journalled=True)),
            ("batch kept, second seq", lambda: push(ledger, 0, 0, 1, attempt=0, journalled=True)),
            ("replayed seq refused", refused(lambda: push(ledger, 0, 0, 1, attempt=0, journalled=True))),
            ("unknown epoch refused", refused(lambda: push(ledger, 7, 0, 0, journalled=True))),
            ("out of range refused", refused(lambda: push(ledger, 0, 2, 0, journalled=True))),
            ("commit refused: another count", lambda: end(ledger, 0, 0, 1, 1)),
            ("commit", lambda: end(ledger, 0, 0, 0, 2)),
            ("partition end deferred", lambda: end(ledger, 0, 1, 2, 2)),
            ("pack of the deferred attempt", lambda: push(ledger, 0, 1, 0, attempt=2, splits=[2, 3], journalled=True)),
            ("batch completing a deferred commit", lambda: push(ledger, 0, 1, 1, attempt=2, journalled=True)),
            ("batch after the commit", lambda: push(ledger, 0, 1, 1, attempt=4, journalled=True)),
            ("partition end of a committed partition", lambda: end(ledger, 0, 1, 4, 7)),
            ("rank joins", lambda: join(ledger, b"r", hello())),
            ("window of two: two sent", lambda: deliver(2)),
            ("ack", lambda: ack(ledger, b"r", wire.to(b"r")[:1])),
            ("a rank's reclaim of a loss", lambda: ledger.reclaim(
                ledger.rank(b"r"), {"stream": STREAM, "epoch": 0, "lost": "gone", "entries": 1}, [(1, 5, 0, 1, 7)])),
            ("recovered", lambda: ledger.recover_epoch(
                {"req": 1, "stream": STREAM, "epoch": 0, "partitions": 2, "delivery": delivery,
                 "carries": protocol.pack_ranges([0, 1]), "recovered": protocol.pack_ranges([]),
                 "lost": ["gone"], "reset": False})),
            ("close", lambda: ledger.close_epoch(STREAM, 0, 2)),
            ("window of ten: the rest sent", lambda: deliver(10)),
            ("second epoch opened", lambda: ledger.open_epoch(STREAM, 1, 1, "stream")),
            ("its batch", lambda: push(ledger, 1, 0, 0, journalled=True)),
            ("acks of the rest", lambda: ack(ledger, b"r", wire.to(b"r")[1:])),
            ("ended and retired", wire.dispatch),
            ("window of one", lambda: deliver(1)),
        ]


@pytest.mark.parametrize("delivery", ["stream", "atomic"])
def test_every_transition_survives_a_restart_with_the_same_state(tmp_path, restart, journals, delivery):
    live = Ledger(journals(tmp_path))
    script = Script(live)
    for name, step in script.steps(delivery):
        step()
        assert snapshot(restart(tmp_path)) == snapshot(live), f"after {name!r}"
    finished = restart(tmp_path).streams[STREAM]
    assert list(finished.finished.figures) == [0] and list(finished.epochs) == [1]
    stats = finished.finished.figures[0]                     # partition 0: two batches; 1: a pack of two and one alone
    assert stats["batches_in"] == stats["batches_out"] == stats["acked"] == 5
    log, data = epoch_files(tmp_path, 0)
    assert not log.exists() and not data.exists()


def test_a_replayed_journal_delivers_what_was_not_acknowledged_and_retires_like_the_live_one(tmp_path, restart,
                                                                                               journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 1, "stream")
    for seq in range(3):
        push(live, 0, 0, seq, journalled=True)
    end(live, 0, 0, 0, 3)
    live.close_epoch(STREAM, 0, 1)
    wire = Wire(live)
    join(live, b"r", hello(), prefetch=2)
    wire.dispatch()
    ack(live, b"r", [(0, 0, 0)])                     # (0, 0, 1) is in flight when the broker dies

    again = restart(tmp_path)
    wire = Wire(again)
    join(again, b"r", hello(), prefetch=5)
    wire.dispatch()
    assert sorted(wire.to(b"r")) == [(0, 0, 1), (0, 0, 2)] and wire.ends == []
    ack(again, b"r", wire.to(b"r"))
    wire.dispatch()
    assert wire.ends == [(b"r", 0)]
    stats = again.streams[STREAM].finished.figures[0]
    assert stats["acked"] == 3 and stats["batches_in"] == 3
    assert again.buffered == 0
    assert restart(tmp_path).streams[STREAM].finished.figures[0] == stats


def test_a_rank_resuming_after_a_restart_keeps_its_packs_and_the_figures_count_their_batches(tmp_path, restart,
                                                                                             journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 1, "stream")
    push(live, 0, 0, 0, splits=[1, 1, 1], journalled=True)
    push(live, 0, 0, 1, splits=[2, 2], journalled=True)
    push(live, 0, 0, 2, journalled=True)
    push(live, 0, 0, 3, journalled=True)
    end(live, 0, 0, 0, 4)
    live.close_epoch(STREAM, 0, 1)
    h = dict(hello(), session="job")
    join(live, b"r", h, prefetch=3)
    Wire(live).dispatch()
    ack(live, b"r", [(0, 0, 0)])                     # journaled: three batches consumed
    # The broker dies. The rank consumed the second pack too (its ACK died with the broker) and holds the third.

    again = restart(tmp_path)
    ep = again.streams[STREAM].epochs[0]
    assert ep.batches_in == 7 and ep.acked == ep.batches_out == 3
    assert [(b.id, b.count) for b in ep.queue] == [((0, 0, 1), 2), ((0, 0, 2), 1), ((0, 0, 3), 1)]
    assert again.join_rank(b"r2", dict(h, resume=True), held=[(0, 0, 2)], consumed=[(0, 0, 1)]) == []
    rank = again.rank(b"r2")
    assert set(rank.inflight) == {(0, 0, 2)} and rank.inflight_bytes == nbytes(0, 0, 2) and rank.acked == 2
    assert ep.acked == 5 and ep.batches_out == 6 and [b.id for b in ep.queue] == [(0, 0, 3)]
    assert ep.given_twice == 0
    wire = Wire(again)
    window(again, b"r2", 1)                          # what it holds fills a window of one
    wire.dispatch()
    assert wire.sent == [] and wire.ends == []
    ack(again, b"r2", [(0, 0, 2)])
    wire.dispatch()
    assert wire.to(b"r2") == [(0, 0, 3)]
    ack(again, b"r2", [(0, 0, 3)])
    wire.dispatch()
    assert wire.ends == [(b"r2", 0)] and again.buffered == 0
    stats = again.streams[STREAM].finished.figures[0]
    assert stats["batches_in"] == stats["batches_out"] == stats["acked"] == 7 and stats["redelivered"] == 0
    assert restart(tmp_path).streams[STREAM].finished.figures[0] == stats


def test_several_streams_and_epochs_replay_side_by_side(tmp_path, restart, journals):
    live = Ledger(journals(tmp_path))
    for stream in ("train", "välidation/1"):
        for epoch in (0, 3):
            live.open_epoch(stream, epoch, 1, "atomic" if epoch else "stream")
            for seq in range(2):
                frames = batch_frames(epoch, 0, seq, stream=stream)
                live.accept_batch(protocol.unpack_header(frames[0]), frames, frames[0])
    end(live, 3, 0, 0, 2, stream="train")
    assert snapshot(restart(tmp_path)) == snapshot(live)
    assert [len(restart(tmp_path).streams[s].epochs[3].queue) for s in ("train", "välidation/1")] == [2, 0]


def test_a_journal_keeps_few_files_open_however_many_epochs_are_written_and_loses_nothing(tmp_path, restart,
                                                                                          journals):
    """Two descriptors an epoch would run a broker with hundreds of open epochs out of them: past
    ``max_open_files`` epochs, the least recently written one's files are closed, and opened again when written."""
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    live = Ledger(journals(tmp_path, max_open_files=2))
    for seq in range(3):                        # the epochs written in turn: each write past the first reopens
        for stream in ("train", "val"):
            for epoch in (0, 1, 2):
                if seq == 0:
                    live.open_epoch(stream, epoch, 1, "stream")
                frames = batch_frames(epoch, 0, seq, stream=stream)
                live.accept_batch(protocol.unpack_header(frames[0]), frames, frames[0])
                assert open_fds() <= before + 2 * 2
    end(live, 2, 0, 0, 3, stream="val")
    replayed = restart(tmp_path)
    assert snapshot(replayed) == snapshot(live)
    assert [len(replayed.streams[s].epochs[e].queue) for s in ("train", "val") for e in (0, 1, 2)] == [3] * 6


def test_an_epoch_whose_files_were_closed_unsynced_is_fsynced_on_time_all_the_same(tmp_path, journals,
                                                                                   monkeypatch):
    """Closing an epoch's files past ``max_open_files`` does not fsync them (that would be an fsync a write when
    more epochs are written in turn); the next ``sync_if_due`` does, as for the open ones."""
    from sparkbus.broker import journal as journal_module

    synced: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    live = Ledger(journals(tmp_path, max_open_files=1))
    for epoch in (0, 1):
        live.open_epoch(STREAM, epoch, 1, "stream")
    monkeypatch.setattr(os, "fsync", recording_fsync)
    for epoch in (0, 1):                 # epoch 0's batch written, then its files closed for epoch 1's
        frames = batch_frames(epoch, 0, 0)
        live.accept_batch(protocol.unpack_header(frames[0]), frames, frames[0])
    assert synced == []
    monkeypatch.setattr(journal_module, "ACK_SYNC_SECONDS", 0.0)
    live.journal.sync_if_due()
    assert sorted(synced) == ["epoch-0.data", "epoch-0.log", "epoch-1.data", "epoch-1.log"]


# ---- damaged journals --------------------------------------------------------------------------------------


def journal_without_retire(tmp_path, journals, delivery="stream") -> Path:
    """A journal directory holding one epoch, with records of every kind (the script up to before retiring)."""
    live = Ledger(journals(tmp_path / "journal"))
    for name, step in Script(live).steps(delivery):
        if name == "second epoch opened":
            break
        step()
    return tmp_path / "journal"


def damaged_copy(source: Path, target: Path, damage) -> Path:
    shutil.copytree(source, target)
    damage(*epoch_files(target))
    return target


@pytest.mark.parametrize("delivery", ["stream", "atomic"])
def test_a_torn_last_record_replays_as_if_it_was_never_written(tmp_path, restart, journals, delivery):
    journal = journal_without_retire(tmp_path, journals, delivery)
    log, _ = epoch_files(journal)
    bounds = record_bounds(log)
    assert {record_at(log, *b)["t"] for b in bounds} == {kind.value for kind in Record}, "a kind is not covered"
    for n, (start, stop) in enumerate(bounds):
        whole = damaged_copy(journal, tmp_path / f"whole-{n}", lambda log, data, at=start: os.truncate(log, at))
        expected = snapshot(restart(whole))
        for cut in sorted({start + 1, start + PREFIX.size - 1, start + PREFIX.size, start + PREFIX.size + 1,
                           stop - 1}):
            torn = damaged_copy(journal, tmp_path / f"torn-{n}-{cut}", lambda log, data, at=cut: os.truncate(log, at))
            assert snapshot(restart(torn)) == expected, f"record {n} cut at byte {cut - start}"
    assert snapshot(restart(journal)) != expected        # the last record did change something


def test_a_log_torn_in_its_first_record_leaves_no_epoch(tmp_path, restart, journals):
    journal = journal_without_retire(tmp_path, journals)
    torn = damaged_copy(journal, tmp_path / "torn", lambda log, data: os.truncate(log, 3))
    ledger = restart(torn)
    assert not ledger.streams.get(STREAM) or not ledger.streams[STREAM].epochs
    with pytest.raises(Rejected) as unknown:
        push(ledger, 0, 0, 0, journalled=True)
    assert unknown.value.reason == "unknown_epoch"


@pytest.mark.parametrize("where", ["body", "crc", "length"])
def test_a_record_that_fails_its_crc_stops_the_replay_there(tmp_path, restart, journals, where):
    journal = journal_without_retire(tmp_path, journals, "atomic")
    log, _ = epoch_files(journal)
    bounds = record_bounds(log)
    offset = {"body": PREFIX.size + 2, "crc": 5, "length": 0}[where]
    for n, (start, _stop) in enumerate(bounds):
        def flip(log, data, at=start + offset):
            raw = bytearray(log.read_bytes())
            raw[at] ^= 0x01
            log.write_bytes(bytes(raw))

        damaged = damaged_copy(journal, tmp_path / f"flipped-{n}", flip)
        prefix = damaged_copy(journal, tmp_path / f"prefix-{n}", lambda log, data, at=start: os.truncate(log, at))
        assert snapshot(restart(damaged)) == snapshot(restart(prefix)), f"record {n}"


def test_a_data_file_shorter_than_a_batchs_payload_stops_the_replay_at_that_batch(tmp_path, restart, journals):
    journal = journal_without_retire(tmp_path, journals)
    log, data = epoch_files(journal)
    batches = [(start, record_at(log, start, stop)) for start, stop in record_bounds(log)
               if record_at(log, start, stop)["t"] == "batch" and sum(record_at(log, start, stop)["sizes"])]
    assert len(batches) >= 3
    for n, (start, record) in enumerate(batches):
        cut = record["offset"] + sum(record["sizes"]) - 1
        short = damaged_copy(journal, tmp_path / f"short-{n}", lambda log, data, at=cut: os.truncate(data, at))
        prefix = damaged_copy(journal, tmp_path / f"prefix-{n}", lambda log, data, at=start: os.truncate(log, at))
        replayed = restart(short)
        assert snapshot(replayed) == snapshot(restart(prefix)), f"batch record {n}"


@pytest.mark.parametrize("bad", [{"t": "compact"}, {"no": "kind"}, [1, 2, 3]])
def test_a_record_of_unknown_kind_or_not_a_map_stops_the_replay_there(tmp_path, restart, journals, bad):
    journal = journal_without_retire(tmp_path, journals)
    log, _ = epoch_files(journal)
    start, _ = record_bounds(log)[5]
    expected = snapshot(restart(damaged_copy(journal, tmp_path / "prefix", lambda log, data: os.truncate(log, start))))

    def insert(log, data):
        raw = log.read_bytes()
        log.write_bytes(raw[:start] + raw_record(bad) + raw[start:])

    assert snapshot(restart(damaged_copy(journal, tmp_path / "odd", insert))) == expected


# ---- retired epochs ----------------------------------------------------------------------------------------


def test_retired_epochs_are_remembered_across_restarts_and_their_files_are_gone(tmp_path, restart, journals):
    live = Ledger(journals(tmp_path))
    wire = Wire(live)
    join(live, b"r", hello(), prefetch=10)
    for epoch in (0, 1, 2):
        live.open_epoch(STREAM, epoch, 1, "stream")
        push(live, epoch, 0, 0, journalled=True)
        end(live, epoch, 0, 0, 1)
        live.close_epoch(STREAM, epoch, 1)
        wire.dispatch()
        if epoch < 2:
            ack(live, b"r", [(epoch, 0, 0)])
            wire.dispatch()
    assert sorted(live.streams[STREAM].finished.figures) == [0, 1]
    for epoch in (0, 1):
        assert not any(p.exists() for p in epoch_files(tmp_path, epoch))
    assert all(p.exists() for p in epoch_files(tmp_path, 2))

    again = restart(tmp_path)
    stream = again.streams[STREAM]
    assert stream.finished.figures == live.streams[STREAM].finished.figures and list(stream.epochs) == [2]
    for epoch in (0, 1):
        with pytest.raises(ProtocolError, match="already delivered epoch"):
            again.open_epoch(STREAM, epoch, 1, "stream")
        with pytest.raises(Rejected) as late:
            push(again, epoch, 0, 0, attempt=1, journalled=True)
        assert late.value.reason == "late_duplicate"
    assert not any(p.exists() for e in (0, 1) for p in epoch_files(tmp_path, e))
    assert restart(tmp_path).streams[STREAM].finished.figures == stream.finished.figures


def test_an_epoch_retired_but_whose_files_were_not_deleted_yet_stays_retired(tmp_path, restart, journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 1, "stream")
    push(live, 0, 0, 0, journalled=True)
    saved = {p: p.read_bytes() for p in epoch_files(tmp_path)}
    end(live, 0, 0, 0, 1)
    live.close_epoch(STREAM, 0, 1)
    wire = Wire(live)
    join(live, b"r", hello(), prefetch=1)
    wire.dispatch()
    ack(live, b"r", [(0, 0, 0)])
    wire.dispatch()
    for path, raw in saved.items():                  # killed between retired.log and the unlinks
        path.write_bytes(raw)
    again = restart(tmp_path)
    assert list(again.streams[STREAM].finished.figures) == [0] and not again.streams[STREAM].epochs
    assert not any(path.exists() for path in saved)        # nothing of the epoch is needed: its files went


# ---- restarting twice ----------------------------------------------------------------------------------------
# A replay cuts a log at its first torn or damaged record: otherwise what the restarted broker appends would sit
# behind that record, and the next replay would stop before it (commits that broker had answered lost).


def test_what_a_restarted_broker_journals_after_a_torn_record_survives_the_next_restart(tmp_path, restart,
                                                                                        journals):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 1, "stream")
    push(live, 0, 0, 0, journalled=True)
    push(live, 0, 0, 1, journalled=True)
    log, _ = epoch_files(tmp_path)
    os.truncate(log, log.stat().st_size - 3)         # killed while writing the record of seq 1

    second = restart(tmp_path)
    assert [b.id for b in second.streams[STREAM].epochs[0].queue] == [(0, 0, 0)]
    push(second, 0, 0, 1, journalled=True)           # the task is retried: seq 1 comes again
    [committed] = end(second, 0, 0, 0, 2)
    assert committed.kind == Kind.PARTITION_COMMITTED          # fsynced and promised to the task
    second.close_epoch(STREAM, 0, 1)

    third = restart(tmp_path)
    ep = third.streams[STREAM].epochs[0]
    assert sorted(b.id for b in ep.queue) == [(0, 0, 0), (0, 0, 1)]
    assert ep.committed == {0} and ep.closed


@pytest.mark.parametrize("damage", ["flipped byte", "unknown kind", "short data"])
def test_what_a_restarted_broker_journals_after_a_damaged_record_survives_the_next_restart(tmp_path, restart,
                                                                                         journals, damage):
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 2, "stream")
    push(live, 0, 0, 0, journalled=True)
    push(live, 0, 0, 1, journalled=True)
    log, data = epoch_files(tmp_path)
    start, stop = record_bounds(log)[-1]             # the record of seq 1
    if damage == "flipped byte":
        raw = bytearray(log.read_bytes())
        raw[stop - 1] ^= 0x40
        log.write_bytes(bytes(raw))
    elif damage == "unknown kind":
        with open(log, "r+b") as f:
            f.truncate(start)
            f.seek(start)
            f.write(raw_record({"t": "compact"}))
    else:
        os.truncate(data, data.stat().st_size - 1)

    second = restart(tmp_path)
    assert [b.id for b in second.streams[STREAM].epochs[0].queue] == [(0, 0, 0)]
    push(second, 0, 0, 0, attempt=1, journalled=True)  # the task is retried: its copy of seq 0 is a duplicate
    push(second, 0, 0, 1, attempt=1, journalled=True)
    push(second, 0, 1, 0, journalled=True)
    assert end(second, 0, 0, 1, 2)[0].kind == Kind.PARTITION_COMMITTED
    assert end(second, 0, 1, 0, 1)[0].kind == Kind.PARTITION_COMMITTED
    second.close_epoch(STREAM, 0, 2)

    third = restart(tmp_path)
    ep = third.streams[STREAM].epochs[0]
    assert sorted(b.id for b in ep.queue) == [(0, 0, 0), (0, 0, 1), (0, 1, 0)]
    assert ep.committed == {0, 1} and ep.closed
    assert snapshot(third) == snapshot(second)


def test_an_epoch_retired_after_a_torn_retired_log_is_remembered_at_the_next_restart(tmp_path, restart, journals):
    live = Ledger(journals(tmp_path))
    wire = Wire(live)
    join(live, b"r", hello(), prefetch=10)
    for epoch in (0, 1):
        live.open_epoch(STREAM, epoch, 1, "stream")
        push(live, epoch, 0, 0, journalled=True)
        end(live, epoch, 0, 0, 1)
        live.close_epoch(STREAM, epoch, 1)
        wire.dispatch()
        ack(live, b"r", [(epoch, 0, 0)])
        saved = {p: p.read_bytes() for p in epoch_files(tmp_path, epoch)}
        wire.dispatch()                              # ended, then retired: a line in retired.log, files deleted
    retired = tmp_path / "retired.log"
    os.truncate(retired, retired.stat().st_size - 3)  # killed while writing epoch 1's line: its files were kept
    for path, raw in saved.items():
        path.write_bytes(raw)

    second = restart(tmp_path)
    assert list(second.streams[STREAM].finished.figures) == [0] and list(second.streams[STREAM].epochs) == [1]
    wire = Wire(second)
    join(second, b"r", hello(), prefetch=10)
    wire.dispatch()                                  # nothing left to send: EPOCH_END again, retired again
    assert wire.sent == [] and wire.ends == [(b"r", 1)]
    assert sorted(second.streams[STREAM].finished.figures) == [0, 1]
    assert not any(p.exists() for p in epoch_files(tmp_path, 1))

    third = restart(tmp_path)
    assert sorted(third.streams[STREAM].finished.figures) == [0, 1]


def test_after_a_restart_independent_consumers_wait_for_each_other_before_batches_go_out(tmp_path, restart,
                                                                                        journals):
    """Independent consumers are each rank 0 of 1: the first back must not be given what another one holds. The
    restarted broker holds their streams for --rejoin-grace, so that each can come back and name what it has."""
    live = Ledger(journals(tmp_path))
    live.open_epoch(STREAM, 0, 1, "stream")
    for seq in range(4):
        push(live, 0, 0, seq, journalled=True)
    end(live, 0, 0, 0, 4)
    live.close_epoch(STREAM, 0, 1)
    wire = Wire(live)
    join(live, b"a", hello(session="a"), prefetch=2)
    join(live, b"b", hello(session="b"), prefetch=2)
    wire.dispatch()
    held_by_b = wire.to(b"b")
    assert len(held_by_b) == 2

    again = restart(tmp_path, hold=True)
    wire = Wire(again)
    join(again, b"a2", hello(session="a", resume=True), prefetch=4)
    wire.dispatch()
    assert wire.to(b"a2") == []                       # b is not back yet: nothing goes out
    again.join_rank(b"b2", hello(session="b", resume=True), held=held_by_b)
    again.streams[STREAM].held_until = 0.0            # --rejoin-grace is over
    wire.dispatch()
    assert not set(wire.to(b"a2")) & set(held_by_b)   # what b holds stays b's
    assert again.streams[STREAM].epochs[0].given_twice == 0
