"""What a feed's driver asks its brokers around the job, outside the recovery: a HELLO that proves each broker
is there (and a message naming the address the user typed when none is), whether the epoch was delivered already,
whether a broker restarted without a journal under a feed that does not recover, and, once the epoch is closed,
whether any rank reads the stream (:class:`NoRanksWarning`).
"""

from __future__ import annotations

import time
import warnings

from sparkbus.broker.client import ControlClient
from sparkbus.wire.errors import BrokerError, BrokerUnreachable
from sparkbus.wire.protocol import ErrorCode, Kind


class NoRanksWarning(UserWarning):
    """A feed closed an epoch of a stream that no rank has joined, a grace after the feed started: the epoch waits
    for ranks of that stream. Right when the ranks start later; otherwise their ``stream=`` differs from the feed's."""


REFUSED_AFTER = 3.0     # seconds of refused connections after which a feed fails, before any Spark job runs


def greet_brokers(clients: list[ControlClient], feeds: list[str], derived: bool, stream: str,
                  gone: set[int] | frozenset[int] = frozenset()) -> list[dict]:
    """Every broker's WELCOME (``{}`` for one in ``gone``): a feeder's HELLO, which proves the broker is there.

    Raises:
        BrokerUnreachable: a control address refused every connection for ``REFUSED_AFTER`` seconds: the message
            names the feed address as the user gave it and the control address that refused (``derived``: the
            feed port + 2, not given with ``control=``).
        BrokerError: as :meth:`ControlClient.hello` (a broker connected but silent for ``timeout``, a refusal).
    """
    try:
        return [{} if i in gone else client.hello("feeder", stream) for i, client in enumerate(clients)]
    except BrokerUnreachable as exc:
        i = next(i for i, c in enumerate(clients) if c.address == exc.address)
        raise BrokerUnreachable(unreachable_message(feeds[i], exc.address, derived, stream), exc.address) from None


def unreachable_message(feed_address: str, control: str, derived: bool, stream: str) -> str:
    """What a feed says when nothing listens at a broker's control address, naming the address the user typed."""
    if derived:
        how = "the feed port + 2" if control.startswith("tcp://") else "derived from it"
        where = (f"no sparkbus broker at {feed_address}: its control address {control} ({how}) refused every "
                 f"connection for {REFUSED_AFTER:g} s")
        fix = ("Start the broker (sparkbus broker), or give the feed address it listens on; a broker whose control "
               "address is not the feed port + 2 is named with control=")
    else:
        where = (f"no sparkbus broker at the control address {control} (given with control=, for the feed address "
                 f"{feed_address}): it refused every connection for {REFUSED_AFTER:g} s")
        fix = "Start the broker, or give the control address it listens on"
    return f"{where}, so no Spark job ran for stream {stream!r}. {fix}."


NO_RANKS_GRACE = 5.0    # seconds from a feed's start in which its stream's ranks may still join, before a warning
_warned_no_ranks: set[tuple[str, ...]] = set()     # (stream, control addresses...): warned once, waited for once


def warn_if_no_ranks(clients: list[ControlClient], gone: set[int], stream: str, epoch: int, started: float) -> None:
    """Once an epoch is closed: if no rank reads ``stream`` at any live broker (``WELCOME.ranks``), wait until
    ``NO_RANKS_GRACE`` seconds after the feed ``started`` for one to join, then warn (:class:`NoRanksWarning`),
    naming the streams the brokers' ranks do read. A broker that does not say (older, or silent) says nothing.
    Once per stream and brokers in a process: a run that feeds ahead of its ranks waits one grace, not one an epoch."""
    live = [client for i, client in enumerate(clients) if i not in gone]
    warned = (stream, *(client.address for client in live))
    if warned in _warned_no_ranks:
        return
    while True:
        try:
            counts = [client.hello("feeder", stream, timeout=min(client.timeout, 5.0)).get("ranks") for client in live]
        except BrokerError:
            return
        if not counts or any(count is None or count > 0 for count in counts) or _ended(live, stream, epoch):
            return
        left = started + NO_RANKS_GRACE - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(left, 0.5))
    _warned_no_ranks.add(warned)
    read: set[str] = set()
    for client in live:
        try:
            streams = client.request(Kind.STATS_REQUEST, timeout=min(client.timeout, 5.0))["stats"]["streams"]
        except (BrokerError, KeyError, TypeError):
            continue
        read.update(name for name, figures in streams.items() if figures.get("ranks") or figures.get("orphans"))
    reading = f"ranks read {', '.join(map(repr, sorted(read)))}" if read else "no rank has joined any stream"
    warnings.warn(f"stream {stream!r} epoch {epoch} is fed, but no rank reads stream {stream!r} at "
                  f"{', '.join(c.address for c in live)} ({reading}) {NO_RANKS_GRACE:g} s after the feed began: the "
                  f"epoch waits for ranks of stream {stream!r}. If they start later, ignore this; otherwise give the "
                  f"ranks and the feed the same stream=", NoRanksWarning, stacklevel=4)


def _ended(clients: list[ControlClient], stream: str, epoch: int) -> bool:
    """Whether a broker already ended the epoch on its ranks: they read it and left (a short epoch), not absent."""
    for client in clients:
        try:
            state = client.request(Kind.EPOCH_QUERY, timeout=min(client.timeout, 5.0), stream=stream, epoch=epoch)
        except BrokerError:
            continue
        if state.get("ended") or state.get("delivered"):
            return True
    return False


def check_epoch_unfed(client: ControlClient, stream: str, epoch: int) -> None:
    """Refuse, before any Spark job, an epoch the broker has delivered already (``EPOCH_QUERY``) or a stream name
    it would refuse: the same refusals as ``EPOCH_OPEN``'s, minutes of Spark start-up earlier."""
    answer = client.request(Kind.EPOCH_QUERY, stream=stream, epoch=epoch)
    if answer.get("ended") or answer.get("delivered"):
        raise BrokerError(f"the broker at {client.address} refused EPOCH_OPEN: stream {stream!r} has already "
                          f"delivered epoch {epoch}; feed a new epoch number or a new stream name (checked before "
                          f"any Spark job ran)", code=ErrorCode.REFUSED)


def raise_if_a_broker_restarted(clients: list[ControlClient], before: list[dict], stream: str, epoch: int,
                                 cause: Exception) -> None:
    for client, hello in zip(clients, before):
        try:
            now = client.hello("feeder", stream)
        except BrokerError:
            continue
        if now.get("incarnation") != hello.get("incarnation") and not now.get("journal"):
            raise BrokerError(f"the broker at {client.address} restarted while stream {stream!r} epoch {epoch} was "
                              f"being fed, and it runs without --journal: the batches it held are lost. Feed the "
                              f"epoch again (a new epoch number or stream), or run the broker with --journal to "
                              f"survive restarts") from cause


__all__ = ["NoRanksWarning", "greet_brokers", "check_epoch_unfed", "warn_if_no_ranks", "REFUSED_AFTER"]
