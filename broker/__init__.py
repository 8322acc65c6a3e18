"""sparkbus broker: the daemon between Spark tasks and the ranks.

Importing this package starts nothing. ``sparkbus.broker.daemon.Broker`` is the loop (I/O and timing),
``sparkbus.broker.ledger`` its rules (in ``partitions``, ``rejoin``, ``dispatch`` over the shared ``books``;
``events`` are what the journal keeps), ``sparkbus.broker.figures`` its figures; ``sparkbus broker`` /
``python -m sparkbus.broker`` run it. The contract it speaks with the feeder and the ranks is ``sparkbus.wire``
(docs/PROTOCOL.md).
"""

from sparkbus.broker.config import BrokerConfig
from sparkbus.wire.errors import BrokerError, FeedError, FeedTimeout, ProtocolError, SparkbusError, VersionMismatch
from sparkbus.wire.protocol import VERSION, Kind

__all__ = ["BrokerConfig", "BrokerError", "FeedError", "FeedTimeout", "Kind", "ProtocolError", "SparkbusError",
           "VersionMismatch", "VERSION"]
