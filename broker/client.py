"""The requesting end of the broker's control socket: feeders, the driver and ``sparkbus status`` use it.

A DEALER (not REQ, whose state machine wedges after a lost reply) with one request in flight at a time; every
reply carries the request's ``req`` number, and stale replies from an earlier timed-out request are skipped.

A client speaks this release's protocol version; one that meets an older broker it can speak to (its ``ERROR``
says ``VERSION`` in a version of ``protocol.SUPPORTED``) asks again in that version, except a feeder, whose batches
would be refused (docs/PROTOCOL.md "Versions"). A ``STATS_REPLY`` that comes in pages is put back together.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from sparkbus.broker.auth import client_socket
from sparkbus.broker.status import merge_pages
from sparkbus.wire.errors import BrokerError, BrokerUnreachable, ProtocolError
from sparkbus.wire.protocol import VERSION, ErrorCode, Kind, negotiated, pack_header, unpack_header


class ControlClient:
    """Request/reply to the broker's control (or ranks) socket, each wait bounded by ``timeout``.

    Args:
        address: the broker's control endpoint (see :func:`sparkbus.wire.address.control_address`).
        timeout: seconds to wait for each reply.
        context: ZeroMQ context; the process-wide instance by default.
        key, broker_key: this client's ``.key_secret`` file and the broker's ``.key`` file, for a broker run with
            ``--auth`` (default: the variables ``SPARKBUS_KEY`` and ``SPARKBUS_BROKER_KEY``; neither: no CURVE).
        refused_after: until a first connection is made, a request whose every connection attempt was refused for
            this many seconds raises :class:`BrokerUnreachable` instead of waiting for ``timeout`` (ZeroMQ's socket
            monitor sees the refusals). None: wait for ``timeout`` whatever happens. Once connected, a slow broker
            always gets ``timeout``.
    Raises:
        AuthError: only one of the two keys is given, or a key file is missing or malformed.
    """

    def __init__(self, address: str, timeout: float = 60.0, context: zmq.Context | None = None,
                 key: str | None = None, broker_key: str | None = None, refused_after: float | None = None):
        self.address = address
        self.timeout = timeout
        self._req = itertools.count(1)
        self.version = VERSION         # the broker's, once it said it speaks an older one
        self._sock = client_socket(context or zmq.Context.instance(), zmq.DEALER, key, broker_key)
        self.refused_after = refused_after
        self._refused_since: float | None = None      # the first refused attempt since the last connection
        self._monitor: zmq.Socket | None = None
        if refused_after is not None:                  # before connect(), or the first events are missed
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._sock.connect(address)

    def request(self, kind: Kind, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its reply.

        Returns:
            The reply header.
        Raises:
            BrokerError: no reply within the timeout (``code`` None), or the broker answered ERROR: its ``code``
                (a :class:`~broker.protocol.ErrorCode`) is the error's, its reason is in the message.
            ProtocolError: the reply is not a valid header (wrong version included).
        """
        req = next(self._req)
        self._sock.send(pack_header(kind, v=self.version, req=req, **fields))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        pages: list[dict[str, Any]] = []
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._poll(remaining, kind):
                raise BrokerError(f"no reply from the sparkbus broker at {self.address} to {kind.name} within "
                                  f"{self.timeout if timeout is None else timeout:g} s: is it running, and is "
                                  f"this the broker's control address?")
            reply = unpack_header(self._sock.recv())
            older = reply["kind"] == Kind.ERROR and reply["code"] == ErrorCode.VERSION and \
                negotiated(reply["v"]) not in (None, self.version)
            if reply.get("req") != req and not (older and reply.get("req") == 0):
                continue          # the answer to an earlier request that timed out
            if older:                 # (a broker that cannot read a request's version answers it with req 0)
                self.version = reply["v"]                 # an older broker: ask again in its version
                req = next(self._req)
                self._sock.send(pack_header(kind, v=self.version, req=req, **fields))
                continue
            if reply["kind"] == Kind.ERROR:
                raise BrokerError(f"the broker at {self.address} refused {kind.name}: {reply['reason']}",
                                  code=_error_code(reply["code"]))
            if reply["kind"] == Kind.STATS_REPLY and "page" in reply["stats"]:
                pages.append(reply["stats"])          # one of several: the rest follow, with the same req
                if len(pages) < reply["stats"]["page"][1]:
                    continue
                reply["stats"] = merge_pages(pages)
            return reply

    def _poll(self, seconds: float, kind: Kind) -> bool:
        """Whether a reply arrived within ``seconds``; while never connected (``refused_after``), connection
        attempts refused for ``refused_after`` seconds raise :class:`BrokerUnreachable`."""
        if self._monitor is None:
            return bool(self._sock.poll(int(seconds * 1000)))     # pyzmq truncates to ms too
        deadline = time.monotonic() + seconds
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while self._monitor is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready = dict(poller.poll(int(max(left, 0.001) * 1000)))
            if self._sock in ready:
                return True
            if self._monitor in ready:
                self._read_monitor()
            if self._refused_since is not None and self.refused_after is not None and \
                    time.monotonic() - self._refused_since >= self.refused_after:
                raise BrokerUnreachable(f"no connection to {self.address} could be made for "
                                        f"{self.refused_after:g} s (refused: nothing listens there) to send "
                                        f"{kind.name}", self.address)
        left = deadline - time.monotonic()
        return left > 0 and bool(self._sock.poll(int(left * 1000)))

    def _read_monitor(self) -> None:
        """The socket monitor's events so far: a connection ends the watch; a refused attempt starts the clock."""
        assert self._monitor is not None
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._stop_monitor()          # connected: from now on, only ``timeout`` counts
            elif event == zmq.EVENT_CONNECT_RETRIED and self._refused_since is None:
                self._refused_since = time.monotonic()

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def hello(self, role: str, stream: str = "", timeout: float | None = None) -> dict[str, Any]:
        """Version handshake; proves the broker is there. Raises like :meth:`request`, and :class:`BrokerError`
        (code ``VERSION``) for a feeder that meets an older broker: its tasks write batches in this version."""
        welcome = self.request(Kind.HELLO, timeout=timeout, role=role, stream=stream, rank=0, size=1, even=False,
                               session="", resume=False, ended=-1)
        if role == "feeder" and self.version != VERSION:
            raise BrokerError(f"the broker at {self.address} speaks protocol version {self.version}, older than "
                              f"this feeder's {VERSION}: upgrade the broker first (a broker serves clients of its "
                              f"version and of the one before), then the jobs", code=ErrorCode.VERSION)
        return welcome

    def close(self) -> None:
        self._stop_monitor()
        self._sock.close(linger=0)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error_code(code: int) -> ErrorCode | int:
    """An ERROR's code as an :class:`ErrorCode`; a code this release does not know stays an int."""
    try:
        return ErrorCode(code)
    except ValueError:
        return code


def fetch_stats(address: str, timeout: float = 5.0, key: str | None = None,
                broker_key: str | None = None) -> dict[str, Any]:
    """The broker's live figures (a ``broker.figures.Figures``) from its control or ranks address. Raises
    :class:`BrokerError` on timeout."""
    with ControlClient(address, timeout, key=key, broker_key=broker_key) as client:
        return client.request(Kind.STATS_REQUEST)["stats"]


__all__ = ["ControlClient", "fetch_stats", "BrokerError", "BrokerUnreachable", "ProtocolError"]
