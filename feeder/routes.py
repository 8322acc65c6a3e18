"""What a recovery feeds again, and where: pure functions of what the brokers said (docs/design/RECOVERY.md,
"The driver", steps 2-4).

:func:`plan_recovery` fixes a route for every partition no live broker committed (:class:`Routes`, shipped to the
recovery job's tasks) and the sets ``EPOCH_RECOVER`` tells each live broker (:func:`recover_fields`);
:func:`resume_plan` is a resume's. No sockets, no Spark: :mod:`feeder.recovery` asks and sends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sparkbus.broker.partitions import MAX_PARTITIONS
from sparkbus.wire.protocol import pack_ranges, unpack_ranges


class Partitions(NamedTuple):
    """A set of partition numbers: ``numbers``, and, when ``tail`` is not None, every partition from ``tail`` up
    (a Spark Connect feed whose partition count is not known yet gives the rest to one broker)."""

    numbers: frozenset[int] = frozenset()
    tail: int | None = None

    def __contains__(self, part: object) -> bool:
        return part in self.numbers or (self.tail is not None and isinstance(part, int) and part >= self.tail)

    def ranges(self, bound: int = MAX_PARTITIONS) -> list[int]:
        """As ``protocol.pack_ranges`` (flat ``[start, stop, ...]``), the tail ending at ``bound``."""
        if self.tail is None:
            return pack_ranges(self.numbers)
        flat = pack_ranges(n for n in self.numbers if n < self.tail)
        if flat and flat[-1] == self.tail:
            flat[-1] = bound
        elif self.tail < bound:
            flat.extend((self.tail, bound))
        return flat


class BrokerEpoch(NamedTuple):
    """A broker's answer to ``EPOCH_QUERY`` (docs/design/RECOVERY.md, the messages' table)."""

    known: bool = False
    closed: bool = False
    ended: bool = False
    delivered: bool = False
    partitions: int = 0
    committed: frozenset[int] = frozenset()
    seen: frozenset[int] = frozenset()
    incarnation: str = ""
    journal: bool = False


def read_query(reply: Mapping[str, Any]) -> BrokerEpoch:
    """The :class:`BrokerEpoch` of an ``OK`` to ``EPOCH_QUERY`` (fields a broker left out are empty)."""
    return BrokerEpoch(bool(reply.get("known")), bool(reply.get("closed")), bool(reply.get("ended")),
                       bool(reply.get("delivered")), int(reply.get("partitions") or 0),
                       frozenset(unpack_ranges(reply.get("committed") or [])),
                       frozenset(unpack_ranges(reply.get("seen") or [])),
                       str(reply.get("incarnation", "")), bool(reply.get("journal")))


class Routes:
    """The broker (an index in the feed's list) each re-fed partition streams to; None: not re-fed.

    Shipped to the recovery job's tasks (it pickles small). Below ``top`` the routes are ``fixed``; from ``top``
    up every partition goes to ``tail`` (None: none does): a Spark Connect feed whose partition count is not
    known yet.
    """

    def __init__(self, fixed: Mapping[int, int], top: int, tail: int | None = None) -> None:
        self.fixed = dict(fixed)
        self.top = top
        self.tail = tail

    def route(self, part: int) -> int | None:
        return self.fixed.get(part) if part < self.top else self.tail

    def partitions(self) -> list[int]:
        """The re-fed partitions below ``top``, in order (all of them, when the count is known)."""
        return sorted(self.fixed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Routes) and (self.fixed, self.top, self.tail) == (other.fixed, other.top,
                                                                                   other.tail)

    def __repr__(self) -> str:
        return f"Routes({self.fixed}, top={self.top}, tail={self.tail})"


class Plan(NamedTuple):
    """A recovery round: the routes of the re-fed partitions, and per live broker ``EPOCH_RECOVER``'s sets."""

    routes: Routes
    carries: dict[int, Partitions]
    recovered: dict[int, Partitions]
    takeover: dict[int, int]          # per lost broker, the broker its partitions go to


def takeover_brokers(lost: Sequence[int], live: Sequence[int], closed: Sequence[int] = ()) -> dict[int, int]:
    """Per lost broker, the one broker that takes its partitions over: the restarted broker itself (it is live
    again), else the first live broker in the feed's order (whose epoch is not closed yet, if there is one).

    Raises:
        ValueError: no broker is live.
    """
    if not live:
        raise ValueError("no broker is live")
    open_live = [i for i in sorted(live) if i not in closed] or sorted(live)
    return {i: i if i in live else open_live[0] for i in lost}


def plan_recovery(brokers: int, partitions: int | None, live: Sequence[int], lost: Sequence[int],
                  states: Mapping[int, BrokerEpoch], recovered_before: Mapping[int, Partitions] | None = None
                  ) -> Plan:
    """Where each partition no live broker committed is fed again (docs/design/RECOVERY.md, "The driver" 3-4).

    A partition seen (not committed) at a live broker goes there. Every other one goes to a takeover broker
    (:func:`takeover_brokers`): its home broker's (``part % brokers``) when the home broker was lost, else the
    first lost broker's. With ``partitions`` unknown (Spark Connect), every partition past the highest any
    broker named goes to the first lost broker's takeover.

    Args:
        brokers: the feed's brokers.
        partitions: the epoch's partition count, None if not known yet.
        live: the live brokers' indices; ``states`` has an :class:`BrokerEpoch` of each.
        lost: the brokers lost so far in this feed (restarted or gone), at least one.
        recovered_before: per broker, the partitions it was given in place of a lost broker in earlier rounds.
    Returns:
        A :class:`Plan`.
    """
    recovered_before = recovered_before or {}
    lost = sorted(set(lost))
    closed = [i for i in live if states[i].closed]
    takeover = takeover_brokers(lost, live, closed)
    committed = frozenset().union(*(states[i].committed for i in live))
    if partitions is None:
        named = committed.union(*(states[i].seen for i in live), *(p.numbers for p in recovered_before.values()))
        top = max(named, default=-1) + 1
    else:
        top = partitions
    fixed: dict[int, int] = {}
    taken: dict[int, set[int]] = {i: set() for i in live}
    for part in range(top):
        if part in committed:
            continue
        where = next((i for i in sorted(live) if part in states[i].seen), None)
        if where is None:
            home = part % brokers
            where = takeover[home] if home in takeover else takeover[lost[0]]
            taken[where].add(part)
        fixed[part] = where
    tail = takeover[lost[0]] if partitions is None else None
    carries, recovered = {}, {}
    for i in live:
        mine = states[i].committed | states[i].seen | {p for p, b in fixed.items() if b == i}
        before = recovered_before.get(i, Partitions())
        again = {p for p in mine if p in before} | taken[i]
        carries[i] = Partitions(frozenset(mine), top if tail == i else None)
        recovered[i] = Partitions(frozenset(again), top if tail == i else None)
    return Plan(Routes(fixed, top, tail), carries, recovered, takeover)


def resume_plan(brokers: int, partitions: int) -> Plan:
    """A resume from a checkpoint: every partition fed again, to its home broker ``part % brokers``, all of them
    recovered (the loss ``""``, reset at every broker first)."""
    fixed = {part: part % brokers for part in range(partitions)}
    mine = {i: Partitions(frozenset(p for p, b in fixed.items() if b == i)) for i in range(brokers)}
    return Plan(Routes(fixed, partitions), mine, dict(mine), {})


def spread_plan(live: Sequence[int], partitions: int | None) -> Plan:
    """A new epoch while brokers of the feed are gone for good (``feed_epochs`` goes on without them): partition
    ``p`` to ``live[p % len(live)]``, nothing recovered (no rank used anything of it). With the count not known
    yet (Spark Connect), every partition to the first live broker."""
    if partitions is None:
        return Plan(Routes({}, 0, live[0]), {live[0]: Partitions(tail=0)}, {i: Partitions() for i in live}, {})
    fixed = {part: live[part % len(live)] for part in range(partitions)}
    mine = {i: Partitions(frozenset(p for p, b in fixed.items() if b == i)) for i in live}
    return Plan(Routes(fixed, partitions), mine, {i: Partitions() for i in live}, {})


def recover_fields(plan: Plan, broker: int, stream: str, epoch: int, partitions: int | None, delivery: str,
                   lost: Sequence[str], reset: bool = False) -> dict[str, Any]:
    """``EPOCH_RECOVER``'s fields for one broker of a plan (without ``req``)."""
    bound = MAX_PARTITIONS if partitions is None else partitions
    return dict(stream=stream, epoch=epoch, partitions=bound, delivery=delivery,
                carries=plan.carries[broker].ranges(bound), recovered=plan.recovered[broker].ranges(bound),
                lost=list(lost), reset=reset)


__all__ = ["BrokerEpoch", "Partitions", "Plan", "Routes", "plan_recovery", "read_query", "recover_fields",
           "resume_plan", "spread_plan", "takeover_brokers"]
