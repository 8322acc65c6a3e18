"""sparkbus broker: the daemon between Spark tasks and MPI ranks, and the wire protocol all sides import.

Importing this package starts nothing. The contract (see docs/PROTOCOL.md) is ``broker.protocol`` (headers),
``broker.codec`` (batches as frames), ``broker.address`` and ``broker.errors``; ``broker.daemon.Broker`` is
the loop (I/O and timing), ``broker.ledger`` its rules (in ``partitions``, ``rejoin``, ``dispatch`` over the shared
``books``; ``events`` are what the journal keeps), ``broker.figures`` its figures; ``sparkbus broker`` /
``python -m broker`` run it.
"""

from .config import BrokerConfig
from .errors import BrokerError, FeedError, FeedTimeout, ProtocolError, SparkbusError, VersionMismatch
from .protocol import VERSION, Kind

__all__ = ["BrokerConfig", "BrokerError", "FeedError", "FeedTimeout", "Kind", "ProtocolError", "SparkbusError",
           "VersionMismatch", "VERSION"]
