"""Which protocol version each of the broker's peers speaks, so that what the broker sends it is in that version.

A peer speaks the version of its HELLO (or of any request: a ``sparkbus status`` sends no HELLO), one of
``protocol.SUPPORTED``; docs/PROTOCOL.md ("Versions") has the rules. Only peers of an older version are
remembered, so a peer of the broker's own version costs nothing here. The table is bounded: a connection not heard
from for :data:`FORGET_AFTER` seconds is forgotten (a live rank is heard from every heartbeat), and beyond
:data:`MAX_OLDER_PEERS` the one heard from least recently goes first.
"""

from __future__ import annotations

from collections import OrderedDict

from sparkbus.wire.protocol import VERSION

MAX_OLDER_PEERS = 16384       # connections of older versions remembered (about 150 bytes each)
FORGET_AFTER = 600.0          # seconds: longer than a feeder task waits for its partition's commit


class PeerVersions:
    """Per socket and connection identity, the version it speaks when that is not :data:`~broker.protocol.VERSION`."""

    def __init__(self, limit: int = MAX_OLDER_PEERS, forget_after: float = FORGET_AFTER):
        self.limit, self.forget_after = limit, forget_after
        self._older: OrderedDict[tuple[str, bytes], tuple[int, float]] = OrderedDict()

    def heard(self, socket: str, identity: bytes, version: int, now: float) -> None:
        """A request of ``version`` (already checked to be supported) came from ``identity``: from now on it is
        answered in that version. Called for requests of the broker's own version only while older peers are
        remembered (one might have changed its version)."""
        key = (socket, identity)
        if version == VERSION:
            self._older.pop(key, None)
            return
        self._older[key] = (version, now)
        self._older.move_to_end(key)
        while len(self._older) > self.limit:
            self._older.popitem(last=False)

    def version(self, socket: str, identity: bytes) -> int:
        """The version to send to ``identity`` on ``socket`` in."""
        if not self._older:
            return VERSION
        entry = self._older.get((socket, identity))
        return VERSION if entry is None else entry[0]

    def prune(self, now: float) -> None:
        """Forget the connections not heard from for :attr:`forget_after` seconds (the least recent are first)."""
        while self._older:
            key, (_, heard) = next(iter(self._older.items()))
            if now - heard < self.forget_after:
                break
            del self._older[key]

    def counts(self) -> dict[str, int]:
        """Connections remembered per older version, as ``{"4": n}`` (for the figures)."""
        counts: dict[str, int] = {}
        for version, _ in self._older.values():
            counts[str(version)] = counts.get(str(version), 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self._older)
