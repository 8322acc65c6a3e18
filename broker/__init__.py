"""sparkbus broker: the daemon between Spark tasks and MPI ranks, and the wire protocol all sides import.

Importing this package starts nothing. ``broker.protocol`` is the contract (see docs/PROTOCOL.md);
``broker.daemon.Broker`` is the loop; ``sparkbus broker`` / ``python -m broker`` run it.
"""

from .config import BrokerConfig
from .protocol import VERSION, BrokerError, Kind, ProtocolError

__all__ = ["BrokerConfig", "BrokerError", "Kind", "ProtocolError", "VERSION"]
