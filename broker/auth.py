"""CURVE keys and the broker's access decision (ZAP 1.0, RFC 27), with no socket of its own.

Keys are pyzmq certificate files: ``NAME.key`` holds a public key, ``NAME.key_secret`` the public and the secret
key of one pair (:func:`create_keypair` writes both, the secret one with mode 0600).

The broker's key directory (``--auth DIR``)::

    DIR/broker.key_secret     the broker's own pair
    DIR/feeders/*.key         public keys allowed on the feed and control sockets (Spark tasks, drivers,
                              ``sparkbus status``)
    DIR/ranks/*.key           public keys allowed on the ranks socket (``BatchStream``)

A key is allowed in a role only if it is in that role's folder: a feeder's key cannot consume and a rank's key
cannot feed (put the same file in both folders to allow both). :class:`KeyAuthority` holds the lists and
decides; :func:`zap_reply` turns one ZAP request into its reply with that decision, so the broker answers ZAP on
a socket in its own loop. Nothing here logs a secret key.

Wiring on the broker (one :class:`zmq.Context` for all of these)::

    authority = KeyAuthority(config.auth)
    zap = ctx.socket(zmq.REP); zap.bind(ZAP_ENDPOINT)          # before any CURVE socket is bound
    for name, sock in sockets.items(): make_curve_server(sock, authority, name)   # domains: feed/control/ranks
    ... in the loop, when zap is readable:
    reply, allowed, reason, address = zap_reply(zap.recv_multipart(), authority); zap.send_multipart(reply)
    ... on SIGHUP: authority.reload()

On a client: ``make_curve_client(sock, key, broker_key)`` before ``connect``; both default to the variables
``SPARKBUS_KEY`` (the client's ``.key_secret`` file) and ``SPARKBUS_BROKER_KEY`` (the broker's ``.key`` file).
"""

from __future__ import annotations

import datetime
import logging
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import zmq
import zmq.auth
from zmq.utils import z85

from sparkbus.wire.errors import AuthError

log = logging.getLogger("sparkbus.auth")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"       # where libzmq sends ZAP requests: bind it in the sockets' context
ZAP_VERSION = b"1.0"
KEY_ENV = "SPARKBUS_KEY"                      # a client's own key pair: its .key_secret file
BROKER_KEY_ENV = "SPARKBUS_BROKER_KEY"        # the broker's public key: its .key file
BROKER_KEY_FILE = "broker.key_secret"
ROLE_FOLDERS = {"feeder": "feeders", "rank": "ranks"}
DOMAIN_ROLES = {"feed": "feeder", "control": "feeder", "ranks": "rank"}   # ZAP domain (= socket name) -> role
KEY_BYTES = 32

_BANNER = ("#   ****  Generated on {now} by sparkbus (pyzmq certificate format)  ****\n"
           "#   ZeroMQ CURVE {what}\n"
           "#   {note}\n\n")


# ---- key files ----------------------------------------------------------------------------------------------

def create_keypair(path: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new CURVE key pair as ``PATH.key`` (public) and ``PATH.key_secret`` (mode 0600).

    The files are pyzmq certificates (what :func:`zmq.auth.create_certificates` writes and
    :func:`zmq.auth.load_certificate` reads). The secret file is created with mode 0600 from the start, never
    readable by others even for a moment.

    Args:
        path: the files' common name without suffix, e.g. ``keys/spark-prod``; its folder must exist.
    Returns:
        ``(public_file, secret_file)``.
    Raises:
        AuthError: either file exists already (a key is never overwritten), or the folder is missing.
    """
    base = Path(path)
    public_file, secret_file = Path(f"{base}.key"), Path(f"{base}.key_secret")
    for existing in (public_file, secret_file):
        if existing.exists():
            raise AuthError(f"{existing} exists already; remove it first (clients holding that key will be "
                            f"refused) or choose another name")
    if not base.parent.is_dir():
        raise AuthError(f"cannot write keys to {base.parent}: no such directory")
    public, secret = zmq.curve_keypair()
    now = datetime.datetime.now().isoformat(timespec="seconds")
    _write(secret_file, _BANNER.format(now=now, what="Secret Certificate",
                                       note="DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
           + f'metadata\ncurve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n', 0o600)
    _write(public_file, _BANNER.format(now=now, what="Public Certificate",
                                       note="Exchange securely, or use a secure mechanism to verify the contents")
           + f'metadata\ncurve\n    public-key = "{public.decode()}"\n', 0o644)
    log.info("wrote the key pair %s and %s", public_file, secret_file)
    return public_file, secret_file


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(path, mode)     # the umask may have taken bits from the public file's mode


def _load(path: str | os.PathLike, what: str) -> tuple[bytes, bytes | None]:
    path = Path(path)
    if not path.is_file():
        raise AuthError(f"{what} {path} does not exist (or is not a file)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AuthError(f"{what} {path} is not a key file in pyzmq's certificate format "
                        f"(write one with `sparkbus keys create`): {exc}") from None
    for name, key in (("public", public), ("secret", secret)):
        if key is not None and not _valid_key(key):
            raise AuthError(f"{what} {path} holds a malformed {name} key (expected 40 Z85 characters)")
    return public, secret


def _valid_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == KEY_BYTES
    except (ValueError, KeyError):   # bad length; a character outside Z85
        return False


def load_public_key(path: str | os.PathLike) -> bytes:
    """The Z85 public key of a ``.key`` file. Refuses a ``.key_secret`` file, which must stay with its owner.

    Raises:
        AuthError: missing file, not a certificate, malformed key, or a secret key file.
    """
    public, secret = _load(path, "the public key file")
    if secret is not None:
        raise AuthError(f"{path} is a secret key file; hand out only the public one ({Path(path).stem}.key)")
    return public


def load_key_pair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys of a ``.key_secret`` file. Warns when others may read it.

    Raises:
        AuthError: missing file, not a certificate, malformed key, or no secret key in it (a ``.key`` file).
    """
    public, secret = _load(path, "the secret key file")
    if secret is None:
        raise AuthError(f"{path} holds only a public key; give the pair's .key_secret file")
    mode = Path(path).stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s may be read by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode))
    return public, secret


# ---- the broker's decision ----------------------------------------------------------------------------------

class KeyAuthority:
    """The broker's key pair and the public keys allowed per role, read from ``--auth DIR``.

    Args:
        directory: holds ``broker.key_secret``, ``feeders/*.key`` and ``ranks/*.key``.
    Raises:
        AuthError: no such directory, no usable ``broker.key_secret``, or a bad key file in a role folder.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise AuthError(f"the key directory {self.directory} does not exist")
        self.public_key, self._secret_key = load_key_pair(self.directory / BROKER_KEY_FILE)
        self._allowed: dict[str, dict[bytes, str]] = {}
        self.reload()

    @property
    def secret_key(self) -> bytes:
        return self._secret_key

    def __repr__(self) -> str:       # never the secret
        return f"KeyAuthority({str(self.directory)!r}, {self.counts()})"

    def counts(self) -> dict[str, int]:
        """Keys allowed per role, e.g. ``{"feeder": 2, "rank": 8}``."""
        return {role: len(keys) for role, keys in self._allowed.items()}

    def reload(self) -> dict[str, int]:
        """Read the role folders again (on SIGHUP); the broker's own key stays (a new one needs a restart).

        Safe to call from a signal handler or another thread: the new lists replace the old ones in one step.

        Returns:
            The keys now allowed per role.
        Raises:
            AuthError: a file in a role folder is not a public key; the previous lists stay in force.
        """
        allowed: dict[str, dict[bytes, str]] = {}
        for role, folder in ROLE_FOLDERS.items():
            keys: dict[bytes, str] = {}
            path = self.directory / folder
            for key_file in sorted(path.glob("*.key")) if path.is_dir() else ():
                keys[z85.decode(load_public_key(key_file))] = key_file.stem
            allowed[role] = keys
        self._allowed = allowed
        counts = self.counts()
        log.info("keys loaded from %s: %d feeder, %d rank", self.directory, counts["feeder"], counts["rank"])
        for role, count in counts.items():
            if not count:
                log.warning("no %s keys in %s/%s: every %s will be refused", role, self.directory,
                            ROLE_FOLDERS[role], role)
        return counts

    def decide(self, domain: str, address: str, mechanism: str, public_key: bytes | None) -> tuple[bool, str]:
        """Whether a peer may connect to the socket of ``domain``.

        Args:
            domain: the socket's ZAP domain: ``feed``, ``control`` (feeder keys) or ``ranks`` (rank keys).
            address: the peer's IP address (for the caller's log; not used to decide).
            mechanism: the ZMTP security mechanism, ``CURVE`` for an allowed peer.
            public_key: the peer's public key, 32 raw bytes (or 40 Z85 characters).
        Returns:
            ``(allowed, reason)``; reason ``"allowed"`` or one of ``not_curve``, ``no_key``, ``unknown_domain``,
            ``unknown_key`` (in no folder), ``wrong_role`` (allowed in the other role only).
        """
        if mechanism != "CURVE":
            return False, "not_curve"
        if public_key is not None and len(public_key) == 40:
            try:
                public_key = z85.decode(public_key)
            except (ValueError, KeyError):   # bad length; a character outside Z85
                return False, "no_key"
        if not public_key or len(public_key) != KEY_BYTES:
            return False, "no_key"
        role = DOMAIN_ROLES.get(domain)
        if role is None:
            return False, "unknown_domain"
        allowed = self._allowed
        if public_key in allowed[role]:
            return True, "allowed"
        if any(public_key in keys for other, keys in allowed.items() if other != role):
            return False, "wrong_role"
        return False, "unknown_key"

    def name_of(self, public_key: bytes) -> str | None:
        """``role:name`` of an allowed key (``feeder:spark-prod`` for ``feeders/spark-prod.key``), else None."""
        for role, keys in self._allowed.items():
            if public_key in keys:
                return f"{role}:{keys[public_key]}"
        return None


class ZapReply(NamedTuple):
    """:func:`zap_reply`'s answer: the ``frames`` to send back, and what they say, for the log."""

    frames: list[bytes]      # version, request id, status code (200 or 400), status text, user id, metadata
    allowed: bool
    reason: str              # as :meth:`KeyAuthority.decide` says, or "bad_request" (not ZAP 1.0)
    address: str             # the peer's IP


def zap_reply(request: Sequence[bytes | zmq.Frame], authority: KeyAuthority) -> ZapReply:
    """Answer one ZAP 1.0 request (RFC 27) with :meth:`KeyAuthority.decide`.

    Args:
        request: the request's frames as a REP socket receives them (on a ROUTER, drop the identity and the
            empty delimiter first and put them back before the reply): version, request id, domain, address,
            identity, mechanism, credentials...
        authority: the key lists.
    Returns:
        ``(reply_frames, allowed, reason, address)``: the reply to send back (version, request id, status code
        ``200`` or ``400``, status text, user id, metadata); ``reason`` as in :meth:`KeyAuthority.decide`, or
        ``bad_request`` for a request that is not ZAP 1.0; ``address`` the peer's IP for the log.
    """
    frames = [f.bytes if isinstance(f, zmq.Frame) else bytes(f) for f in request]
    request_id = frames[1] if len(frames) > 1 else b""
    if len(frames) < 6 or frames[0] != ZAP_VERSION:
        return ZapReply([ZAP_VERSION, request_id, b"400", b"bad_request", b"", b""], False, "bad_request", "")
    domain, address, mechanism = (f.decode("utf-8", "replace") for f in (frames[2], frames[3], frames[5]))
    credentials = frames[6] if len(frames) > 6 else None
    allowed, reason = authority.decide(domain, address, mechanism, credentials)
    user = (authority.name_of(credentials) or "").encode() if allowed and credentials else b""
    status = (b"200", b"OK") if allowed else (b"400", reason.encode())
    return ZapReply([ZAP_VERSION, request_id, *status, user, b""], allowed, reason, address)


def handshake_refusal(event: Mapping[str, Any]) -> str | None:
    """The refusal reason of a socket monitor event (``zmq.utils.monitor.parse_monitor_message``), if it is one
    that ZAP never sees: a peer without CURVE (``no_key``) or one that encrypted for another broker key
    (``wrong_broker_key``). ``None`` for other events, including ``HANDSHAKE_FAILED_AUTH``, which
    :func:`zap_reply` has already reported with its reason. libzmq gives no peer address with these events."""
    kind = event.get("event")
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        value = event.get("value")
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "no_key"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "wrong_broker_key"
        return "bad_handshake"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "bad_handshake"
    return None


# ---- socket options -----------------------------------------------------------------------------------------

def server_socket_options(authority: KeyAuthority, domain: str) -> list[tuple[int, Any]]:
    """``(option, value)`` pairs that make a socket a CURVE server answering ZAP for ``domain``.

    ``ZAP_ENFORCE_DOMAIN`` makes libzmq refuse every peer while no ZAP handler is bound, instead of admitting any
    key: a broker that forgot its handler fails closed.
    """
    if domain not in DOMAIN_ROLES:
        raise AuthError(f"unknown ZAP domain {domain!r}; expected one of {', '.join(DOMAIN_ROLES)}")
    return [(zmq.CURVE_SERVER, 1), (zmq.CURVE_SECRETKEY, authority.secret_key),
            (zmq.CURVE_PUBLICKEY, authority.public_key), (zmq.ZAP_DOMAIN, domain.encode()),
            (zmq.ZAP_ENFORCE_DOMAIN, 1)]


def make_curve_server(socket: zmq.Socket, authority: KeyAuthority, domain: str) -> None:
    """Make ``socket`` a CURVE server whose peers are admitted by ZAP for ``domain``. Call before ``bind``."""
    for option, value in server_socket_options(authority, domain):
        socket.setsockopt(option, value)


def make_curve_client(socket: zmq.Socket, key: str | os.PathLike | None = None,
                      broker_key: str | os.PathLike | None = None) -> bool:
    """Give ``socket`` the client's key pair and the broker's public key, if configured. Call before ``connect``.

    Args:
        socket: a socket not yet connected.
        key: the client's ``.key_secret`` file; None: the variable ``SPARKBUS_KEY``.
        broker_key: the broker's ``.key`` file; None: the variable ``SPARKBUS_BROKER_KEY``.
    Returns:
        Whether CURVE is on (False when neither is given nor set: a plain connection).
    Raises:
        AuthError: only one of the two is given, or a file is missing or not a key of the right kind.
    """
    key = key or os.environ.get(KEY_ENV) or None
    broker_key = broker_key or os.environ.get(BROKER_KEY_ENV) or None
    if key is None and broker_key is None:
        return False
    if key is None or broker_key is None:
        missing = f"key= or {KEY_ENV}" if key is None else f"broker_key= or {BROKER_KEY_ENV}"
        raise AuthError(f"CURVE needs both the client's key pair and the broker's public key; {missing} is not "
                        f"set")
    public, secret = load_key_pair(key)
    server = load_public_key(broker_key)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server
    return True


def client_socket(context: zmq.Context, kind: int, key: str | os.PathLike | None = None,
                  broker_key: str | os.PathLike | None = None) -> zmq.Socket:
    """A new socket of ``kind`` (linger 0) with the client's CURVE keys if configured (see
    :func:`make_curve_client`), not yet connected. Raises :class:`AuthError` as that does, leaving no socket."""
    sock = context.socket(kind)
    sock.linger = 0
    try:
        make_curve_client(sock, key, broker_key)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


__all__ = ["ZAP_ENDPOINT", "client_socket", "KEY_ENV", "BROKER_KEY_ENV", "BROKER_KEY_FILE", "DOMAIN_ROLES",
           "ROLE_FOLDERS", "create_keypair", "load_public_key", "load_key_pair", "KeyAuthority", "ZapReply",
           "zap_reply", "handshake_refusal", "server_socket_options", "make_curve_server", "make_curve_client"]
