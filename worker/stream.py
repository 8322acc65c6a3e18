"""``BatchStream``: a rank's end of the bus. Batches arrive within the window this rank grants each broker and
are yielded epoch by epoch.

The parts: :mod:`worker.connection` (one broker: window, acknowledgements, heartbeats, rejoining),
:mod:`worker.intake` (every broker's batches in turn, packs cut into batches), :mod:`worker.steps` (how many
steps to take: every batch, or even rounds across the ranks of a communicator).

A broker that loses its state without a journal (a restart, or gone for good while other brokers answer) costs a
recomputation by Spark, not the job: the intake drops what the rank held of it unused and tells the brokers what
the loop had used of it (``RECLAIM``; docs/design/RECOVERY.md, "The rank"). The same record is the rank's position
for an exact resume from a checkpoint: :meth:`BatchStream.state_dict` and ``BatchStream(..., resume=state)``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from typing import Any

import zmq

from sparkbus.wire.address import broker_addresses
from sparkbus.wire.headers import BatchHeader
from sparkbus.wire.records import UsedCut, UsedEntry
from sparkbus.wire.remainder import check_remainder
from sparkbus.worker.connection import BrokerConnection
from sparkbus.worker.grants import GrantedSteps
from sparkbus.worker.intake import Batch, Intake
from sparkbus.worker.launcher import launcher_rank
from sparkbus.worker.stats import EpochStats, StreamStats  # and exported here: sparkbus.worker.stream.EpochStats
from sparkbus.worker.steps import EvenRounds, IndependentSteps, StepPlan
from sparkbus.worker.used import Resume, UsedBatches

log = logging.getLogger("sparkbus.worker")

DEFAULT_PREFETCH_BYTES = 8 << 20


class BatchStream:
    """Batches of one stream for this rank, as dicts of columns, one epoch at a time.

    A column is a numpy array for numbers of a fixed shape (``[n]``, or ``[n, k, ...]`` for arrays that share
    one length within the batch), a numpy masked array where such a column holds nulls in the batch, and a
    :class:`~worker.RaggedColumn` for binary, strings and arrays of varying length (or declared
    ``feed(..., ragged=[...])``). See docs/PROTOCOL.md, "Column layouts".

    Args:
        address: the broker's ranks address, e.g. ``tcp://broker-host:5556``; or several brokers' (a list, or a
            comma-separated string): the rank consumes from all of them, and an epoch ends when every broker has
            ended it. None: the variable ``SPARKBUS_RANKS_ADDRESS``.
        comm: an mpi4py communicator whose ranks consume the stream together, or None.
        rank, size: this rank's number and its group's size, for ranks started by anything (torchrun, srun,
            mpirun, Ray Train, plain processes): they consume the stream together without MPI (mpi4py is not
            imported), their equal steps granted by the broker. ``rank="auto"`` takes both from the launcher
            (:func:`worker.launcher.launcher_rank`: an initialised ``torch.distributed`` first, then ``RANK``/
            ``WORLD_SIZE``, ``OMPI_COMM_WORLD_*``, ``PMI_*``, ``SLURM_PROCID``/``SLURM_NTASKS``). Not with ``comm``.
            With neither ``comm`` nor ``rank``, this process consumes on its own (an independent consumer).
        stream: the stream name the feeder used.
        prefetch, prefetch_bytes: the window granted to each broker: up to ``prefetch`` batches in flight to this
            rank (the one in use included), or as many as fit in ``prefetch_bytes`` (8 MiB), whichever admits
            more: many small batches, a few large ones. The defaults suit batches from 1 KiB to 16 MiB.
        even: yield the same number of batches on every rank of the group each epoch (default: when its size is
            above 1). What is left over at the epoch's end (fewer batches than ranks) follows ``remainder``.
        remainder: with ``even``, what the batches left over at an epoch's end become (every rank of the group must
            pass the same): ``"split"`` (default) shares them out by rows, one piece a rank, so that every row is
            trained once and the last step is smaller (with fewer rows than ranks, some ranks' last step has 0 rows);
            ``"drop"`` drops them (at most ``size - 1`` per broker, counted in ``stats.dropped_batches``, handed to
            ``on_drop``); ``"pad"`` gives every rank a whole batch, repeating some for the ranks short of one
            (counted in ``stats.repeated_batches``). See docs/GUARANTEES.md, "Equal steps and every row".
        steps: how even steps are kept: ``"broker"`` (granted by the broker, the default, with ``comm`` too) or
            ``"mpi"`` (agreed among the ranks of ``comm`` in MPI collectives). See docs/GUARANTEES.md.
        timeout: seconds the broker may stay silent (it heartbeats while idle) before this rank gives up.
        verify: check each batch's XXH3-64 checksum.
        heartbeat: seconds between this rank's heartbeats while it waits.
        on_drop: called with each batch dropped to keep the ranks even (``remainder="drop"``).
        abort_on_error: when an exception leaves the ``with`` block on one rank of a communicator of size > 1,
            call ``comm.Abort(1)`` so that the other ranks are not left waiting in a collective forever.
        context: a ZeroMQ context to use (needed for ``inproc://`` addresses); by default a private one.
        key, broker_key: for a broker run with ``--auth``: this rank's ``.key_secret`` file (a key allowed in the
            ranks role) and the broker's ``.key`` file; default the variables ``SPARKBUS_KEY`` and
            ``SPARKBUS_BROKER_KEY`` (``mpiexec -genv`` passes them to every rank).
        resume: this rank's :meth:`state_dict` saved with a checkpoint, to resume from it exactly: after joining,
            the rank tells every broker what the checkpointed model had used of the epoch (``RECLAIM`` with
            ``lost=""``), and its first :meth:`epoch` yields only what the brokers deliver of it: the rest. The
            feed must re-feed that epoch for a resume (``feed_epochs(..., resume=...)``). ``stats`` count the
            steps taken before the checkpoint in ``resumed_batches``, apart from ``batches``. To resume on another
            number of ranks, pass every rank's state of the checkpoint as a list (``resume=[s0, ..., sN-1]``,
            each new rank the same list): what they had used together is not delivered again, and the rest is
            shared over the new group with equal steps (docs/TRAINING.md, "Resuming").
    Raises:
        BrokerError: the broker does not answer within ``timeout``, refuses this rank, or goes silent (with
            several brokers: every one of them; one gone while others answer is read on without, its batches
            recomputed by Spark), or ``resume`` with a broker of protocol version 5.
        ValueError: ``comm`` with ``rank``/``size``, ``rank`` without ``size`` (or the other way round), a rank
            outside the group, ``rank="auto"`` without a launcher, ``steps="mpi"`` without ``comm``; a ``resume``
            state that is not a ``state_dict`` of this stream, rank and group size.

    The columns of a batch are read-only views of the received frames; copy one to modify it.
    """

    def __init__(self, address: str | Sequence[str] | None = None, comm: Any = None, stream: str = "train",
                 prefetch: int = 4, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES, even: bool | None = None,
                 timeout: float = 60.0, verify: bool = True, heartbeat: float = 1.0,
                 on_drop: Callable[[Batch], None] | None = None, abort_on_error: bool = True,
                 context: zmq.Context | None = None, key: str | None = None, broker_key: str | None = None,
                 rank: int | str | None = None, size: int | None = None, steps: str = "broker",
                 resume: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None, remainder: str = "split"):
        if prefetch < 1 or prefetch_bytes < 0:
            raise ValueError("prefetch must be at least 1 and prefetch_bytes not negative")
        self.remainder = check_remainder(remainder)
        self.address, self.comm, self.stream = address, comm, stream
        self.rank, self.size = _group(comm, rank, size)
        resumed = None if resume is None else _resume_state(resume, stream, self.rank, self.size)
        self.even = (self.size > 1) if even is None else even and self.size > 1
        if steps not in ("broker", "mpi") or (steps == "mpi" and comm is None and self.even):
            raise ValueError(f"steps must be 'broker' or 'mpi' (which needs comm=), not {steps!r}")
        self.granted = self.even and steps == "broker"
        self.timeout, self.verify, self.heartbeat, self.on_drop = timeout, verify, heartbeat, on_drop
        self.prefetch, self.prefetch_bytes, self.abort_on_error = prefetch, prefetch_bytes, abort_on_error
        self.stats = StreamStats()
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._brokers: list[BrokerConnection] = []
        try:
            for broker in broker_addresses(address, "SPARKBUS_RANKS_ADDRESS"):
                self._brokers.append(BrokerConnection(broker, self._context, stream=stream, rank=self.rank,
                                                      size=self.size, even=self.even, prefetch=prefetch,
                                                      prefetch_bytes=prefetch_bytes, timeout=timeout,
                                                      heartbeat=heartbeat, key=key, broker_key=broker_key,
                                                      grants=self.granted, remainder=self.remainder,
                                                      resume=None if resumed is None else
                                                      Resume(resumed["epoch"], resumed["used"], resumed["cuts"])))
        except BaseException:
            self._close_connections()
            raise
        self._intake = Intake(self._brokers, self.stats, self._figures, verify=verify, heartbeat=heartbeat,
                              progress_every=prefetch)
        self._ep = EpochStats(epoch=-1)           # the epoch whose figures the brokers are told
        self._in_epoch = False                    # epoch() is between its first and its last step
        self._buffers: weakref.WeakSet[Any] = weakref.WeakSet()   # shuffle buffers fed from this stream
        self._resumed = resumed                   # the state resumed from, until its epoch begins
        if resumed is not None:
            self._intake.resume(resumed["epoch"], resumed["used"], resumed["cuts"])
            log.info("rank %d of stream %r resumes from its state (resume=) at epoch %d, step %d: the steps before "
                     "it were taken before the checkpoint, the rest of the epoch comes", self.rank, stream,
                     resumed["epoch"], resumed["steps"])

    def _figures(self) -> dict[str, float | int]:
        # What this rank tells its brokers about itself, over every epoch so far: batches consumed, data-wait, the
        # part of it spent waiting for peers, and the loop's own time (ACK's fields, docs/PROTOCOL.md).
        stats, ep = self.stats, self._ep
        wait = self._intake.wait                  # the wait it is in, told at heartbeats while it lasts
        waiting = 0.0 if wait is None else time.monotonic() - wait.since
        for_peers = waiting if wait is not None and wait.for_peers else 0.0
        return {"consumed": stats.batches + ep.batches, "wait_s": stats.wait_seconds + ep.wait_seconds + waiting,
                "peer_wait_s": stats.peer_wait_seconds + ep.peer_wait_seconds + for_peers,
                "step_s": stats.step_seconds + ep.step_seconds}

    def _service(self) -> None:
        """Keep the broker connections alive (what a wait in an MPI collective calls)."""
        self._intake.service()

    # ---- epochs -------------------------------------------------------------------------------------------

    def epoch(self) -> Iterator[Batch]:
        """Yield the next epoch's batches, each a dict of columns (see the class), until every broker has ended it.

        A batch is acknowledged when the loop asks for the next one. With ``even``, every rank of the group
        yields the same number of batches (ranks must all iterate the epoch, and if they stop early, all at
        the same step). Leaving an epoch early (``break``) acknowledges the batch in hand; the next call first
        skips what is left of that epoch on this rank, counted in ``stats.skipped_batches``.

        A broker that loses its state without a journal (docs/design/RECOVERY.md) does not end the epoch: what
        this rank held of it unused is dropped, and Spark's recomputation of its partitions brings the rest, less
        what this rank had used (told the brokers in ``RECLAIM``). A broker silent past ``timeout`` while others
        answer is gone for good: the epoch goes on with the others.

        Raises:
            BrokerError: the only broker (or every broker) goes silent for longer than ``timeout``, or a broker
                reports an error.
            ProtocolError: a malformed batch (checksum or shape mismatch).
        """
        if self._intake.unfinished:
            self._skip_rest_of_epoch()
        ep = self._ep = EpochStats(epoch=-1)
        if self._resumed is not None:
            ep.resumed_batches, self._resumed = self._resumed["steps"], None
        started = time.monotonic()
        self._intake.begin_epoch()
        plan: StepPlan
        if self.granted:
            plan = GrantedSteps(self._intake, ep, self.on_drop)
        elif self.even:
            plan = EvenRounds(self._intake, self.comm, ep, prefetch=self.prefetch,
                              prefetch_bytes=self.prefetch_bytes, on_drop=self.on_drop, remainder=self.remainder)
        else:
            plan = IndependentSteps(self._intake, ep)
        self._intake.forget = getattr(plan, "forget", None)
        steps = plan.steps()
        holding: BatchHeader | None = None           # the header of the batch the loop has now (acknowledged on next)
        try:
            for step in steps:
                if ep.first_batch_seconds < 0:
                    ep.first_batch_seconds = time.monotonic() - started
                self._count(ep, step.header, step.batch)
                self._intake.note_used(step.header)
                holding = step.header if step.acknowledge else None
                self._in_epoch = True
                handed = time.monotonic()
                yield step.batch
                ep.step_seconds += time.monotonic() - handed
                if holding is not None:
                    header, holding = holding, None
                    self._intake.ack(header)
        finally:
            try:
                steps.close()                 # a loop that left early: the plan settles what it started
            finally:
                self._in_epoch = False
                self._intake.forget = None
                if holding is not None:       # the loop left with a batch in hand: it was consumed
                    self._intake.ack(holding)
                self._intake.flush()
                ep.seconds = time.monotonic() - started
                self.stats.add(ep)
                self.stats.rejoins = sum(b.rejoins for b in self._intake.connections)

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's position in the stream, to save with a model checkpoint and pass back as ``resume=``.

        Inside the ``for batch in stream.epoch()`` loop (between steps: the batch in hand counts as used), the
        open epoch and every batch of it this rank used, wherever it came from; between epochs, the next epoch
        and nothing used. **One per rank**: each rank saves its own (``torch.save`` per rank, or gathered).

        Returns:
            ``{"format": 2, "stream", "rank", "size", "epoch", "steps", "used": [[part, seq, first, stop,
            checksum], ...], "cuts": [[part, seq, index, lo, hi, checksum], ...]}``: plain ints, strings and lists
            (JSON and msgpack safe). ``steps``: the steps taken of the epoch (those before a checkpoint this stream
            resumed from included); ``cuts``: rows ``lo..hi-1`` of batches used in part (a piece of the epoch's
            remainder). ``resume=`` also takes format 1 (sparkbus 0.2), which has no ``cuts``.
        Raises:
            ValueError: a :class:`~worker.ShuffleBuffer` (or :func:`~worker.shuffled`) given ``stream=`` this
                stream holds rows: the model has not trained them, yet they were taken from the stream, so a
                position mid-epoch would not be exact. Take the state between epochs, or shuffle with a buffer of
                one batch. (A buffer not given ``stream=`` cannot be seen: the state is then wrong by its rows.)
        """
        held = sum(len(buffer) for buffer in self._buffers)
        if held:
            raise ValueError(f"a shuffle buffer of stream {self.stream!r} holds rows of {held} batches that the model "
                             f"has not trained: a state mid-epoch would not be exact; take it between epochs, or "
                             f"shuffle with a buffer of one batch")
        if self._resumed is not None:
            return dict(self._resumed, used=[list(e) for e in self._resumed["used"]],
                        cuts=[list(c) for c in self._resumed["cuts"]])
        cuts: list[list[int]] = []
        if self._in_epoch:
            epoch, steps = self._intake.current, self._ep.resumed_batches + self._ep.batches
            record = self._intake.used()
            used, cuts = [list(e) for e in record.entries()], [list(c) for c in record.cuts()]
        else:
            epoch, steps, used = max([self._intake.current, *(b.ended for b in self._brokers)]) + 1, 0, []
        return {"format": 2, "stream": self.stream, "rank": self.rank, "size": self.size, "epoch": epoch,
                "steps": steps, "used": used, "cuts": cuts}

    def track_buffer(self, buffer: Sized) -> None:
        """A shuffle buffer fed from this stream (``ShuffleBuffer(..., stream=)``): :meth:`state_dict` refuses while
        it holds batches (``len``). Kept weakly."""
        self._buffers.add(buffer)

    def _skip_rest_of_epoch(self) -> None:
        log.warning("rank %d left the previous epoch before its end; skipping its remaining batches", self.rank)
        ignored = self._ep = EpochStats(epoch=-1)
        while self._intake.unfinished and (item := self._intake.next_batch(ignored)) is not None:
            self._intake.ack(item.header, send=False)
            self.stats.skipped_batches += 1
        self._intake.flush()

    @staticmethod
    def _count(ep: EpochStats, header: BatchHeader, batch: Batch) -> None:
        ep.batches += 1
        ep.rows += header["rows"]
        if "cut" in header:
            ep.cut_batches += 1
        if header.get("repeat"):
            ep.repeated_batches += 1
            ep.repeated_rows += header["rows"]
        nbytes = header.get("nbytes")         # not on a batch that came from another rank at the epoch's end
        ep.bytes += nbytes if nbytes is not None else sum(a.nbytes for a in batch.values())

    # ---- lifetime -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the broker this rank leaves (its unacknowledged batches go to other ranks), then close."""
        if not self._brokers or self._brokers[0].closed:
            return
        try:
            for broker in self._brokers:
                broker.bye()
        finally:
            self._close_connections()

    def _close_connections(self) -> None:
        for broker in self._brokers:
            broker.close()
        if self._own_context:
            self._context.term()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and self.abort_on_error and self.comm is not None and self.size > 1:
            log.critical("rank %d failed: %r; aborting the MPI job so the other ranks do not wait forever",
                         self.rank, exc, exc_info=(exc_type, exc, tb))
            self.comm.Abort(1)
        self.close()


def _resume_state(state: Mapping[str, Any] | Sequence[Mapping[str, Any]], stream: str, rank: int,
                  size: int) -> dict[str, Any]:
    """``state`` (a :meth:`BatchStream.state_dict`) checked for this stream, rank and group size; or every rank's
    state of one checkpoint (a list of a group of N's), merged for a rank of a group of any size: what the
    checkpointed model had used, all ranks' together.

    Raises:
        ValueError: not a state of format 1 or 2, of another stream, rank or size, or malformed ``used`` entries
            or ``cuts``; a list that is not ranks 0..N-1 of one group and one epoch.
    """
    if isinstance(state, Sequence) and not isinstance(state, (str, bytes)):
        states = [_parsed_state(one, stream) for one in state]
        if not states:
            raise ValueError("resume=[...] takes every rank's state_dict() of one checkpoint, not an empty list")
        group = states[0]["size"]
        if (sorted(one["rank"] for one in states) != list(range(group)) or any(one["size"] != group for one in states)
                or len({one["epoch"] for one in states}) != 1):
            raise ValueError(f"resume=[...] takes every rank's state_dict() of one checkpoint: ranks 0..N-1 of a "
                             f"group of N, at one epoch; got ranks {sorted(one['rank'] for one in states)} of groups "
                             f"{sorted({one['size'] for one in states})} at epochs "
                             f"{sorted({one['epoch'] for one in states})}")
        used = UsedBatches()
        for one in states:
            used.update(one["used"], one["cuts"])
        return {"format": 2, "stream": stream, "rank": rank, "size": size, "epoch": states[0]["epoch"],
                "steps": max(one["steps"] for one in states), "used": used.entries(),
                "cuts": used.cuts(), "from_size": group}
    parsed = _parsed_state(state, stream)
    for name, mine in (("rank", rank), ("size", size)):
        if parsed[name] != mine:
            raise ValueError(f"resume= has the state of {name} {parsed[name]!r}, but this BatchStream is "
                             f"{name} {mine!r}: pass each rank its own state_dict(), or every rank's as a list "
                             f"(resume=[...]) to resume on another number of ranks")
    return parsed


def _parsed_state(state: Any, stream: str) -> dict[str, Any]:
    """One rank's ``state_dict()``, checked for its form and stream."""
    if not isinstance(state, Mapping) or state.get("format") not in (1, 2):
        raise ValueError("resume= takes a BatchStream.state_dict() (format 2, or format 1 of sparkbus 0.2)")
    if state.get("stream") != stream:
        raise ValueError(f"resume= has the state of stream {state.get('stream')!r}, but this BatchStream is "
                         f"stream {stream!r}: pass each rank its own state_dict()")
    epoch, steps, used = state.get("epoch"), state.get("steps"), state.get("used")
    entries: list[UsedEntry] = []
    if type(epoch) is not int or epoch < 0 or type(steps) is not int or steps < 0 or not isinstance(used, list) \
            or type(state.get("rank")) is not int or type(state.get("size")) is not int:
        raise ValueError("resume= has a state whose epoch, steps, rank, size or used are malformed")
    for entry in used:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 5 or any(type(n) is not int for n in entry)
                or not 0 <= entry[2] < entry[3]):
            raise ValueError(f"resume= has a malformed used entry {entry!r} (want [part, seq, first, stop, checksum])")
        entries.append(UsedEntry(*entry))
    cuts: list[UsedCut] = []
    for cut in state.get("cuts", []) if state["format"] == 2 else []:
        if (not isinstance(cut, (list, tuple)) or len(cut) != 6 or any(type(n) is not int for n in cut)
                or not 0 <= cut[3] < cut[4]):
            raise ValueError(f"resume= has a malformed cut {cut!r} (want [part, seq, index, lo, hi, checksum])")
        cuts.append(UsedCut(*cut))
    return {"format": 2, "stream": stream, "rank": state["rank"], "size": state["size"], "epoch": epoch,
            "steps": steps, "used": entries, "cuts": cuts}


def _group(comm: Any, rank: int | str | None, size: int | None) -> tuple[int, int]:
    """This rank's number and its group's size, from ``comm`` or ``rank``/``size`` (see ``BatchStream``)."""
    if comm is not None:
        if rank is not None or size is not None:
            raise ValueError("pass comm= or rank= and size=, not both: with comm, the rank and size are comm's")
        return comm.Get_rank(), comm.Get_size()
    if rank is None:
        if size is not None:
            raise ValueError("size= needs rank= (this process's number in the group), or rank='auto'")
        return 0, 1
    if rank == "auto":
        found, found_size, source = launcher_rank()
        if size is not None and size != found_size:
            raise ValueError(f"size={size}, but {source} says the group has {found_size} ranks")
        log.info("rank %d of %d, from %s", found, found_size, source)
        rank, size = found, found_size
    if isinstance(rank, str) or isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"rank must be a number or 'auto', not {rank!r}")
    if size is None:
        raise ValueError("rank= needs size= (the number of ranks in the group), or use rank='auto'")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of size {size}")
    return rank, size
