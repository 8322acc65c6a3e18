"""Broker addresses: ``scheme://location`` strings, and the control endpoint derived from a feed endpoint."""

from __future__ import annotations


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
