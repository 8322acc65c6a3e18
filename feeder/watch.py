"""The watch over a feed's brokers: which are live, which lost the feed's state, and since when.

:class:`BrokerWatch` says HELLO to every broker of a feed (a thread of its own while the Spark job runs, or a
:meth:`BrokerWatch.sweep` in the caller's thread after it) and records each :class:`Loss`: a broker whose
incarnation changed without a journal (restarted), or one silent for the feed's ``timeout`` (gone). The losses only
grow; a step that must know whether a broker was lost while it ran takes a :meth:`BrokerWatch.mark` before and asks
:meth:`BrokerWatch.lost_since` after: the one way the recovery (:mod:`feeder.recovery`) and ``feed_epochs``
(:mod:`feeder.epochs`) tell a loss. docs/design/RECOVERY.md ("The driver") is the contract.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sparkbus.broker.client import ControlClient
from sparkbus.wire.errors import BrokerError

log = logging.getLogger("sparkbus.feeder")

WATCH_INTERVAL = 1.0        # seconds between the watch's HELLOs to each broker


class Loss(NamedTuple):
    """A broker that lost the feed's state: its index in the feed's list, the incarnation lost, and whether it
    is gone (silent past the timeout) rather than restarted."""

    broker: int
    incarnation: str
    gone: bool


class BrokerWatch:
    """Which of a feed's brokers are live, and which incarnations were lost, told by HELLOs.

    :meth:`start` runs a thread that says HELLO to every broker every ``interval`` with its own sockets (ZeroMQ
    sockets are not thread-safe) and calls ``on_loss`` (any thread may call it) after it saw a new loss;
    :meth:`sweep` does the same once, in the calling thread, with the caller's clients, waiting for a silent broker
    until its ``timeout`` is up: what the driver does after a job ended, to know for certain.

    Args:
        controls: the brokers' control addresses, in the feed's order.
        welcomes: each broker's WELCOME when the feed began (their incarnations are the ones known).
        stream: the feed's stream (its HELLOs name it).
        timeout: seconds of silence after which a broker is gone.
    """

    def __init__(self, controls: Sequence[str], welcomes: Sequence[Mapping[str, Any]], stream: str,
                 timeout: float, key: str | None = None, broker_key: str | None = None,
                 interval: float = WATCH_INTERVAL) -> None:
        self.controls = list(controls)
        self.stream = stream
        self.timeout = timeout
        self.interval = interval
        self._keys = (key, broker_key)
        now = time.monotonic()
        self._known = [str(w.get("incarnation", "")) for w in welcomes]
        self._heard = [now] * len(self.controls)
        self._gone: set[int] = set()
        self._losses: list[Loss] = []        # only ever appended to: a mark is a length of it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.on_loss: Callable[[], None] | None = None

    # ---- what the watch knows -----------------------------------------------------------------------------

    def live(self) -> list[int]:
        """The brokers not gone, in the feed's order (a restarted one is live)."""
        with self._lock:
            return [i for i in range(len(self.controls)) if i not in self._gone]

    @property
    def losses(self) -> list[Loss]:
        """Every loss so far in this feed (adopted ones first), in the order they were found."""
        with self._lock:
            return list(self._losses)

    def mark(self) -> int:
        """Where the losses stand now: :meth:`lost_since` and :meth:`losses_since` take it."""
        with self._lock:
            return len(self._losses)

    def losses_since(self, mark: int) -> list[Loss]:
        """The losses found since ``mark`` (by the thread, a sweep or an observed answer)."""
        with self._lock:
            return self._losses[mark:]

    def lost_since(self, mark: int) -> bool:
        """Whether a broker was lost since ``mark``."""
        return bool(self.losses_since(mark))

    def lost_incarnations(self) -> list[str]:
        """Every incarnation lost so far in this feed, in the order they were lost."""
        with self._lock:
            return [loss.incarnation for loss in self._losses]

    def lost_brokers(self) -> list[int]:
        """The brokers that lost the feed's state at least once (restarted or gone), in the feed's order."""
        with self._lock:
            return sorted({loss.broker for loss in self._losses})

    def observe(self, index: int, welcome: Mapping[str, Any] | None, now: float | None = None) -> Loss | None:
        """Take in one broker's answer to a HELLO (or an EPOCH_QUERY), or its silence (None).

        Returns:
            The new :class:`Loss`, if this answer (or silence) is one.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            if index in self._gone:
                return None
            if welcome is None:
                if now - self._heard[index] < self.timeout:
                    return None
                self._gone.add(index)
                loss = Loss(index, self._known[index], True)
            else:
                self._heard[index] = now
                incarnation = str(welcome.get("incarnation", ""))
                before = self._known[index]
                if incarnation == before:
                    return None
                self._known[index] = incarnation
                if welcome.get("journal"):
                    log.info("the broker at %s restarted from its journal", self.controls[index])
                    return None     # it replayed what it had: not a loss (as before recovery existed)
                loss = Loss(index, before, False)
            self._losses.append(loss)
        log.warning("the broker at %s %s: its partitions of stream %r are fed again from Spark",
                    self.controls[index], "is silent past the feed's timeout" if loss.gone else
                    "restarted without a journal", self.stream)
        return loss

    # ---- asking -------------------------------------------------------------------------------------------

    def sweep(self, clients: Sequence[ControlClient]) -> list[Loss]:
        """HELLO every live broker once with ``clients`` (the caller's, one per broker), waiting for a silent one
        until its timeout is up. Returns the new losses."""
        found = []
        for index in self.live():
            with self._lock:
                wait = max(0.2, self._heard[index] + self.timeout - time.monotonic())
            loss = self._ask(clients[index], index, wait, final=True)
            if loss is not None:
                found.append(loss)
        return found

    def _ask(self, client: ControlClient, index: int, wait: float, final: bool = False) -> Loss | None:
        try:
            welcome = client.hello("feeder", self.stream, timeout=wait)
        except BrokerError as exc:
            if exc.code is not None:      # it answered, with a refusal: it is there
                with self._lock:
                    self._heard[index] = time.monotonic()
                return None
            welcome = None
        now = None
        if final and welcome is None:     # a sweep waited for the rest of the broker's timeout: silent past it
            with self._lock:
                now = max(time.monotonic(), self._heard[index] + self.timeout)
        return self.observe(index, welcome, now)

    def adopt(self, losses: Sequence[Loss]) -> None:
        """Losses found before this watch began (by another watch of the same brokers): a gone broker stays gone."""
        with self._lock:
            self._losses.extend(losses)
            self._gone.update(loss.broker for loss in losses if loss.gone)

    def start(self, on_loss: Callable[[], None] | None = None) -> BrokerWatch:
        """Start the thread (once); ``on_loss`` is called (from it) after each new loss."""
        self.on_loss = on_loss
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sparkbus-broker-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 5.0)

    def _run(self) -> None:
        key, broker_key = self._keys
        clients = [ControlClient(c, self.interval, key=key, broker_key=broker_key) for c in self.controls]
        try:
            while not self._stop.wait(self.interval):
                for index in self.live():
                    if self._stop.is_set():
                        break
                    loss = self._ask(clients[index], index, self.interval)
                    callback = self.on_loss
                    if loss is not None and callback is not None:
                        try:
                            callback()
                        except Exception:        # a cancel that failed: the sweep after the job still finds it
                            log.exception("cancelling the feed's Spark job failed")
        finally:
            for client in clients:
                client.close()

    def __enter__(self) -> BrokerWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

