"""The ranks' side of a feed's verdict (``FeedReport.verdict``): every rank's figures, read from the brokers while
the feed runs, so that the report says how long the ranks waited for data while this epoch was fed beside how long
Spark was held back by them (:mod:`sparkbus.wire.verdict`).

Read every second by a thread of its own (:class:`WaitsWatch`), and once more when Spark's job has ended, before
the epoch is closed (:meth:`WaitsWatch.read_now`): no rank can have finished the epoch then, whereas a rank that
has read the whole epoch leaves before the feed's last reply, and the broker forgets its figures then."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import TracebackType

from sparkbus.broker.client import ControlClient
from sparkbus.wire.errors import BrokerError
from sparkbus.wire.protocol import Kind
from sparkbus.wire.verdict import RankWaits, latest

log = logging.getLogger(__name__)

READ_TIMEOUT = 2.0     # seconds for one broker's figures: a verdict is not worth holding the feed up
READ_EVERY = 1.0       # seconds between two readings while the feed runs


def read_waits(clients: Sequence[ControlClient], stream: str) -> tuple[dict[int, RankWaits], int]:
    """Each rank's seconds so far on ``stream`` and the messages queued for its ranks, as the brokers have them
    (:func:`sparkbus.wire.verdict.latest`). A broker that does not answer is skipped; figures that do not parse
    cost this reading."""
    figures = []
    for client in clients:
        try:
            figures.append(client.request(Kind.STATS_REQUEST, timeout=min(client.timeout, READ_TIMEOUT))
                           ["stats"]["streams"].get(stream, {}))
        except (BrokerError, KeyError, TypeError, AttributeError) as exc:
            log.debug("stream %r: no ranks' figures from %s for the verdict: %s", stream, client.address, exc)
    try:
        return latest(figures)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        log.debug("stream %r: the ranks' figures do not parse: %s", stream, exc)
        return {}, 0


def waits_between(before: dict[int, RankWaits], after: dict[int, RankWaits]) -> tuple[RankWaits, ...]:
    """Each rank's seconds from ``before`` to ``after``; a rank that started again since (its figures went back)
    or joined in between counts from its start."""
    spans = []
    for rank in sorted(after):
        now, then = after[rank], before.get(rank)
        if then is None or now.step < then.step or now.data_wait < then.data_wait or now.peer_wait < then.peer_wait:
            spans.append(now)
        else:
            spans.append(RankWaits(rank, now.data_wait - then.data_wait, now.peer_wait - then.peer_wait,
                                   now.step - then.step))
    return tuple(spans)


class WaitsWatch:
    """Every rank's figures on ``stream`` from ``controls`` (the brokers' control addresses), read when entered,
    every :data:`READ_EVERY` seconds by a thread with sockets of its own, when asked (:meth:`read_now`) and once
    more when left; :meth:`spans`
    is each rank's seconds in between. Best effort: a broker that does not answer costs the verdict a reading,
    never the feed."""

    def __init__(self, controls: Sequence[str], stream: str, timeout: float, key: str | None = None,
                 broker_key: str | None = None, every: float | None = None):
        self._controls, self._stream = list(controls), stream
        self._every = READ_EVERY if every is None else every
        self._client_args = dict(timeout=min(timeout, READ_TIMEOUT), key=key, broker_key=broker_key)
        self._before: dict[int, RankWaits] | None = None
        self._latest: dict[int, RankWaits] = {}
        self._waited = self._waited_queued = 0.0     # the ranks' data wait between readings; ... with batches queued
        self._window: dict[int, float] = {}         # ... of it, each rank's
        self._first = threading.Event()
        self._stop = threading.Event()
        self._wake = threading.Event()              # read now (read_now, stop), not at the next second
        self._asked = self._answered = 0            # read_now's requests, and the last one a reading began after
        self._read = threading.Condition()          # ... both under it
        self._thread = threading.Thread(target=self._run, name=f"sparkbus-waits-{stream}", daemon=True)

    def __enter__(self) -> WaitsWatch:
        self._thread.start()
        self._first.wait(READ_TIMEOUT)      # the "before" reading, most often, before the job's first batch
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def read_now(self) -> None:
        """Take a reading now and wait for it (at most as long as a reading may take): what the feed calls when
        Spark's job has ended, before it closes the epoch, while every rank of the stream is still in it."""
        with self._read:
            self._asked += 1
            mine = self._asked
            self._wake.set()
            self._read.wait_for(lambda: self._answered >= mine or not self._thread.is_alive(),
                                READ_TIMEOUT * max(len(self._controls), 1) + 1.0)

    def stop(self) -> None:
        """Take the last reading and end the thread (again: nothing)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(READ_TIMEOUT * max(len(self._controls), 1) + 1.0)

    def spans(self) -> tuple[RankWaits, ...]:
        """Each rank's seconds between the first reading and the last."""
        return tuple(w._replace(window_wait=min(self._window.get(w.rank, 0.0), w.data_wait))
                     for w in waits_between(self._before or {}, dict(self._latest)))

    def queued_share(self) -> float | None:
        """The share of the ranks' data wait that passed while the brokers held batches queued for them (as seen
        at the end of each interval between readings); None if they did not wait."""
        return self._waited_queued / self._waited if self._waited > 0 else None

    def _run(self) -> None:
        clients: list[ControlClient] = []
        try:
            clients = [ControlClient(c, **self._client_args) for c in self._controls]  # type: ignore[arg-type]
            self._before, _ = read_waits(clients, self._stream)
            self._latest = dict(self._before)
            self._first.set()
            while True:
                self._wake.wait(self._every)
                with self._read:
                    asked = self._asked             # the requests this reading, begun after them, answers
                    self._wake.clear()
                stop = self._stop.is_set()
                reading, held = read_waits(clients, self._stream)
                for rank, now in reading.items():
                    then = self._latest.get(rank)
                    if then is None or now.step >= then.step:
                        # a rank first seen now counts from its start, as spans() counts it
                        grew = max(now.data_wait - then.data_wait, 0.0) if then is not None else now.data_wait
                        self._waited += grew
                        if held:           # the rank waited while the broker held batches for it: the window
                            self._waited_queued += grew
                            self._window[rank] = self._window.get(rank, 0.0) + grew
                        self._latest[rank] = now
                with self._read:
                    self._answered = asked
                    self._read.notify_all()
                if stop:
                    return
        except Exception as exc:            # noqa: BLE001 - the verdict is best effort; the feed goes on
            log.debug("stream %r: the ranks' figures could not be read: %s", self._stream, exc)
        finally:
            self._first.set()
            with self._read:
                self._read.notify_all()      # a read_now waiting: the thread is over
            for client in clients:
                client.close()
