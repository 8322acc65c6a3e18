"""A rank's connection to one broker: join, window, heartbeats, acknowledgements, and rejoining.

An ACK leaves when the training loop comes back for its next batch: what a rank that dies had consumed is then
never trained again elsewhere. It acknowledges a whole message, so a pack of small batches costs one ACK, and
acknowledgements that arise together (the rest of an epoch skipped or pooled at its end, redeliveries of batches
the rank has) share one message.

The connection keeps what the broker needs to hear when this rank comes back after its connection was lost (a
cut link, a firewall that dropped the FIN, a restarted broker): the ids of the current epoch's batches it
received (:meth:`BrokerConnection.arrived`), and which of those it acknowledged (:meth:`BrokerConnection.ack`).
Its HELLO then carries them (``resume``), and the broker neither sends those batches again nor hands them to
another rank. See docs/PROTOCOL.md, "A rank".

It also keeps the **incarnation** of its broker (``WELCOME.incarnation``) and whether that broker has a journal. A
rejoin names the incarnation it knew (``HELLO.incarnation``, version 6); a ``WELCOME`` of another incarnation
without a journal means the broker lost its state: :meth:`BrokerConnection.receive` then gives a ``LOST`` of the
old incarnation (``restarted: True``, never sent by a broker) for :class:`~worker.intake.Intake` to handle, and a
broker silent past ``timeout`` raises :class:`BrokerSilent`, which the intake takes for a broker gone for good when
others still answer (docs/design/RECOVERY.md, "The rank").
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import zmq

from sparkbus.broker.auth import client_socket
from sparkbus.wire import protocol
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.headers import FromBroker, HeartbeatHeader, LostHeader, ToIntake, WelcomeHeader
from sparkbus.wire.protocol import RESUME_LOSS, ErrorCode, Kind, pack_header, unpack_header
from sparkbus.wire.records import BatchId, UsedCut, UsedEntry
from sparkbus.worker.used import Resume, UsedBatches

log = logging.getLogger("sparkbus.worker")

ACK_MAX = 256          # ids in one ACK at most

UNANSWERED_WARNING = 5.0     # seconds without a WELCOME before a joining rank warns, naming the address
UNANSWERED_REPEAT = 30.0     # ... and again this often while it keeps trying until its timeout

WHAT_TO_DO = ("restart the brokers and feed the epoch again, or run the brokers with --journal so that a restarted "
              "broker keeps what it had")


class Returned(NamedTuple):
    """A message a rank gives back (RETURN, :meth:`BrokerConnection.give_back`): its id, the first of its batches
    given back (0: a batch that is not a pack, or all of a pack), and whether that is all this rank had of it."""

    batch_id: BatchId
    first: int
    whole: bool


class BrokerSilent(BrokerError):
    """A broker said nothing for the connection's ``timeout``: it is gone, or the link to it is cut. ``broker``: the
    connection. With other brokers that still answer, the rank reads on from them (:class:`~worker.intake.Intake`)."""

    def __init__(self, message: str, broker: BrokerConnection):
        super().__init__(message)
        self.broker = broker


class BrokerConnection:
    """The DEALER socket of one rank to one broker's ranks socket, and the rank's standing with that broker.

    Args:
        address: the broker's ranks address.
        context: the ZeroMQ context to make the socket in.
        stream, rank, size, even: what the rank announces in HELLO.
        prefetch, prefetch_bytes: the window: the broker may have up to ``prefetch`` batches in flight to this
            rank (the one in use included), or as many as fit in ``prefetch_bytes``, whichever admits more.
        timeout: seconds the broker may stay silent, or keep refusing a rejoin, before :class:`BrokerError`.
        heartbeat: seconds between this rank's heartbeats (and HELLO retries) while it waits.
        key, broker_key: CURVE key files for a broker run with ``--auth`` (a rank key; see ``BatchStream``).
        grants, remainder: steps granted by the broker, and what the epoch's remainder becomes (``wire.remainder``).
        resume: ``(epoch, entries, cuts)`` of a rank that resumes from a checkpoint: its ``RECLAIM(lost="")``, sent
            right after the WELCOME and before the first CREDIT, so that the broker has it before it sends anything.
    Raises:
        BrokerError: no broker answers within ``timeout``, or it refuses this rank for good; ``resume`` with a
            broker of version 5.
    """

    def __init__(self, address: str, context: zmq.Context, *, stream: str, rank: int, size: int, even: bool,
                 prefetch: int, prefetch_bytes: int, timeout: float, heartbeat: float, key: str | None = None,
                 broker_key: str | None = None, grants: bool = False, remainder: str = "split",
                 resume: Resume | None = None):
        self.address, self.stream, self.rank, self.size, self.even = address, stream, rank, size, even
        self.grants, self.remainder = grants, remainder
        self.prefetch, self.prefetch_bytes, self.timeout, self.heartbeat = prefetch, prefetch_bytes, timeout, heartbeat
        self._figures: dict[str, float | int] = {}   # the rank's own figures, sent with ACKs and heartbeats
        # ... and, if set, asked for afresh at each heartbeat: a rank waiting long for data says so while it waits
        self.figures_now: Callable[[], dict[str, float | int]] | None = None
        self._unsent: list[int] = []                 # acknowledged ids not yet sent: epoch, part, seq, ...
        self._upto: list[int] = []                   # progress in packs not yet sent: epoch, part, seq, stop, ...
        self._inbox: deque[tuple[ToIntake, list[zmq.Frame]]] = deque()   # kept by service() while the rank waited
        self.session = secrets.token_hex(8)           # the same across reconnections of this rank
        self.version = protocol.VERSION               # the connection's: an older broker's, once it said so
        self._received: set[tuple[int, ...]] = set()  # batch ids of the current epoch that arrived (a piece
        self._acked: set[BatchId] = set()             # of a pack: its id and first batch); acknowledged ids
        self.ended = -1                               # the last epoch whose EPOCH_END arrived
        self.got = 0                                  # batches of the current epoch received (a pack's each), kept
        self.rejoins = 0
        self.incarnation = ""                         # the broker's, from its WELCOME
        self.journal = False                          # ... and whether it keeps a journal
        self.adopted = 0                              # STEPS.adopted of the current epoch (granted steps)
        self.used = UsedBatches()                     # what the rank used of this incarnation in its current epoch
        self._req = 0
        self._rejoin_since: float | None = None       # when the broker said it no longer knew this rank
        self._refusal = ""
        self._unread: tuple[str, ...] = ()            # streams no rank reads, last said by the broker (warned once)
        self._sock = client_socket(context, zmq.DEALER, key, broker_key)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat * 1000))    # transport-level, answered by libzmq
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * heartbeat * 1000))
        self._sock.connect(address)
        self._last_heard = self._last_said = time.monotonic()
        self.resumes = None if resume is None else resume[0]   # the epoch this rank resumes from a checkpoint
        try:
            self._join(resume)
        except BaseException:
            self._sock.close(linger=0)
            raise

    # ---- saying things --------------------------------------------------------------------------------------

    def _say(self, kind: Kind, **fields: Any) -> None:
        self._sock.send(pack_header(kind, v=self.version, **fields))
        self._last_said = time.monotonic()

    def _hello(self, resume: bool) -> None:
        self._req += 1
        optional: dict[str, Any] = {}
        if self.grants:                   # the rank's count at this broker: what it got, and what was adopted here
            optional.update(grants=True, got=self.got + self.adopted)
            if self.version >= 7:
                optional["remainder"] = self.remainder
        if resume and self.incarnation and self.version >= 6:
            optional["incarnation"] = self.incarnation      # a broker restarted without journal ignores the ids
        if self.resumes is not None and self.version >= 7:
            optional["resumes"] = self.resumes              # a group of another size may take over that epoch
        header = pack_header(Kind.HELLO, v=self.version, req=self._req, role="rank", stream=self.stream, rank=self.rank,
                             size=self.size, even=self.even, session=self.session, resume=resume,
                             ended=self.ended, **optional)
        if resume:
            self._unsent, self._upto = [], []            # the HELLO names every batch consumed
            held = {BatchId(key[0], key[1], key[2]) for key in self._received} - self._acked
            # ... and the batches service() kept while the rank waited for its peers: they are the rank's too
            held.update(protocol.batch_id(header) for header, _ in self._inbox if header["kind"] == Kind.BATCH)
            self._sock.send_multipart([header, protocol.pack_ids(held), protocol.pack_ids(self._acked)])
        else:
            self._sock.send(header)
        self._last_said = time.monotonic()

    def _grant_window(self) -> None:
        # Absolute: batches this rank still holds stay in flight to it, and the broker counts them in the window.
        self._say(Kind.CREDIT, window=self.prefetch, window_bytes=self.prefetch_bytes)

    def arrived(self, batch_id: BatchId, first: int = 0, rows: tuple[int, int] | None = None) -> bool:
        """Note that a BATCH of the current epoch arrived (``first``: the first batch of a piece of a pack;
        ``rows``: the rows of a piece of an epoch's remainder). False if this rank had it already (a redelivery
        after a rejoin, or of a restarted broker): drop it; a copy this rank holds unacknowledged then counts as
        consumed, acknowledged with the next flush."""
        key: tuple[int, ...] = (*batch_id, first) if first else batch_id
        if rows is not None:
            key = (*batch_id, first, *rows)
        if key not in self._received:
            self._received.add(key)
            return True
        if batch_id not in self._acked:
            self.ack(batch_id, send=False)
        return False

    def give_back(self, epoch: int, returned: list[Returned], kept: int) -> None:
        """RETURN: batches this rank got and has not used, to even the epoch out (granted steps), one
        :class:`Returned` per message. ``kept``: the batches of the epoch this rank keeps. Acknowledgements that wait
        leave first."""
        self.flush()
        ids: list[int] = []
        for batch_id, first, whole in returned:
            ids.extend((*batch_id, first))
            if whole:               # no longer this rank's: a rejoin must not name it as held
                self._received.discard(batch_id if not first else (*batch_id, first))
        self._say(Kind.RETURN, stream=self.stream, epoch=epoch, ids=ids, kept=kept)

    def ack(self, batch_id: BatchId, send: bool = True) -> None:
        """Acknowledge one batch (or pack): the loop is done with it. ``send=False`` keeps the id for the next
        :meth:`flush`, to acknowledge several in one message (they leave anyway once ``ACK_MAX`` wait)."""
        self._acked.add(batch_id)
        self._unsent.extend(batch_id)
        if send or len(self._unsent) >= 3 * ACK_MAX:
            self.flush()

    def progress(self, batch_id: BatchId, stop: int, send: bool = True) -> None:
        """The loop is done with a pack's batches before ``stop`` (the pack itself is acknowledged with its last
        batch): the broker cuts them off it, so that only the rest goes to another rank should this one die."""
        self._upto.extend((*batch_id, stop))
        if send or len(self._upto) >= 4 * ACK_MAX:
            self.flush()

    def reclaim(self, epoch: int, lost: str, entries: Sequence[UsedEntry], cuts: Sequence[UsedCut] = ()) -> None:
        """RECLAIM: of ``epoch``, the batches this rank used of the broker of incarnation ``lost``
        (:data:`~wire.protocol.RESUME_LOSS`: its position at a checkpoint), as ``(part, seq, first, stop, checksum)``
        entries, and the rows it used of batches it used part of (``cuts``; a broker of version 6 cannot take them).
        Nothing to a broker of version 5, which has no recovery."""
        if self.version < 6:
            return
        optional: dict[str, Any] = {}
        if cuts and self.version >= 7:
            optional["cuts"] = [n for cut in cuts for n in cut]
        self._sock.send_multipart([pack_header(Kind.RECLAIM, v=self.version, stream=self.stream, epoch=epoch,
                                               lost=lost, entries=len(entries), **optional),
                                   protocol.pack_used(entries)])
        self._last_said = time.monotonic()

    def forget_epoch(self) -> None:
        """The broker lost what it had of this rank: the ids of the current epoch, the count, and what waits to be
        acknowledged name batches it no longer knows."""
        self._received.clear()
        self._acked.clear()
        self._unsent, self._upto = [], []
        self.got = self.adopted = 0

    def report(self, **figures: float | int) -> None:
        """Set this rank's own figures (``consumed``, ``wait_s``, ``first_batch_s``: see ``ACK`` in
        docs/PROTOCOL.md); they go with its next ACK or heartbeat."""
        self._figures.update(figures)

    def flush(self) -> None:
        """Send the acknowledgements that wait, if any."""
        if self._upto:
            self._say(Kind.ACK, ids=self._unsent, upto=self._upto, **self._figures)
            self._unsent, self._upto = [], []
        elif self._unsent:
            self._say(Kind.ACK, ids=self._unsent, **self._figures)
            self._unsent = []

    def service(self) -> None:
        """While the rank waits for its peers (an MPI collective): heartbeat, rejoin if the broker lost this rank,
        and keep what the broker sends for :meth:`receive`. A rank that cannot rejoin while its peers wait for it
        would leave a stream that waits for every rank stuck."""
        while (message := self._from_socket(block=False)) is not None:
            self._inbox.append(message)

    def bye(self) -> None:
        """Tell the broker this rank leaves: what it holds unacknowledged goes to the other ranks at once."""
        self.flush()
        self._say(Kind.BYE)

    def close(self) -> None:
        self._sock.close(linger=200)     # long enough for BYE to leave, never a hang

    @property
    def closed(self) -> bool:
        return self._sock.closed

    @property
    def socket(self) -> zmq.Socket:
        """The DEALER socket, to poll several connections at once."""
        return self._sock

    # ---- joining ----------------------------------------------------------------------------------------------

    def _join(self, resume: Resume | None) -> None:
        """The first HELLO (and a resuming rank's RECLAIM). A rank number still held by a dead process's connection
        is retried until ``timeout``."""
        started = time.monotonic()
        deadline, warn_at = started + self.timeout, started + UNANSWERED_WARNING
        self._hello(resume=False)
        while True:
            remaining = deadline - time.monotonic()
            wait = min(remaining, self.heartbeat, max(warn_at - time.monotonic(), 0.05))
            if remaining <= 0 or not self._sock.poll(int(wait * 1000)):
                now = time.monotonic()
                if now >= warn_at and now < deadline:
                    warn_at = now + UNANSWERED_REPEAT
                    self._warn_unanswered(now - started, deadline - now)
                if now < deadline:
                    continue
                if self._refusal:
                    raise BrokerError(f"the broker at {self.address} refused rank {self.rank} for "
                                      f"{self.timeout:g} s: {self._refusal}")
                raise BrokerError(f"no answer from a sparkbus broker at {self.address} within {self.timeout:g} s: "
                                  f"is it running, and is this its ranks address?")
            header = cast(FromBroker, unpack_header(self._sock.recv_multipart()[0]))
            if header["kind"] == Kind.WELCOME and header["req"] == self._req:
                self.incarnation, self.journal = header["incarnation"], header["journal"]
                self._note_unread(header)
                break
            if header["kind"] == Kind.ERROR and header["code"] == ErrorCode.ALREADY_CONNECTED:
                # Another process had this rank (a job that died); the broker lets go of it once its connection
                # is found dead, so this refusal clears. Ask again.
                self._refusal = header["reason"]
                time.sleep(min(self.heartbeat, max(deadline - time.monotonic(), 0)))
                self._hello(resume=False)
            elif header["kind"] == Kind.ERROR and header["code"] == ErrorCode.VERSION and \
                    protocol.negotiated(header["v"]) not in (None, self.version):
                self._fall_back(header["v"])      # an older broker: speak its version (docs/PROTOCOL.md "Versions")
            elif header["kind"] == Kind.ERROR:
                raise BrokerError(f"the broker at {self.address} refused rank {self.rank}: {header['reason']}",
                                  code=header["code"])
            elif header["kind"] != Kind.HEARTBEAT:
                raise BrokerError(f"the broker at {self.address} answered HELLO with {header['kind'].name}")
        self._refusal = ""
        self._last_heard = time.monotonic()
        if resume is not None:
            if self.version < protocol.RECOVERY_VERSION:
                raise BrokerError(f"the broker at {self.address} speaks protocol version {self.version}, which "
                                  f"cannot resume an epoch exactly: upgrade it, or resume at an epoch boundary "
                                  f"without resume=", code=ErrorCode.VERSION)
            self.reclaim(resume.epoch, RESUME_LOSS, resume.entries, resume.cuts)
        self._grant_window()

    def _note_unread(self, header: WelcomeHeader | HeartbeatHeader) -> None:
        """The broker's ``unread`` (a HEARTBEAT or WELCOME, version 7): this rank's stream has nothing under way,
        while these streams hold data that no rank reads. Warned once for each new set of names."""
        unread = tuple(str(name) for name in header.get("unread", ()))
        if unread and unread != self._unread:
            log.warning("rank %d waits for an epoch of stream %r at the broker %s, which holds data of streams that "
                        "no rank reads: %s. Is the feed's stream= the same as the ranks' stream=?", self.rank,
                        self.stream, self.address, ", ".join(map(repr, unread)))
        self._unread = unread

    def _warn_unanswered(self, waited: float, left: float) -> None:
        """While joining: nothing has answered for ``waited`` seconds (a wrong address, a broker not started yet)."""
        if self._refusal:
            log.warning("rank %d: the broker at %s still refuses it after %.0f s (%s); trying until its timeout "
                        "(%.0f s left)", self.rank, self.address, waited, self._refusal, left)
        else:
            log.warning("rank %d: no answer from a sparkbus broker at %s after %.0f s: is it running, and is this "
                        "its ranks address (the feed port + 1)? Trying until its timeout (%.0f s left)", self.rank,
                        self.address, waited, left)

    def _fall_back(self, version: int) -> None:
        """HELLO again in the older ``version`` the broker speaks, if this rank needs nothing that version lacks."""
        if self.grants and version < 5:
            raise BrokerError(f"the broker at {self.address} speaks protocol version {version}, which has no granted "
                              f"steps: upgrade the broker, or pass comm= and steps='mpi'", code=ErrorCode.VERSION)
        log.warning("the broker at %s speaks protocol version %d; rank %d speaks it too", self.address, version,
                    self.rank)
        if self.grants and version < 7 and self.remainder != "drop":
            log.warning("the broker at %s (protocol version %d) drops the batches left over at an epoch's end "
                        "(remainder='drop'): upgrade it for remainder=%r", self.address, version, self.remainder)
        self.version = version
        self._hello(resume=False)

    def _rejoin(self, reason: str) -> None:
        """The broker does not know this rank (a new connection, or a restarted broker): HELLO with ``resume``,
        every heartbeat until welcomed; :class:`BrokerError` once refused for ``timeout`` seconds."""
        now = time.monotonic()
        if self._rejoin_since is None:
            log.warning("the broker at %s no longer knows rank %d (%s); joining again", self.address, self.rank,
                        reason)
            self._rejoin_since = now
        elif now - self._rejoin_since > self.timeout:
            raise BrokerError(f"rank {self.rank} could not rejoin the broker at {self.address} within "
                              f"{self.timeout:g} s: {self._refusal or reason}")
        elif now - self._last_said < self.heartbeat:
            return                       # a HELLO is on its way; its answer comes in order
        self._hello(resume=True)

    # ---- receiving --------------------------------------------------------------------------------------------

    def receive(self, block: bool = True) -> tuple[ToIntake, list[zmq.Frame]] | None:
        """The next BATCH, EPOCH_END (or, granted steps, STEPS and RELEASE) from the broker; heartbeats both ways
        while waiting, never spinning.

        Returns None only with ``block=False``, when nothing is waiting.
        Raises:
            BrokerError: the broker was silent for ``timeout``, could not be rejoined, or reported an error.
        """
        if self._inbox:
            return self._inbox.popleft()
        return self._from_socket(block)

    def _from_socket(self, block: bool) -> tuple[ToIntake, list[zmq.Frame]] | None:
        while True:
            now = time.monotonic()
            silent_for = now - self._last_heard
            if silent_for > self.timeout and not self._sock.poll(0):   # not read for a while is not silent
                raise BrokerSilent(f"the broker at {self.address} has been silent for {silent_for:.0f} s "
                                   f"(timeout {self.timeout:g} s): it is gone or unreachable, and what it held of "
                                   f"the epoch with it: {WHAT_TO_DO}", self)
            if self._rejoin_since is not None:
                self._rejoin(self._refusal)
            elif now - self._last_said >= self.heartbeat:
                if self.figures_now is not None:
                    self._figures.update(self.figures_now())
                self._say(Kind.HEARTBEAT, **self._figures)
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)    # no poll when one is waiting
            except zmq.Again:
                if (self._unsent or self._upto) and self._rejoin_since is None:
                    self.flush()                         # before waiting: the broker may be waiting for them
                if not block:
                    return None
                wait = min(self.heartbeat, self.timeout - silent_for)
                self._sock.poll(int(max(wait, 0.001) * 1000))
                continue
            # validated by unpack_header against its kind's schema: the types say the same (wire.headers)
            header = cast(FromBroker, unpack_header(frames[0].bytes))
            if header["kind"] == Kind.ERROR and self._rejoin_since is not None:
                self._refusal = header["reason"]        # refusals while rejoining do not count as "heard"
                continue
            self._last_heard = time.monotonic()
            if header["kind"] == Kind.STEPS:
                self.adopted = max(self.adopted, header.get("adopted", 0))
            if (header["kind"] == Kind.BATCH or header["kind"] == Kind.STEPS or header["kind"] == Kind.RELEASE
                    or header["kind"] == Kind.LOST):
                return header, frames[1:]
            if header["kind"] == Kind.EPOCH_END:
                self.ended = header["epoch"]
                self._received.clear()
                self._acked.clear()
                self.got = self.adopted = 0
                return header, frames[1:]
            if header["kind"] == Kind.ERROR and header["code"] == ErrorCode.UNKNOWN_RANK:
                self._refusal = ""
                self._rejoin(header["reason"])
            elif header["kind"] == Kind.WELCOME:
                if self._rejoin_since is not None and header["req"] == self._req:
                    self._rejoin_since = None
                    self.rejoins += 1
                    log.warning("rank %d rejoined the broker at %s", self.rank, self.address)
                    self._grant_window()
                    known, self.incarnation, self.journal = self.incarnation, header["incarnation"], header["journal"]
                    if known and known != self.incarnation and not self.journal and self.version >= 6:
                        # A restart without a journal: what this rank had of the old incarnation is lost with it.
                        lost: LostHeader = {"v": self.version, "kind": Kind.LOST, "stream": self.stream,
                                            "epoch": self.ended + 1, "lost": known, "restarted": True}
                        return lost, []
            elif header["kind"] == Kind.ERROR:
                raise BrokerError(f"the broker at {self.address} reported: {header['reason']}", code=header["code"])
            elif header["kind"] == Kind.HEARTBEAT:
                self._note_unread(header)
            else:
                log.warning("ignoring unexpected %s from the broker", header["kind"].name)
