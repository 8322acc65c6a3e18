"""Broker addresses: ``scheme://location`` strings, and the control endpoint derived from a feed endpoint."""

from __future__ import annotations

import os
from collections.abc import Sequence


def control_address(feed_address: str) -> str:
    """The broker's control (request/reply) endpoint that goes with a feed endpoint.

    Feeders are given one address, the feed address; the control endpoint is derived from it:
    ``tcp://host:P`` -> ``tcp://host:P+2`` (P+1 is left for the ranks socket), ``ipc://path`` ->
    ``ipc://path.control``, ``inproc://name`` -> ``inproc://name.control``.

    Raises:
        ValueError: not ``scheme://location``, or a tcp address without a numeric port.
    """
    scheme, sep, location = feed_address.partition("://")
    if not sep:
        raise ValueError(f"address {feed_address!r} is not of the form scheme://location")
    if scheme == "tcp":
        host, colon, port = location.rpartition(":")
        if not colon or not port.isdigit():
            raise ValueError(f"tcp address {feed_address!r} needs an explicit numeric port")
        return f"tcp://{host}:{int(port) + 2}"
    return f"{feed_address}.control"


def broker_addresses(value: str | Sequence[str] | None, variable: str) -> list[str]:
    """The brokers' addresses from a list, a comma-separated string, or (when ``value`` is None) the environment
    variable ``variable`` (e.g. ``SPARKBUS_FEED_ADDRESS``), in the order given.

    Raises:
        ValueError: no address, one that is not ``scheme://location``, or the same address twice.
    """
    if value is None:
        value = os.environ.get(variable, "")
        if not value:
            raise ValueError(f"no broker address given, and {variable} is not set")
    items = value.split(",") if isinstance(value, str) else list(value)
    addresses = [a.strip() for a in items if a.strip()]
    if not addresses:
        raise ValueError(f"no broker address in {value!r}")
    for address in addresses:
        if "://" not in address:
            raise ValueError(f"address {address!r} is not of the form scheme://location")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"a broker address is given twice in {value!r}")
    return addresses


def feed_and_control_addresses(feed: str | Sequence[str] | None,
                               control: str | Sequence[str] | None = None) -> tuple[list[str], list[str]]:
    """The brokers' feed addresses (``SPARKBUS_FEED_ADDRESS`` when None) and their control addresses, in the same
    order: given (``SPARKBUS_CONTROL_ADDRESS``), or each feed port + 2.

    Raises:
        ValueError: as :func:`broker_addresses`, or not as many control addresses as feed addresses.
    """
    feeds = broker_addresses(feed, "SPARKBUS_FEED_ADDRESS")
    controls = (broker_addresses(control, "SPARKBUS_CONTROL_ADDRESS") if control
                else [control_address(f) for f in feeds])
    if len(controls) != len(feeds):
        raise ValueError(f"{len(feeds)} feed addresses but {len(controls)} control addresses")
    return feeds, controls
