"""The broker: one loop that owns three sockets and moves batches from Spark tasks to ranks within their windows.

==========  =========  ===========================================================================
socket      type       peers and traffic
==========  =========  ===========================================================================
feed        PULL       Spark tasks' PUSH sockets: BATCH frames. Not read while the buffer is full.
control     ROUTER     feeders' and drivers' DEALERs: HELLO, EPOCH_OPEN/CLOSE/RECOVER/QUERY, PARTITION_END/COMMIT, STATS
ranks       ROUTER     ranks' DEALERs: HELLO, CREDIT, ACK, HEARTBEAT, BYE, RETURN, RECLAIM, STATS;
                       BATCH, EPOCH_END, STEPS, RELEASE, LOST out
==========  =========  ===========================================================================

Batches are held as the frames they arrived in and forwarded as the same frames: only the header is decoded.
What to keep, commit, redeliver and when to pause the feed is decided by :class:`broker.ledger.Ledger`; this
module does the I/O and the timing (heartbeats, the grace of lost ranks, journal syncs, metrics snapshots).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import zmq

from sparkbus.broker.books import Outcome
from sparkbus.broker.config import BrokerConfig
from sparkbus.broker.events import BatchArrived
from sparkbus.broker.figures import Figures
from sparkbus.broker.guard import Guard
from sparkbus.broker.journal import Journal
from sparkbus.broker.ledger import Ledger, MissedEnd, Rejected, Reply
from sparkbus.broker.state import StreamState
from sparkbus.broker.status import paginate
from sparkbus.broker.versions import PeerVersions
from sparkbus.wire import protocol
from sparkbus.wire.address import control_address
from sparkbus.wire.errors import ProtocolError, VersionMismatch
from sparkbus.wire.headers import BatchHeader, HeartbeatHeader
from sparkbus.wire.protocol import ErrorCode, Kind, pack_header, unpack_header
from sparkbus.wire.requests import (
    AckHeader,
    ByeHeader,
    CreditHeader,
    EpochCloseHeader,
    EpochOpenHeader,
    EpochQueryHeader,
    EpochRecoverHeader,
    HelloHeader,
    PartitionClaimHeader,
    PartitionCommitHeader,
    PartitionEndHeader,
    ReclaimHeader,
    ReturnHeader,
    StatsRequestHeader,
)

log = logging.getLogger("sparkbus.broker")

IO_THREADS = 2          # ZeroMQ I/O threads: the feed's and the ranks' bytes are copied on two cores, not one
FEED_RCVHWM = 4         # messages per feeder connection queued in the broker beyond --max-buffer
BURST = 256             # requests drained from one socket before the others get a turn
FEED_BURST = 32         # batches read before acknowledgements are handled and batches sent on
POLL_MS = 100           # upper bound on how late a stop request or a heartbeat is noticed
REJOIN_FRAMES = ("held", "consumed")   # a rank's HELLO may carry these id frames (protocol.pack_ids)
BIND_ATTEMPTS = 20       # system-chosen feed ports tried until feed + 2 is free for the control socket


def _kind_of(frame: zmq.Frame | bytes) -> Kind | None:
    try:
        kind: Kind = unpack_header(frame.bytes if isinstance(frame, zmq.Frame) else frame)["kind"]
        return kind
    except ProtocolError:
        return None


# Frames a request may carry after its header, beyond none: a rank's HELLO with resume, its id frames; RECLAIM, one.
BODY_FRAMES: dict[Kind | None, int] = {Kind.HELLO: len(REJOIN_FRAMES), Kind.RECLAIM: 1}

# Per older version, the kinds it does not know: never sent to a peer of that version.
NEWER_KINDS = {version: frozenset().union(*(protocol.ADDED[v][0] for v in protocol.ADDED if v > version))
               for version in protocol.SUPPORTED}


class Broker:
    """The sparkbus broker. Construct with a :class:`BrokerConfig`, then :meth:`run` (blocks) or :meth:`stop`.

    Args:
        config: endpoints and limits.
        context: a ZeroMQ context to share (tests use ``inproc://``); by default the broker makes its own.
    """

    serves_curve = True      # --auth is applied: CURVE on every socket, ZAP answered by the loop (broker.guard)

    def __init__(self, config: BrokerConfig, context: zmq.Context | None = None):
        self.config = config
        self._context = context
        self._stop = threading.Event()
        self._reload = threading.Event()
        self.guard = Guard(config.auth, self._refused_peer)
        self.ledger = Ledger(Journal(config.journal, keep_stats=config.keep_epochs) if config.journal else None,
                             config.rejoin_grace, config.max_buffer)
        self.ledger.keep_epochs = config.keep_epochs
        self.peers = PeerVersions()      # connections of an older protocol version (docs/PROTOCOL.md "Versions")
        self.rejected: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.endpoints: dict[str, str] = {}
        self.incarnation = secrets.token_hex(8)
        self._started = time.monotonic()

    @property
    def streams(self) -> dict[str, StreamState]:
        return self.ledger.streams

    def stop(self) -> None:
        """Ask the loop to finish; safe from a signal handler or another thread."""
        self._stop.set()

    def reload(self) -> None:
        """Ask the loop to read the key directory again (SIGHUP); safe from a signal handler."""
        self._reload.set()

    # ---- lifecycle --------------------------------------------------------------------------------------

    def run(self) -> None:
        """Replay the journal, bind, serve until :meth:`stop`, close every socket."""
        if self.ledger.journal:
            self.ledger.replay()
        ctx = self._context or zmq.Context(io_threads=IO_THREADS)
        socks = {name: ctx.socket(kind) for name, kind in
                 (("feed", zmq.PULL), ("control", zmq.ROUTER), ("ranks", zmq.ROUTER))}
        metrics = None
        try:
            self.guard.secure(ctx, socks)
            for sock in socks.values():
                sock.linger = 0
                sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message)
            socks["feed"].rcvhwm = FEED_RCVHWM
            ranks = socks["ranks"]
            ranks.setsockopt(zmq.ROUTER_MANDATORY, 1)      # a gone rank is an error, not a silent drop
            ranks.sndhwm = 0                               # windows bound what is queued to a rank
            # Transport heartbeats: libzmq answers them even while the rank's Python is busy training, so a
            # connection closes only when the rank's process or host is gone, never for a long step.
            ranks.setsockopt(zmq.HEARTBEAT_IVL, int(self.config.heartbeat * 1000))
            ranks.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.config.dead_after * 1000))
            self._bind(socks)
            if self.config.metrics_port is not None:
                from sparkbus.broker.metrics import MetricsExporter  # prometheus-client only when metrics are asked for
                metrics = MetricsExporter(self.config.metrics_port, self.config.metrics_host)
                self.endpoints["metrics"] = f"http://{self.config.metrics_host}:{metrics.start()}/metrics"
            self._announce()
            self._loop(socks["feed"], socks["control"], ranks, metrics)
        except zmq.ContextTerminated:
            pass
        finally:
            if metrics is not None:
                metrics.stop()
            self.guard.close()
            for sock in socks.values():
                sock.close(linger=0)
            if self._context is None:
                ctx.term()
            if self.ledger.journal:
                self.ledger.journal.close()
            log.info("broker stopped")

    def _bind(self, socks: dict[str, zmq.Socket]) -> None:
        """Bind the three sockets. A feed port of ``*`` is chosen by the system, again until the derived control
        port (feed + 2) is free too; the ready file then says which ports were taken."""
        for attempt in range(BIND_ATTEMPTS):
            self._bind_one(socks["feed"], "feed", self.config.feed)
            control = self.config.control or control_address(self.endpoints["feed"])
            try:
                self._bind_one(socks["control"], "control", control)
                break
            except OSError:
                if self.config.control or not self.config.feed.endswith(":*") or attempt == BIND_ATTEMPTS - 1:
                    raise
                socks["feed"].unbind(self.endpoints["feed"])
        self._bind_one(socks["ranks"], "ranks", self.config.ranks)

    def _bind_one(self, sock: zmq.Socket, name: str, address: str) -> None:
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            raise OSError(f"cannot bind the {name} socket to {address}: {exc}") from None
        self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _announce(self) -> None:
        log.info("broker listening: feed %s, ranks %s, control %s, max buffer %d bytes%s",
                 self.endpoints["feed"], self.endpoints["ranks"], self.endpoints["control"],
                 self.config.max_buffer, f", journal {self.config.journal}" if self.config.journal else "")
        if self.config.ready_file:
            tmp = f"{self.config.ready_file}.tmp"
            with open(tmp, "w") as out:
                json.dump({**self.endpoints, "pid": os.getpid(), "incarnation": self.incarnation}, out)
            os.replace(tmp, self.config.ready_file)

    def _loop(self, feed: zmq.Socket, control: zmq.Socket, ranks: zmq.Socket, metrics: Any = None) -> None:
        self._ranks, self._control = ranks, control
        poller = zmq.Poller()
        for sock in (feed, control, ranks, *self.guard.sockets):
            poller.register(sock, zmq.POLLIN)
        guarded = set(self.guard.sockets)
        next_heartbeat = time.monotonic() + self.config.heartbeat
        while not self._stop.is_set():
            if self.ledger.update_feed_gate():
                poller.modify(feed, 0 if self.ledger.feed_paused else zmq.POLLIN)
            ready = dict(poller.poll(POLL_MS))
            for sock in guarded.intersection(ready):
                self.guard.handle(sock)
            if control in ready:
                self._drain(control, lambda frames: self._on_request(control, frames, "control"))
            if ranks in ready:
                self._drain(ranks, lambda frames: self._on_request(ranks, frames, "ranks"))
            if feed in ready:
                self._drain(feed, self._on_feed, until_full=True, burst=FEED_BURST)
            for stream in self.streams.values():
                self.ledger.dispatch(stream, self._transmit)
            now = time.monotonic()
            if now >= next_heartbeat:
                self._heartbeat()
                self.ledger.expire_orphans(now)
                self.ledger.retire_streams(now, self.config.retire_streams_after)
                self.peers.prune(now)
                self.ledger.warn_if_atomic_stall(now)
                if self.ledger.journal:
                    self.ledger.journal.sync_if_due()
                if metrics is not None:
                    metrics.publish(self.stats())
                if self._reload.is_set():
                    self._reload.clear()
                    self.guard.reload()
                next_heartbeat = now + self.config.heartbeat

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame]], None], until_full: bool = False,
               burst: int = BURST) -> None:
        for _ in range(burst):
            if until_full and self.ledger.feed_full():
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames)

    def _refused_peer(self, socket: str, reason: str, detail: str) -> None:
        self.rejected[socket][f"auth_{reason}"] += 1

    def _reject(self, socket: str, reason: str, detail: str) -> None:
        self.rejected[socket][reason] += 1
        log.debug("rejected on %s (%s): %s", socket, reason, detail)

    # ---- feed socket ------------------------------------------------------------------------------------

    def _on_feed(self, frames: list[zmq.Frame]) -> None:
        try:
            header_bytes = frames[0].bytes
            header = unpack_header(header_bytes)
            if header["kind"] != Kind.BATCH:
                raise ProtocolError(f"{header['kind'].name} is not accepted on the feed socket")
            protocol.check_batch_frames(header, [len(f) for f in frames[1:]])
            batch = cast(BatchHeader, header)        # validated against BATCH's schema
            replies = self.ledger.apply(BatchArrived(batch, frames, header_bytes if self.ledger.journal else None))
        except VersionMismatch as exc:
            return self._reject("feed", "version", exc.reason)
        except ProtocolError as exc:
            return self._reject("feed", "malformed", exc.reason)
        except Rejected as exc:
            return self._reject("feed", exc.reason, str(exc))
        except Exception:      # as in _on_request: log, count, keep serving
            log.exception("internal error handling a batch")
            return self._reject("feed", "internal", "batch")
        self._send_replies(replies)

    def _send_replies(self, replies: list[Reply]) -> None:
        for reply in replies:
            if reply.kind == Kind.ERROR:        # a PARTITION_END refused (now, or when its last batch came)
                self._reject("control", "refused", reply.fields["reason"])
            self._send(self._control, reply.identity, reply.kind, **reply.fields)

    # ---- requests on the control and ranks sockets --------------------------------------------------------

    def _on_request(self, sock: zmq.Socket, frames: list[zmq.Frame], socket: str) -> None:
        identity = frames[0].bytes
        if len(frames) != 2 and not (len(frames) > 2 and BODY_FRAMES.get(_kind_of(frames[1])) == len(frames) - 2):
            return self._refuse(sock, socket, identity, 0, ErrorCode.MALFORMED,
                                f"expected one header frame, got {len(frames) - 1} frames (a rank's HELLO with "
                                f"resume takes {1 + len(REJOIN_FRAMES)}, a RECLAIM 2)")
        try:
            header = unpack_header(frames[1].bytes)
        except ProtocolError as exc:
            code = ErrorCode.VERSION if isinstance(exc, VersionMismatch) else ErrorCode.MALFORMED
            return self._refuse(sock, socket, identity, 0, code, exc.reason)
        if header["v"] != protocol.VERSION or self.peers:
            self.peers.heard(socket, identity, header["v"], time.monotonic())   # answered, and sent to, in it
        if type(header.get("stream")) is str:
            self.ledger.touch(header["stream"], time.monotonic())
        handlers = self._control_handlers if socket == "control" else self._rank_handlers
        handler = handlers.get(header["kind"])
        if socket == "ranks":
            self.ledger.heard_from(identity)
        req = header.get("req", 0) if type(header.get("req")) is int else 0
        if handler is None:
            return self._refuse(sock, socket, identity, req, ErrorCode.UNEXPECTED_KIND,
                                f"{header['kind'].name} is not accepted on the {socket} socket")
        try:
            handler(self, sock, identity, header, frames[2:])
        except ProtocolError as exc:           # the rules refused it (UNKNOWN_RANK, ALREADY_CONNECTED, REFUSED)
            code = ErrorCode(exc.code or ErrorCode.REFUSED)     # or a frame it carries is unreadable (MALFORMED)
            self._refuse(sock, socket, identity, req, code, exc.reason,
                         counted="malformed" if code is ErrorCode.MALFORMED else "refused")
        except Exception:      # a bug must cost one request, not the broker and every stream it serves
            log.exception("internal error handling %s on the %s socket", header["kind"].name, socket)
            self._refuse(sock, socket, identity, req, ErrorCode.INTERNAL, "internal broker error (see its log)")

    def _refuse(self, sock: zmq.Socket, socket: str, identity: bytes, req: int, code: ErrorCode, reason: str,
                counted: str | None = None) -> None:
        """Answer ERROR with ``code`` and count the refusal in ``stats.broker.rejected`` (under the code's name,
        or ``counted``)."""
        self._reject(socket, counted or code.name.lower(), reason)
        self._send(sock, identity, Kind.ERROR, req=req, code=code, reason=reason)

    def _send(self, sock: zmq.Socket, identity: bytes, kind: Kind, **fields: Any) -> bool:
        version = self.peers.version("ranks" if sock is self._ranks else "control", identity)
        try:
            sock.send_multipart([identity, pack_header(kind, v=version, **fields)], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.ledger.rank_gone(identity, "disconnected")
            return False

    def _hello(self, sock: zmq.Socket, identity: bytes, h: HelloHeader, body: list[zmq.Frame]) -> None:
        if h["role"] not in protocol.ROLES:
            raise ProtocolError(f"unknown role {h['role']!r}; expected one of {', '.join(protocol.ROLES)}")
        missed: list[MissedEnd] = []
        joined = sock is self._ranks and h["role"] == "rank"
        if joined:
            if h["v"] < protocol.RECOVERY_VERSION and self.ledger.recovering(h["stream"]):
                raise ProtocolError(f"stream {h['stream']!r} is recovering an epoch from Spark's lineage: a rank of "
                                    f"protocol version {h['v']} cannot take part (upgrade it to version "
                                    f"{protocol.RECOVERY_VERSION} or later)")
            try:
                held, consumed = (protocol.unpack_ids(f.buffer) for f in body) if body else ((), ())
            except ProtocolError as exc:      # its id frames are unreadable: malformed, as a RECLAIM's frame
                raise ProtocolError(exc.reason, ErrorCode.MALFORMED) from None
            if (h["resume"] and h.get("incarnation", self.incarnation) != self.incarnation
                    and self.ledger.journal is None):
                # It names batches of a broker that is gone (this one restarted without its journal): it says what
                # it used with RECLAIM; here it joins as new, keeping its session.
                held, consumed = (), ()
                h.pop("got", None)
            missed = self.ledger.join_rank(identity, h, held, consumed)
        optional: dict[str, Any] = {}
        if h["v"] >= 7 and h["stream"]:       # the ranks reading the stream now; a rank: streams no rank reads
            optional = self._unread_for(identity, self.unread_streams()) if joined else \
                {"ranks": self.ranks_reading(h["stream"])}
        self._send(sock, identity, Kind.WELCOME, req=h["req"], broker=f"sparkbus/{protocol.VERSION}",
                   incarnation=self.incarnation, journal=self.ledger.journal is not None,
                   free=max(self.config.max_buffer - self.ledger.buffered, 0), **optional)
        self.ledger.send_missed(identity, missed, self._transmit)    # what it missed of epochs that ended
        if joined and identity in self.ledger.ranks:
            self.ledger.send_lost(self.streams[h["stream"]], self._transmit, only=identity)

    def _credit(self, sock: zmq.Socket, identity: bytes, h: CreditHeader, body: list[zmq.Frame]) -> None:
        self.ledger.set_window(self.ledger.rank(identity), h["window"], h["window_bytes"])

    def _ack(self, sock: zmq.Socket, identity: bytes, h: AckHeader, body: list[zmq.Frame]) -> None:
        rank = self.ledger.rank(identity)
        unknown = self.ledger.acknowledge(rank, h["ids"], h.get("upto", ()))
        if unknown:
            self._reject("ranks", "unknown_ack", f"{unknown} ids not in flight to rank {rank.rank}")
        self.ledger.report(rank, h)

    def _return(self, sock: zmq.Socket, identity: bytes, h: ReturnHeader, body: list[zmq.Frame]) -> None:
        rank = self.ledger.rank(identity)
        unknown = self.ledger.give_back(rank, h)
        if unknown:
            self._reject("ranks", "unknown_return", f"{unknown} ids not in flight to rank {rank.rank}")

    def _reclaim(self, sock: zmq.Socket, identity: bytes, h: ReclaimHeader, body: list[zmq.Frame]) -> None:
        rank = self.ledger.rank(identity)
        if len(body) != 1:
            raise ProtocolError("a RECLAIM carries one frame of used batches (protocol.pack_used)",
                                ErrorCode.MALFORMED)
        try:
            entries = protocol.unpack_used(body[0].buffer, h["entries"])
            cuts = protocol.unpack_cuts(h.get("cuts", ()))
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, ErrorCode.MALFORMED) from None
        self.ledger.reclaim(rank, h, entries, cuts)

    def _heartbeat_in(self, sock: zmq.Socket, identity: bytes, h: HeartbeatHeader, body: list[zmq.Frame]) -> None:
        self.ledger.report(self.ledger.rank(identity), h)

    def _bye(self, sock: zmq.Socket, identity: bytes, h: ByeHeader, body: list[zmq.Frame]) -> None:
        self.ledger.rank(identity)
        self.ledger.rank_gone(identity, "said goodbye", keep=False)

    def _stats(self, sock: zmq.Socket, identity: bytes, h: StatsRequestHeader, body: list[zmq.Frame]) -> None:
        """STATS_REPLY, in pages when the figures do not fit one header (each page ``[index, count]``)."""
        for page in paginate(self.stats()):
            self._send(sock, identity, Kind.STATS_REPLY, req=h["req"], stats=page)

    def _epoch_open(self, sock: zmq.Socket, identity: bytes, h: EpochOpenHeader, body: list[zmq.Frame]) -> None:
        self.ledger.open_epoch(h["stream"], h["epoch"], h["partitions"], h["delivery"], h.get("commit", "end"))
        self._send(sock, identity, Kind.OK, req=h["req"])

    def _partition_commit(self, sock: zmq.Socket, identity: bytes, h: PartitionCommitHeader,
                          body: list[zmq.Frame]) -> None:
        missing = self.ledger.commit_partitions(h["stream"], h["epoch"], h["parts"])
        self._send(sock, identity, Kind.OK, req=h["req"], missing=missing)

    def _partition_end(self, sock: zmq.Socket, identity: bytes, h: PartitionEndHeader, body: list[zmq.Frame]) -> None:
        self._send_replies(self.ledger.end_partition(identity, h))

    def _partition_claim(self, sock: zmq.Socket, identity: bytes, h: PartitionClaimHeader,
                         body: list[zmq.Frame]) -> None:
        self._send(sock, identity, Kind.OK, req=h["req"], broker=self.ledger.claim_partition(h))

    def _epoch_close(self, sock: zmq.Socket, identity: bytes, h: EpochCloseHeader, body: list[zmq.Frame]) -> None:
        diverged = self.ledger.close_epoch(h["stream"], h["epoch"], h["partitions"], h.get("expected"))
        self._send(sock, identity, Kind.OK, req=h["req"], diverged=diverged)
        if not self.ranks_reading(h["stream"]):
            read = sorted({r.stream for r in self.ledger.ranks.values()})
            log.warning("stream %r epoch %d is closed, but no rank reads stream %r (ranks read: %s): it waits for "
                        "ranks of that stream", h["stream"], h["epoch"], h["stream"],
                        ", ".join(map(repr, read)) or "none")

    def ranks_reading(self, name: str) -> int:
        """Ranks of the stream ``name``: joined, or lost and awaited."""
        stream = self.streams.get(name)
        return 0 if stream is None else len(stream.ranks) + len(stream.orphans)

    def _epoch_recover(self, sock: zmq.Socket, identity: bytes, h: EpochRecoverHeader, body: list[zmq.Frame]) -> None:
        stream = self.streams.get(h["stream"])
        if stream is not None and self.peers:
            older = sorted({r.rank for r in (*stream.ranks.values(), *(o.rank for o in stream.orphans.values()))
                            if self.peers.version("ranks", r.identity) < protocol.RECOVERY_VERSION})
            if older:
                raise ProtocolError(f"stream {h['stream']!r} is read by ranks {older} of an older protocol version: "
                                    f"they cannot say what they used, so epoch {h['epoch']} cannot be recovered "
                                    f"(upgrade them to version {protocol.RECOVERY_VERSION} or later, or feed the "
                                    f"epoch again)")
        self.ledger.recover_epoch(h)
        self._send(sock, identity, Kind.OK, req=h["req"])
        self.ledger.send_lost(self.streams[h["stream"]], self._transmit)

    def _epoch_query(self, sock: zmq.Socket, identity: bytes, h: EpochQueryHeader, body: list[zmq.Frame]) -> None:
        self._send(sock, identity, Kind.OK, req=h["req"], **self.ledger.query_epoch(h["stream"], h["epoch"]),
                   incarnation=self.incarnation, journal=self.ledger.journal is not None)

    _control_handlers: dict[Kind, Callable] = {
        Kind.HELLO: _hello, Kind.EPOCH_OPEN: _epoch_open, Kind.PARTITION_END: _partition_end,
        Kind.EPOCH_CLOSE: _epoch_close, Kind.PARTITION_CLAIM: _partition_claim, Kind.STATS_REQUEST: _stats,
        Kind.EPOCH_RECOVER: _epoch_recover, Kind.EPOCH_QUERY: _epoch_query, Kind.PARTITION_COMMIT: _partition_commit}
    _rank_handlers: dict[Kind, Callable] = {
        Kind.HELLO: _hello, Kind.CREDIT: _credit, Kind.ACK: _ack, Kind.HEARTBEAT: _heartbeat_in,
        Kind.BYE: _bye, Kind.RETURN: _return, Kind.RECLAIM: _reclaim, Kind.STATS_REQUEST: _stats}

    # ---- to the ranks -----------------------------------------------------------------------------------

    def _transmit(self, identity: bytes, frames: list[Any]) -> Outcome:
        """The ledger's sends to a rank (batches, epoch ends): I/O only, the ledger acts on the outcome. A rank of an
        older version gets the header frame in its version (the payload frames as they are)."""
        if self.peers:
            version = self.peers.version("ranks", identity)
            if version != protocol.VERSION:
                head = frames[0]
                head = head.bytes if isinstance(head, zmq.Frame) else head
                if _kind_of(head) in NEWER_KINDS[version]:
                    return Outcome.SENT          # a kind it does not know (LOST): never sent to it
                frames = [protocol.reencode(head, version), *frames[1:]]
        try:
            self._ranks.send_multipart([identity, *frames], zmq.NOBLOCK, copy=False)
            return Outcome.SENT
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return Outcome.GONE
            if exc.errno != zmq.EAGAIN:
                raise
            return Outcome.FULL

    def _heartbeat(self) -> None:
        """Heartbeat every rank; sending to one whose connection has closed is how its death is noticed. A rank whose
        stream has no epoch under way while others hold data no rank reads is told their names (``unread``)."""
        unread = self.unread_streams()
        for identity in list(self.ledger.ranks):
            self._send(self._ranks, identity, Kind.HEARTBEAT, **self._unread_for(identity, unread))

    def unread_streams(self) -> list[str]:
        """Streams holding data of an epoch not yet ended (batches, or an epoch closed) that no rank reads: no rank
        joined, none lost and awaited. A feed's ``stream=`` that differs from its ranks' is the usual cause."""
        return sorted(name for name, stream in self.streams.items()
                      if not stream.ranks and not stream.orphans and
                      any(not ep.end_sent and (ep.batches_in or ep.closed) for ep in stream.epochs.values()))

    def _unread_for(self, identity: bytes, unread: list[str]) -> dict[str, Any]:
        """``{"unread": [...]}`` for a rank of version 7 or later whose own stream has nothing under way."""
        rank = self.ledger.ranks.get(identity)
        if not unread or rank is None or self.peers.version("ranks", identity) < 7:
            return {}
        stream = self.streams.get(rank.stream)
        if stream is not None and stream.delivering() is not None:
            return {}
        return {"unread": unread}

    # ---- figures ----------------------------------------------------------------------------------------

    def stats(self) -> Figures:
        """Live figures: what ``sparkbus status`` prints (``broker.figures``, documented in docs/PROTOCOL.md)."""
        return {
            "broker": {"version": protocol.VERSION, "pid": os.getpid(), "incarnation": self.incarnation,
                       "uptime_s": round(time.monotonic() - self._started, 3),
                       "buffered_bytes": self.ledger.buffered, "max_buffer": self.config.max_buffer,
                       "feed_paused": self.ledger.feed_paused, "endpoints": self.endpoints,
                       "journal": self.config.journal,
                       "rejected": {s: dict(r) for s, r in self.rejected.items()},
                       "versions": list(protocol.SUPPORTED), "older_peers": self.peers.counts(),
                       "retired_streams": self.ledger.retired_count},
            "streams": {name: s.stats() for name, s in self.streams.items()},
        }
