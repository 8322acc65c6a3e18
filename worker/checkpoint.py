"""A training run's checkpoint directory, shared by its ranks and its feed: what makes a restarted group (torchrun's
elastic agent, or a new job of another size) resume exactly (docs/TRAINING.md, "Elastic restarts").

Layout of the directory (a shared filesystem when the ranks and the feed run on several hosts)::

    LATEST                      the name of the last complete checkpoint (replaced atomically)
    ckpt-<ns>-e<epoch>-s<step>/positions.json  every rank's state_dict() of each stream, ranks 0..N-1
    ckpt-.../payload.pt         what the ranks saved with it (the model, the optimizer), torch.save'd, if anything
    requests/<ns>-<token>.json  one per start of a group: what it resumes from; the feed serves the newest
    requests/<ns>-<token>.<stream>.served  the feed of that stream served it (or found a newer one)
    done                        the ranks trained their last epoch: the feed stops watching

A checkpoint is written into a directory of its own and renamed into place before ``LATEST`` names it, so a reader
never sees half of one. A request carries the states themselves, so a checkpoint removed afterwards does not matter.

This module holds both ends of the directory's format: :class:`ElasticCheckpoints` (the ranks' side, collective:
every rank calls its methods in the same order) and :func:`pending_request` / :func:`mark_served` /
:func:`is_done` (the feed's side, :func:`sparkbus.feeder.elastic.feed_elastic`). It imports torch only to save or
load a payload.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

log = logging.getLogger("sparkbus.worker")

LATEST = "LATEST"
POSITIONS = "positions.json"
PAYLOAD = "payload.pt"
REQUESTS = "requests"
DONE = "done"


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or not at all (a temporary file beside it, flushed, then renamed)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def torch_gather() -> Callable[[Any], list[Any]]:
    """``all_gather_object`` over the initialised ``torch.distributed`` default group, or the object alone."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return lambda obj: [obj]

    def gather(obj: Any) -> list[Any]:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, obj)
        return everyone

    return gather


@dataclass(frozen=True)
class ResumeRequest:
    """A group's start as its rank 0 wrote it: ``ranks`` in the group, ``checkpoint`` resumed from (None: none yet),
    and per stream what to feed: None (a first start: feed from the first epoch), every old rank's state (a list,
    resume from that checkpoint) or an epoch number (a restart before any checkpoint: that epoch again, whole)."""

    path: Path
    ranks: int
    checkpoint: str | None
    resumes: Mapping[str, list[dict[str, Any]] | int | None]


class ElasticCheckpoints:
    """The ranks' side of a checkpoint directory. Every method is collective (every rank calls it, in order).

    Args:
        directory: the run's directory, the same path on every rank and for the feed (created if missing).
        rank, size: this rank and the group's size; default: ``torch.distributed``'s (1 rank without it).
        gather: ``gather(obj) -> [obj of rank 0, ..., obj of rank size-1]`` on every rank (e.g. mpi4py's
            ``comm.allgather``); default: ``torch.distributed.all_gather_object`` once it is initialised.
        keep: complete checkpoints kept (older ones are removed by rank 0).

    Typical use, per rank (examples/train_elastic.py)::

        ckpt = ElasticCheckpoints(directory)
        resume = ckpt.resume("train")                 # None on a first start, else every old rank's state
        with BatchStream(address, rank="auto", stream="train", resume=resume) as stream:
            ckpt.joined()                             # tells the feed what to feed: after every rank joined
            payload = ckpt.load_payload()             # the model saved with that checkpoint (None on a first start)
            ...
                ckpt.save([stream], {"model": model.state_dict()})   # every rank, between two steps
        ckpt.finish()
    """

    def __init__(self, directory: str | os.PathLike[str], *, rank: int | None = None, size: int | None = None,
                 gather: Callable[[Any], list[Any]] | None = None, keep: int = 2) -> None:
        self.directory = Path(directory)
        if rank is None or size is None:
            dist = sys.modules.get("torch.distributed")
            known = dist is not None and dist.is_available() and dist.is_initialized()
            rank = dist.get_rank() if known and dist is not None else 0
            size = dist.get_world_size() if known and dist is not None else 1
        self.rank, self.size = rank, size
        self.gather = gather if gather is not None else torch_gather()
        self.keep = max(keep, 1)
        self.checkpoint: str | None = None          # the one this group resumes from
        self.resumes: dict[str, list[dict[str, Any]] | int | None] = {}
        self._started = (self.directory / REQUESTS).is_dir() and any((self.directory / REQUESTS).iterdir())
        if self.rank == 0:
            (self.directory / REQUESTS).mkdir(parents=True, exist_ok=True)
        self.gather(None)     # every rank looked at the directory before rank 0 writes to it
        if not self._started:
            return
        self.checkpoint = latest(self.directory)

    def resume(self, stream: str = "train", first_epoch: int = 0) -> list[dict[str, Any]] | None:
        """What to pass as ``BatchStream(..., resume=)`` for ``stream``.

        Returns:
            None on the first start of a group on this directory; else every rank's state of ``stream`` in the
            last checkpoint (a list, whatever the old group's size), or, restarted before any checkpoint, states
            at ``first_epoch`` with nothing used (the epoch is fed again whole).
        Raises:
            ValueError: the last checkpoint has no state of ``stream``.
        """
        if not self._started:
            self.resumes[stream] = None
            return None
        if self.checkpoint is None:
            self.resumes[stream] = first_epoch
            return [{"format": 2, "stream": stream, "rank": r, "size": self.size, "epoch": first_epoch, "steps": 0,
                     "used": [], "cuts": []} for r in range(self.size)]
        streams = json.loads((self.directory / self.checkpoint / POSITIONS).read_text())["streams"]
        if stream not in streams:
            raise ValueError(f"checkpoint {self.checkpoint} in {self.directory} has no state of stream {stream!r} "
                             f"(it has {sorted(streams)})")
        self.resumes[stream] = streams[stream]
        return list(streams[stream])

    def joined(self) -> None:
        """Tell the feed what this group needs, once every rank's ``BatchStream`` is open (joined: the brokers
        know the group resumes before the feed resets the epoch). Call after :meth:`resume` for each stream."""
        self.gather(None)
        if self.rank != 0:
            return
        request = {"ranks": self.size, "checkpoint": self.checkpoint, "resumes": self.resumes,
                   "written": time.time()}
        name = f"{time.time_ns():020d}-{secrets.token_hex(4)}.json"
        write_atomically(self.directory / REQUESTS / name, json.dumps(request).encode())
        log.info("group of %d ranks started from %s: request %s written for the feed", self.size,
                 self.checkpoint or "the beginning", name)

    def load_payload(self) -> Any:
        """What was saved with the checkpoint this group resumes from (``torch.load(..., weights_only=True)``), or
        None (a first start, or a checkpoint saved without one)."""
        if self.checkpoint is None:
            return None
        path = self.directory / self.checkpoint / PAYLOAD
        if not path.exists():
            return None
        import torch

        return torch.load(path, weights_only=True)

    def save(self, streams: Sequence[Any], payload: Mapping[str, Any] | None = None) -> str:
        """Save a checkpoint: every rank's ``state_dict()`` of each of ``streams`` (gathered to every rank), and
        ``payload`` (rank 0's: the model, the optimizer) with them, atomically. Call between two steps, on every
        rank (the same streams, in the same order).

        Returns:
            The checkpoint's name.
        Raises:
            ValueError: as ``BatchStream.state_dict()`` (a shuffle buffer holds rows).
        """
        mine = {s.stream: s.state_dict() for s in streams}
        everyone = self.gather(json.dumps(mine))        # JSON text: no pickle of anything but a str crosses
        serial = max([int(s.get("steps", 0)) for s in mine.values()] + [0])
        name = ""
        if self.rank == 0:
            states = [json.loads(one) for one in everyone]
            positions = {"streams": {s: [st[s] for st in states] for s in mine}, "ranks": self.size,
                         "saved": time.time()}
            epoch = min(st["epoch"] for st in mine.values()) if mine else 0
            name = f"ckpt-{time.time_ns():020d}-e{epoch}-s{serial}"      # names sort by time
            staging = self.directory / f".{name}.tmp"
            staging.mkdir(parents=True)
            write_atomically(staging / POSITIONS, json.dumps(positions).encode())
            if payload is not None:
                import torch

                torch.save(dict(payload), staging / PAYLOAD)
            os.replace(staging, self.directory / name)
            write_atomically(self.directory / LATEST, name.encode())
            self._prune(name)
        return str(self.gather(name)[0])

    def finish(self) -> None:
        """The group trained its last epoch: the feed stops watching the directory."""
        self.gather(None)
        if self.rank == 0:
            write_atomically(self.directory / DONE, b"done\n")

    def _prune(self, newest: str) -> None:
        complete = sorted(p.name for p in self.directory.glob("ckpt-*") if p.is_dir())
        for old in complete[:-self.keep]:
            if old != newest:
                shutil.rmtree(self.directory / old, ignore_errors=True)


def latest(directory: str | os.PathLike[str]) -> str | None:
    """The name of the last complete checkpoint in ``directory``, or None."""
    path = Path(directory) / LATEST
    try:
        name = path.read_text().strip()
    except FileNotFoundError:
        return None
    return name if (Path(directory) / name / POSITIONS).exists() else None


def pending_request(directory: str | os.PathLike[str], stream: str) -> ResumeRequest | None:
    """The newest request that the feed of ``stream`` has not served yet (older ones it has not served are marked
    served: superseded), or None."""
    folder = Path(directory) / REQUESTS
    if not folder.is_dir():
        return None
    pending = [p for p in sorted(folder.glob("*.json")) if not served_marker(p, stream).exists()]
    if not pending:
        return None
    for old in pending[:-1]:
        log.info("request %s superseded by %s", old.name, pending[-1].name)
        served_marker(old, stream).touch()
    raw = json.loads(pending[-1].read_text())
    return ResumeRequest(pending[-1], int(raw["ranks"]), raw.get("checkpoint"), raw["resumes"])


def served_marker(request: Path, stream: str) -> Path:
    """The file that says the feed of ``stream`` served ``request`` (one feed per stream reads the same requests)."""
    return request.with_name(f"{request.stem}.{quote(stream, safe='')}.served")


def mark_served(request: ResumeRequest, stream: str) -> None:
    served_marker(request.path, stream).touch()


def is_done(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / DONE).exists()


__all__ = ["ElasticCheckpoints", "ResumeRequest", "is_done", "latest", "mark_served", "pending_request"]
