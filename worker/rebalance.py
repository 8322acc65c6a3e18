"""Equal step counts across ranks: the end-of-epoch rebalancing over MPI, without spinning a core.

Every wait is a non-blocking request tested with a short, growing sleep (``worker.collectives``).

Batches that move between ranks travel as the wire format itself (header + raw column bytes in one buffer):
nothing is pickled.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple, cast

import numpy as np

from sparkbus.wire import codec, protocol
from sparkbus.wire.headers import BatchHeader
from sparkbus.wire.protocol import REMAINDERS, Kind
from sparkbus.wire.remainder import plan
from sparkbus.worker.collectives import wait, wait_until
from sparkbus.worker.intake import Item, rows_of

_TAG_BATCH = 0x5B5
_TAG_PIECE = 0x5B6


class Transfer(NamedTuple):
    """A move of :func:`plan_transfers`: ``batches`` batches from rank ``source`` to rank ``destination``."""

    source: int
    destination: int
    batches: int


def plan_transfers(counts: list[int]) -> tuple[list[Transfer], int]:
    """How to even out ``counts`` (batches held per rank) by moving batches between ranks.

    Returns:
        ``(transfers, target)``: the :class:`Transfer` moves, the same on every rank, after which each rank keeps
        ``target = sum(counts) // size`` batches; the ``sum % size`` left over are dropped by the ranks that still
        hold more than ``target``.
    """
    size = len(counts)
    target = sum(counts) // size
    surplus = [[r, c - target] for r, c in enumerate(counts) if c > target]
    transfers: list[Transfer] = []
    for dst, c in enumerate(counts):
        need = target - c
        while need > 0:
            src = surplus[0]
            n = min(need, src[1])
            transfers.append(Transfer(src[0], dst, n))
            need -= n
            src[1] -= n
            if src[1] == 0:
                surplus.pop(0)
    return transfers, target


def share_remainder(comm: Any, left: list[Item], remainder: str,
                    idle: Callable[[], None] | None = None) -> Item | None:
    """The batches left over on every rank after :func:`exchange` (``left``: this rank's; fewer than the ranks in
    all) shared out by ``remainder`` (``wire.remainder.plan``): this rank's piece, the same plan on every rank, or
    None with ``"drop"`` (the caller drops ``left``). Each piece travels from the rank that holds its batch, whole,
    and is cut here (a view).

    Raises:
        ValueError: the ranks passed different ``remainder`` values.
    """
    size: int = comm.Get_size()
    me: int = comm.Get_rank()
    code = REMAINDERS.index(remainder)
    mine = np.full(size + 1, -1, dtype=np.int64)
    mine[0] = code
    mine[1:len(left) + 1] = [header["rows"] for header, _ in left]
    every = np.empty((size, size + 1), dtype=np.int64)
    wait(comm.Iallgather(mine, every), idle)
    if len(set(every[:, 0].tolist())) != 1:
        theirs = sorted({REMAINDERS[int(c)] for c in every[:, 0]})
        raise ValueError(f"the ranks of the communicator passed different remainder= values ({', '.join(theirs)}): "
                         f"every rank must pass the same")
    if remainder == "drop":
        return None
    owners = [(rank, i) for rank in range(size) for i, rows in enumerate(every[rank, 1:].tolist()) if rows >= 0]
    pieces = plan([int(every[rank, 1 + i]) for rank, i in owners], size, remainder)
    if not pieces:
        return None
    from mpi4py import MPI

    sends = []
    for dst, piece in enumerate(pieces):
        owner, index = owners[piece.batch]
        if owner == me and dst != me:
            buf = pack_batch(*left[index])
            sends.append((comm.Isend([buf, MPI.BYTE], dest=dst, tag=_TAG_PIECE), buf))
    owner, index = owners[pieces[me].batch]
    if owner == me:
        header, columns = left[index]
    else:
        status = MPI.Status()
        wait_until(partial(comm.Iprobe, source=owner, tag=_TAG_PIECE, status=status), idle)
        incoming = bytearray(status.Get_count(MPI.BYTE))
        wait(comm.Irecv([incoming, MPI.BYTE], source=owner, tag=_TAG_PIECE), idle)
        header, columns = unpack_batch(bytes(incoming))
    for request, _ in sends:
        wait(request, idle)
    piece = pieces[me]
    base = header.get("cut", [0])[0]         # a batch that was itself a piece (a resumed epoch's)
    rows = {k: rows_of(v, piece.lo, piece.hi) for k, v in columns.items()}
    fields: BatchHeader = {**header, "rows": piece.hi - piece.lo}
    if piece.repeat:
        fields["repeat"] = True
    if (piece.lo, piece.hi) != (0, header["rows"]):
        fields["cut"] = [base + piece.lo, base + piece.hi]
        fields.pop("nbytes", None)
    return Item(fields, rows)


def pack_batch(header: BatchHeader, columns: dict[str, Any]) -> bytes:
    """One buffer holding a batch in wire form: 4-byte header length, header, column bytes. The header also says
    which batch of its message it is (``index``, a pack's) and the message's checksum as it arrived (``arrived``):
    the rank that trains it records it as used under those (``RECLAIM``, ``BatchStream.state_dict``)."""
    frames = codec.encode_batch(header["stream"], header["epoch"], header["part"], header["seq"], columns)
    fields = {k: v for k, v in protocol.unpack_header(frames[0]).items() if k != "kind"}
    fields["index"] = header.get("index", 0)
    if "cut" in header:                      # rows of a batch only: what it is recorded as used under
        fields["cut"] = header["cut"]
    if "checksum" in header:
        fields["arrived"] = header["checksum"]
    frames[0] = protocol.pack_header(Kind.BATCH, **fields)
    return b"".join([struct.pack("<I", len(frames[0])), *[bytes(f) for f in frames]])


def unpack_batch(buf: bytes) -> Item:
    """The inverse of :func:`pack_batch`; validates like any received batch."""
    (length,) = struct.unpack_from("<I", buf)
    header = cast(BatchHeader, protocol.unpack_header(buf[4:4 + length]))    # a rank's pack_batch: a BATCH
    view, offset, frames = memoryview(buf), 4 + length, []
    for spec in header["cols"]:
        for size in protocol.column_frame_sizes(spec, header["rows"]):
            frames.append(view[offset:offset + size])
            offset += size
    columns = codec.decode_batch(header, frames)
    if "arrived" in header:                  # what it was used as: see pack_batch
        header["checksum"] = header.pop("arrived")
    return Item(header, columns)


def exchange(comm: Any, held: list[Item], transfers: list[Transfer],
             idle: Callable[[], None] | None = None) -> list[Item]:
    """Carry out ``transfers``: send from the end of ``held``, receive onto it. Returns what this rank holds.

    ``idle`` is called now and then while waiting (see :func:`worker.collectives.wait_until`)."""
    from mpi4py import MPI

    me = comm.rank
    held = list(held)
    sends = []
    for src, dst, n in transfers:
        if src == me:
            for _ in range(n):
                buf = pack_batch(*held.pop())
                sends.append((comm.Isend([buf, MPI.BYTE], dest=dst, tag=_TAG_BATCH), buf))
    for src, dst, n in transfers:
        if dst == me:
            for _ in range(n):
                status = MPI.Status()
                wait_until(partial(comm.Iprobe, source=src, tag=_TAG_BATCH, status=status), idle)
                incoming = bytearray(status.Get_count(MPI.BYTE))
                wait(comm.Irecv([incoming, MPI.BYTE], source=src, tag=_TAG_BATCH), idle)
                held.append(unpack_batch(bytes(incoming)))
    for request, _ in sends:
        wait(request, idle)
    return held
