"""The broker's door: CURVE on its three sockets, ZAP answered inside the broker's loop, refusals counted.

With ``--auth DIR`` every socket is a CURVE server (encrypted, and a peer must hold a key the directory allows for
that socket's role: feeders on ``feed`` and ``control``, ranks on ``ranks``). libzmq asks the ZAP handler about
each new peer; the broker answers from its own loop (:func:`broker.auth.zap_reply`), so a refused peer costs one
small message and a log line. Handshakes that fail before ZAP (no CURVE at all, the wrong broker key) are seen on
socket monitors. Without ``--auth`` the monitors still log connections and disconnections.
"""

from __future__ import annotations

import logging
import socket as pysocket
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from sparkbus.broker.auth import ZAP_ENDPOINT, KeyAuthority, handshake_refusal, make_curve_server, zap_reply
from sparkbus.wire.errors import AuthError

log = logging.getLogger("sparkbus.broker")

MONITORED = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
             | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
REFUSAL_LOG_SECONDS = 10.0      # a refused peer retries every ~100 ms: one log line per socket and reason this often

Refused = Callable[[str, str, str], None]      # (socket name, reason, detail)


class Guard:
    """CURVE, ZAP and socket monitors for the broker's sockets. Sockets are made in the loop's context.

    Args:
        auth_dir: the key directory (``--auth``), or None for an open broker (loopback unless ``--insecure``).
        on_refused: called for each refused peer with the socket's name, a reason and a detail for the log.
    """

    def __init__(self, auth_dir: str | None, on_refused: Refused):
        self.authority = KeyAuthority(auth_dir) if auth_dir else None
        self._on_refused = on_refused
        self._zap: zmq.Socket | None = None
        self._monitors: dict[zmq.Socket, str] = {}
        self._logged: dict[tuple[str, str], float] = {}

    def secure(self, context: zmq.Context, sockets: dict[str, zmq.Socket]) -> None:
        """Before binding: the ZAP handler in ``context``, CURVE server options, and a monitor on each socket."""
        if self.authority is not None:
            self._zap = context.socket(zmq.REP)
            self._zap.linger = 0
            self._zap.bind(ZAP_ENDPOINT)
            for name, sock in sockets.items():
                make_curve_server(sock, self.authority, name)
        for name, sock in sockets.items():
            self._monitors[sock.get_monitor_socket(MONITORED)] = name

    @property
    def sockets(self) -> list[zmq.Socket]:
        """What the loop polls for this guard: the ZAP handler and the monitors."""
        return ([self._zap] if self._zap is not None else []) + list(self._monitors)

    def handle(self, sock: zmq.Socket) -> None:
        """Answer a ZAP request or read a monitor event, whichever ``sock`` is."""
        if sock is self._zap and self.authority is not None:      # a ZAP socket is made only with an authority
            request = sock.recv_multipart()
            reply, allowed, reason, address = zap_reply(request, self.authority)
            sock.send_multipart(reply)
            if not allowed:        # counted under the socket the peer tried (the ZAP domain is its name)
                domain = request[2].decode(errors="replace") if len(request) > 2 else "zap"
                self._refused(domain, reason, f"peer {address}")
            return
        name = self._monitors[sock]
        event = recv_monitor_message(sock)
        refusal = handshake_refusal(event)
        if refusal is not None:
            self._refused(name, refusal, f"a peer of {event['endpoint'].decode(errors='replace')}")
        elif event["event"] == zmq.EVENT_ACCEPTED:
            log.debug("%s socket: connection from %s", name, _peer(event["value"]))
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            log.debug("%s socket: a peer disconnected", name)

    def _refused(self, name: str, reason: str, detail: str) -> None:
        self._on_refused(name, reason, detail)
        now = time.monotonic()
        if now - self._logged.get((name, reason), -REFUSAL_LOG_SECONDS) >= REFUSAL_LOG_SECONDS:
            self._logged[(name, reason)] = now
            log.info("refused on the %s socket (%s): %s", name, reason, detail)

    def reload(self) -> None:
        """Read the allowed keys again (SIGHUP); a bad directory keeps the lists in force, and says why."""
        if self.authority is None:
            log.info("SIGHUP: no --auth directory to reload")
            return
        try:
            counts = self.authority.reload()
        except AuthError as exc:
            log.error("SIGHUP: the key directory was not reloaded, the keys in force stay: %s", exc)
            return
        log.info("SIGHUP: keys reloaded: %s", ", ".join(f"{n} {role}" for role, n in counts.items()))

    def close(self) -> None:
        for monitor in self._monitors:
            monitor.close(linger=0)
        if self._zap is not None:
            self._zap.close(linger=0)


def _peer(fd: int) -> str:
    """The peer address of an accepted connection's file descriptor (for the log), if it can still be read."""
    try:
        with pysocket.socket(fileno=pysocket.dup(fd)) as sock:
            host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a peer"
