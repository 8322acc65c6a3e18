"""The broker's journal (``--journal DIR``): what it promised, on disk, so a restarted broker keeps its promises.

Per stream and epoch there are two append-only files:

- ``epoch-<n>.log``: records, each a 4-byte little-endian length, the CRC-32 of the body (4 bytes) and the
  body, a msgpack map whose ``t`` is a :class:`Record` kind: ``open`` (partitions, delivery, commit), ``batch`` (the
  header frame, where its payload lies in the data file), ``commit`` (partition, attempt), ``claim`` (partition,
  broker), ``close``, ``ack`` (batch ids), ``recover`` (an EPOCH_RECOVER's fields), ``reclaim`` (a rank's RECLAIM:
  the loss, the rank's session and number, what it used). A ``recover`` with ``reset`` deletes the files of the
  stream's later epochs (the reset forgets them).
- ``epoch-<n>.data``: the batches' column frames, back to back.

The ledger does not call this module: its observer ``broker.events.JournalRecorder`` writes the events it applies,
and replay reads the records back as the same events (``broker.events.replayed_events``).

Records are written with plain ``write`` calls as they happen, so a killed broker (``kill -9``) loses none of
them: the kernel has them. They reach the disk (``fsync``) before a partition commit or an epoch close is
answered, and at least every second for acknowledgements. When an epoch has been delivered and acknowledged,
its files are deleted and one record in ``retired.log`` remembers that it was delivered, with its figures.

``retired.log`` stays bounded (compaction): when it holds more than ``compact_at`` records (and twice what the
last compaction kept), it is rewritten (a temporary file, fsynced, renamed over it) as, per stream, one
``delivered`` record listing every delivered epoch as ranges ``[[first, last], ...]``, followed by the records of
its last ``keep_stats`` epochs with their figures (none for a stream the broker retired, :meth:`Journal.retire_stream`:
so the file grows by one record per stream served, not by ``keep_stats``). Every delivered epoch is still known
after a restart, and a re-feed of one still refused; only the figures of old epochs are gone.

Replay stops at the first torn record (a write cut short by a crash; nothing after it was ever answered) or the
first record whose CRC does not match (a damaged disk block: what follows cannot be trusted either).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import msgpack

from sparkbus.broker.figures import fold, no_earlier
from sparkbus.wire.protocol import PartitionRanges
from sparkbus.wire.records import UsedCut, UsedEntry

log = logging.getLogger("sparkbus.journal")
_PREFIX = struct.Struct("<II")      # body length, CRC-32 of the body
ACK_SYNC_SECONDS = 1.0
RETIRED_COMPACT_AT = 1024     # records in retired.log before it is compacted (a few hundred KiB)
RETIRED_KEEP_STATS = 64       # epochs per stream whose figures survive a compaction
# Epochs whose two files stay open for appending. Past it, the least recently written epoch's are closed, and
# opened again when next written: a broker with many open epochs must not run out of descriptors (two per epoch;
# 1,024 is a common limit). What was written to them and not fsynced yet is fsynced on time all the same.
MAX_OPEN_FILES = 64


class Record(str, Enum):
    """The kinds of journal records (the ``t`` field): each is one transition of the ledger."""

    OPEN = "open"        # an epoch was opened: partitions, delivery, commit (absent: "end")
    BATCH = "batch"      # a batch arrived: its header frame; its payload in the data file, if it was kept
    COMMIT = "commit"    # a partition was committed: part, attempt
    CLOSE = "close"      # the epoch was closed (partitions: its count, if below the open's upper bound)
    ACK = "ack"          # batches were acknowledged by a rank: ids
    CLAIM = "claim"      # the broker (an index in the feed's list) that streams a partition: part, broker
    RECOVER = "recover"  # EPOCH_RECOVER: partitions, delivery, commit, carries, recovered, lost, reset
    RECLAIM = "reclaim"  # a rank's RECLAIM: lost, member, rank, entries, cuts


class EpochRanges(PartitionRanges):
    """A set of epoch numbers held as sorted, disjoint, inclusive ranges ``[[first, last], ...]`` (the journal's
    form): a stream that delivered epochs 0 to 9,999 costs one pair."""

    __slots__ = ()

    def __init__(self, ranges: Iterable[Iterable[int]] = ()):
        super().__init__()
        for first, last in ranges:
            for number in (first, last):
                if type(number) is not int:
                    raise ValueError(f"an epoch range holds {number!r}, not an int")
            self.add_range(first, last)

    def add(self, epoch: int) -> None:
        self.add_range(epoch, epoch)

    def add_range(self, first: int, last: int) -> None:
        if first > last:
            raise ValueError(f"epoch range [{first}, {last}] is empty")
        self._add(first, last + 1)

    def ranges(self) -> list[list[int]]:
        return [[start, stop - 1] for start, stop in self.pairs()]

    def __repr__(self) -> str:
        return f"EpochRanges({self.ranges()})"


class DeliveredEpochs:
    """A stream's delivered epochs (``StreamState.finished``, live and replayed): ``epoch in delivered`` for every
    one of them; the recent ones' figures in :attr:`figures` (``{epoch: figures}``, at most ``keep``), the older
    ones only in :attr:`ranges`, their figures summed in :attr:`earlier`. A stream that delivers epoch after epoch
    costs one range and ``keep`` records, however long it runs.

    Args:
        ranges: epochs delivered without figures, as ``[[first, last], ...]``.
        figures: ``{epoch: figures}`` of recent epochs.
        keep: how many epochs keep their figures; older ones move to :attr:`ranges` as epochs are added (None:
            all keep them).
    """

    def __init__(self, ranges: Iterable[Iterable[int]] = (), figures: Mapping[int, Any] | None = None,
                 keep: int | None = RETIRED_KEEP_STATS):
        self.ranges = EpochRanges(ranges)
        self.figures: dict[int, Any] = {}
        self.keep = keep
        self.earlier = no_earlier()     # figures of the epochs in ranges, summed (those this process had)
        for epoch, stats in sorted((figures or {}).items()):
            self.add(epoch, stats)

    @property
    def delivered(self) -> int:
        """How many epochs were delivered: those with figures and those without."""
        return len(self.ranges) + len(self.figures)

    def __contains__(self, epoch: object) -> bool:
        return epoch in self.figures or epoch in self.ranges

    def add(self, epoch: int, stats: Any) -> None:
        """Epoch ``epoch`` was delivered, with these figures (the oldest beyond ``keep`` fold into the ranges)."""
        self.figures[epoch] = stats
        if self.keep is not None and len(self.figures) > self.keep:
            for old in sorted(self.figures)[:len(self.figures) - self.keep]:
                fold(self.earlier, self.figures.pop(old))
                self.ranges.add(old)

    def forget(self, epoch: int) -> bool:
        """Epoch ``epoch`` is fed again (a resume): no longer delivered. Whether it was."""
        was = epoch in self
        self.figures.pop(epoch, None)
        if epoch in self.ranges:
            self.ranges = EpochRanges([a, b] for first, last in self.ranges.ranges()
                                      for a, b in ((first, epoch - 1), (epoch + 1, last)) if a <= b)
        return was

    def forget_after(self, epoch: int) -> None:
        """The epochs after ``epoch`` are no longer delivered (a resume at ``epoch`` rewinds them)."""
        for later in [n for n in self.figures if n > epoch]:
            del self.figures[later]
        self.ranges = EpochRanges([first, min(last, epoch)] for first, last in self.ranges.ranges() if first <= epoch)

    def __repr__(self) -> str:
        return f"DeliveredEpochs({self.ranges.ranges()}, {self.figures!r})"


@dataclass
class EpochFiles:
    log_fd: int
    data_fd: int
    data_size: int
    dirty: bool = False


@dataclass
class ReplayedEpoch:
    """An epoch read back from the journal: its records in order, payloads as views of the data file."""

    stream: str
    epoch: int
    records: list[dict[str, Any]] = field(default_factory=list)


class Journal:
    """Append-only journal of one broker. Not thread-safe: the broker loop owns it."""

    def __init__(self, directory: str | os.PathLike, compact_at: int = RETIRED_COMPACT_AT,
                 keep_stats: int = RETIRED_KEEP_STATS, max_open_files: int = MAX_OPEN_FILES):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[tuple[str, int], EpochFiles] = OrderedDict()    # least recently written first
        self.max_open_files = max_open_files
        self._unsynced: set[tuple[str, int]] = set()     # epochs closed with writes not fsynced yet
        self._maps: list[mmap.mmap] = []
        self._last_sync = time.monotonic()
        self.compact_at, self.keep_stats = compact_at, keep_stats
        self._retired_records: int | None = None     # records in retired.log; counted when first needed
        self._compacted_to = 0                        # records the last compaction kept
        self._streams_retired: set[str] = set()       # streams the broker dropped: compaction keeps only their ranges

    # ---- writing ----------------------------------------------------------------------------------------

    def _epoch_dir(self, stream: str) -> Path:
        return self.directory / stream.encode().hex()

    def _files_for(self, stream: str, epoch: int) -> EpochFiles:
        key = (stream, epoch)
        files = self._files.get(key)
        if files is not None:
            self._files.move_to_end(key)
            return files
        folder = self._epoch_dir(stream)
        folder.mkdir(exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        data_fd = os.open(folder / f"epoch-{epoch}.data", flags, 0o600)
        files = self._files[key] = EpochFiles(os.open(folder / f"epoch-{epoch}.log", flags, 0o600), data_fd,
                                              os.fstat(data_fd).st_size, dirty=key in self._unsynced)
        self._unsynced.discard(key)
        while len(self._files) > self.max_open_files:
            evicted, oldest = self._files.popitem(last=False)
            if oldest.dirty:    # not fsynced now (an fsync a write when more epochs are written in turn): the next
                self._unsynced.add(evicted)     # sync_if_due does it, or the epoch's own next fsync
            self._close(oldest)
        return files

    @staticmethod
    def _close(files: EpochFiles) -> None:
        os.close(files.log_fd)
        os.close(files.data_fd)

    def _append(self, files: EpochFiles, kind: Record, **fields: Any) -> None:
        os.write(files.log_fd, _frame({"t": kind.value, **fields}))
        files.dirty = True

    def record_open(self, stream: str, epoch: int, partitions: int, delivery: str, commit: str = "end") -> None:
        files = self._files_for(stream, epoch)
        self._append(files, Record.OPEN, partitions=partitions, delivery=delivery, commit=commit)
        self._sync(files)

    def record_batch(self, stream: str, epoch: int, header: bytes, payload: list[Any]) -> None:
        files = self._files_for(stream, epoch)
        sizes = [len(f) for f in payload]
        if payload:
            written = os.writev(files.data_fd, [memoryview(f.buffer if hasattr(f, "buffer") else f)
                                                for f in payload])
            if written != sum(sizes):
                raise OSError(f"short write to the journal ({written} of {sum(sizes)} bytes): disk full?")
        self._append(files, Record.BATCH, header=header, offset=files.data_size, sizes=sizes)
        files.data_size += sum(sizes)

    def record_commit(self, stream: str, epoch: int, part: int, attempt: int) -> None:
        files = self._files_for(stream, epoch)
        self._append(files, Record.COMMIT, part=part, attempt=attempt)
        self._sync(files)

    def record_claim(self, stream: str, epoch: int, part: int, broker: int) -> None:
        files = self._files_for(stream, epoch)
        self._append(files, Record.CLAIM, part=part, broker=broker)
        self._sync(files)

    def record_close(self, stream: str, epoch: int, partitions: int | None = None) -> None:
        """The epoch closed; with ``partitions``, the count it closed with, below EPOCH_OPEN's upper bound."""
        files = self._files_for(stream, epoch)
        self._append(files, Record.CLOSE, **({} if partitions is None else {"partitions": partitions}))
        self._sync(files)

    def record_recover(self, stream: str, epoch: int, **fields: Any) -> None:
        files = self._files_for(stream, epoch)
        self._append(files, Record.RECOVER, **fields)
        self._sync(files)

    def record_reclaim(self, stream: str, epoch: int, lost: str, member: str, rank: int,
                       entries: list[UsedEntry], cuts: tuple[UsedCut, ...]) -> None:
        files = self._files_for(stream, epoch)
        # not synced here: a RECLAIM is not answered, and a restarted broker's LOST asks for one it lacks
        self._append(files, Record.RECLAIM, lost=lost, member=member, rank=rank, entries=entries, cuts=cuts)

    def forget_after(self, stream: str, epoch: int) -> None:
        """Delete the files of ``stream``'s epochs after ``epoch`` (a resume at ``epoch`` forgot them)."""
        folder = self._epoch_dir(stream)
        later = {number for name, number in self._files if name == stream and number > epoch}
        if folder.is_dir():
            later.update(n for n in (int(p.stem.split("-")[1]) for p in folder.glob("epoch-*.*")) if n > epoch)
        for number in later:
            self.forget_epoch(stream, number)

    def forget_epoch(self, stream: str, epoch: int) -> None:
        """Close and delete an epoch's files: nothing in them is needed any more."""
        files = self._files.pop((stream, epoch), None)
        if files is not None:
            self._close(files)
        self._unsynced.discard((stream, epoch))
        for suffix in ("log", "data"):
            (self._epoch_dir(stream) / f"epoch-{epoch}.{suffix}").unlink(missing_ok=True)

    def record_acks(self, stream: str, epoch: int, ids: list[list[int]]) -> None:
        self._append(self._files_for(stream, epoch), Record.ACK, ids=ids)

    def record_retired(self, stream: str, epoch: int, stats: dict[str, Any]) -> None:
        """The epoch was delivered and acknowledged: remember that, and free its files."""
        if self._retired_records is None:
            self._retired_records = sum(1 for _ in self.retired())
        retired = os.open(self.directory / "retired.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(retired, _frame({"stream": stream, "epoch": epoch, "stats": stats}))
            os.fsync(retired)
        finally:
            os.close(retired)
        self._retired_records += 1
        self.forget_epoch(stream, epoch)
        if self._retired_records > max(self.compact_at, 2 * self._compacted_to):
            self.compact_retired()

    def retire_stream(self, stream: str) -> None:
        """The broker dropped ``stream`` (unused for ``--retire-streams-after``): the next compaction keeps only
        which epochs it delivered, not their figures, so that a service broker's journal does not grow with the
        streams it has served; its empty folder goes now."""
        self._streams_retired.add(stream)
        try:
            self._epoch_dir(stream).rmdir()
        except OSError:
            pass                         # not there, or an epoch's files are (then it is not unused)

    def compact_retired(self) -> None:
        """Rewrite ``retired.log`` as one ``delivered`` record of ranges per stream and the records of each
        stream's last ``keep_stats`` epochs. Atomic: a crash leaves the old file or the new one, both whole."""
        path = self.directory / "retired.log"
        delivered: dict[str, DeliveredEpochs] = {}
        for record in self.retired():
            epochs = delivered.setdefault(record["stream"], DeliveredEpochs(keep=self.keep_stats))
            if "delivered" in record:
                for first, last in record["delivered"]:
                    epochs.ranges.add_range(first, last)
            else:
                epochs.add(record["epoch"], record["stats"])
        records: list[dict[str, Any]] = []
        for stream, epochs in delivered.items():
            if stream in self._streams_retired:
                for number in list(epochs.figures):
                    epochs.ranges.add(number)
                    del epochs.figures[number]
            if epochs.ranges.ranges():
                records.append({"stream": stream, "delivered": epochs.ranges.ranges()})
            records.extend({"stream": stream, "epoch": n, "stats": epochs.figures[n]} for n in sorted(epochs.figures))
        tmp = path.with_name("retired.log.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            body = b"".join(_frame(r) for r in records)
            if os.write(fd, body) != len(body):
                raise OSError(f"short write to {tmp}: disk full?")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        _sync_directory(self.directory)
        log.info("journal: retired.log compacted from %d to %d records", self._retired_records or 0, len(records))
        self._retired_records = self._compacted_to = len(records)
        self._streams_retired.clear()

    def _sync(self, files: EpochFiles) -> None:
        os.fsync(files.data_fd)
        os.fsync(files.log_fd)
        files.dirty = False

    def sync_if_due(self) -> None:
        """Flush acknowledgements to disk at least every :data:`ACK_SYNC_SECONDS`."""
        now = time.monotonic()
        if now - self._last_sync >= ACK_SYNC_SECONDS:
            for files in self._files.values():
                if files.dirty:
                    self._sync(files)
            self._sync_closed()
            self._last_sync = now

    def _sync_closed(self) -> None:
        """fsync the files of epochs closed (:data:`MAX_OPEN_FILES`) with writes not fsynced yet."""
        for stream, epoch in self._unsynced:
            for suffix in ("data", "log"):
                try:
                    fd = os.open(self._epoch_dir(stream) / f"epoch-{epoch}.{suffix}", os.O_WRONLY | os.O_APPEND)
                except FileNotFoundError:
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self._unsynced.clear()

    def close(self) -> None:
        while self._files:
            files = self._files.popitem(last=False)[1]
            if files.dirty:
                self._sync(files)
            self._close(files)
        self._sync_closed()

    # ---- reading back -----------------------------------------------------------------------------------

    def retired(self) -> Iterator[dict[str, Any]]:
        """Records of epochs already delivered, in order: ``{"stream", "epoch", "stats"}`` for one epoch, or, first
        for a stream in a compacted journal, ``{"stream", "delivered": [[first, last], ...]}`` for epochs whose
        figures were dropped (see :class:`DeliveredEpochs`)."""
        path = self.directory / "retired.log"
        if path.exists():
            for _, record in _records(path.read_bytes(), path):
                yield record

    def replay(self) -> Iterator[ReplayedEpoch]:
        """Every epoch still in the journal, its batch records carrying ``payload``: views of the data file."""
        for folder in sorted(p for p in self.directory.iterdir() if p.is_dir()):
            try:
                stream = bytes.fromhex(folder.name).decode()
            except ValueError:           # not one of ours (e.g. lost+found at the root of a fresh volume)
                log.info("journal: ignoring the folder %s", folder)
                continue
            for log_path in sorted(folder.glob("epoch-*.log"), key=lambda p: int(p.stem.split("-")[1])):
                epoch = int(log_path.stem.split("-")[1])
                data_path = log_path.with_suffix(".data")
                data = self._map(data_path)
                replayed = ReplayedEpoch(stream, epoch)
                for at, record in _records(log_path.read_bytes(), log_path):
                    try:
                        record["t"] = Record(record.get("t"))
                    except ValueError:
                        log.warning("%s holds a record of unknown kind %r; replay stops there", log_path,
                                    record.get("t"))
                        _cut(log_path, at)
                        break
                    if record["t"] is Record.BATCH:
                        offset, views = record["offset"], []
                        for size in record["sizes"]:
                            views.append(data[offset:offset + size])
                            offset += size
                        if offset > len(data):
                            log.warning("%s ends inside a batch's payload; replay stops there", data_path)
                            _cut(log_path, at)
                            break
                        record["payload"] = views
                    replayed.records.append(record)
                yield replayed

    def _map(self, path: Path) -> memoryview:
        if not path.exists() or path.stat().st_size == 0:
            return memoryview(b"")
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._maps.append(mapped)          # kept open: replayed batches are views of it until acknowledged
        return memoryview(mapped)


def _frame(record: dict[str, Any]) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return _PREFIX.pack(len(body), zlib.crc32(body)) + body


def _records(raw: bytes, path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(offset, record)`` of one file in order, up to the first torn or damaged record, where the file is cut."""
    offset = 0
    while offset < len(raw):
        length, crc = _PREFIX.unpack_from(raw, offset) if offset + _PREFIX.size <= len(raw) else (len(raw), 0)
        body = raw[offset + _PREFIX.size:offset + _PREFIX.size + length]
        if len(body) < length:
            log.warning("%s ends with a torn record; replay stops there", path)
            return _cut(path, offset)
        record = msgpack.unpackb(body, raw=False) if zlib.crc32(body) == crc else None
        if not isinstance(record, dict):
            log.error("%s: the record at byte %d fails its CRC; replay stops there", path, offset)
            return _cut(path, offset)
        yield offset, record
        offset += _PREFIX.size + length


def _sync_directory(directory: Path) -> None:
    """fsync a directory, so that a rename in it survives a power cut."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cut(path: Path, offset: int) -> None:
    """Drop what follows the last good record, so that what this broker appends is read back after a restart
    (records behind a torn one would never be)."""
    with open(path, "r+b") as f:
        f.truncate(offset)
        os.fsync(f.fileno())
    log.warning("%s cut to its %d bytes of good records", path, offset)
