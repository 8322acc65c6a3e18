"""Every error sparkbus raises on purpose, under one root: ``except SparkbusError`` catches them all."""

from __future__ import annotations

from typing import Any


class SparkbusError(Exception):
    """Root of the errors sparkbus raises: the message says what happened and what to do."""


class ProtocolError(SparkbusError, ValueError):
    """A message that does not follow the protocol, or a request the broker refuses. ``reason`` is fit to send
    back to the peer; ``code`` (a ``sparkbus.wire.protocol.ErrorCode``, None: the receiver's default) goes with it."""

    def __init__(self, reason: str, code: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.code = code


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version; the message names both."""

    def __init__(self, theirs: Any, ours: int, also: int | None = None):
        speaks = f"{also} and {ours}" if also is not None else f"{ours}"
        super().__init__(
            f"protocol version mismatch: peer speaks {theirs!r}, this side speaks {speaks}; "
            f"install the same sparkbus release on the Spark executors, the broker and the ranks")
        self.theirs = theirs


class BrokerError(SparkbusError, RuntimeError):
    """The broker refused a request, or could not be reached in time.

    ``code`` is the ``sparkbus.wire.protocol.ErrorCode`` of the broker's ``ERROR`` reply, or None when no broker
    answered.
    """

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class BrokerUnreachable(BrokerError):
    """No connection could be made to the broker's address at all (refused: nothing listens there), as opposed to a
    broker that is connected but slow. ``address``: the endpoint that refused."""

    def __init__(self, message: str, address: str):
        super().__init__(message)
        self.address = address


class FeedError(SparkbusError, RuntimeError):
    """The Spark job that streams an epoch failed; the message says why and what to check."""


class FeedTimeout(SparkbusError, TimeoutError):
    """The broker took no batch, or did not confirm a partition, within the timeout."""


class AuthError(SparkbusError, ValueError):
    """A CURVE key file or key directory that cannot be used: missing, unreadable, or not a key of that kind."""


__all__ = ["SparkbusError", "ProtocolError", "VersionMismatch", "BrokerError", "BrokerUnreachable", "FeedError",
           "FeedTimeout", "AuthError"]
