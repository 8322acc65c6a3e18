"""sparkbus worker: the MPI rank side. ``BatchStream(address, comm=...)`` yields batches epoch by epoch.

Importing this package starts nothing (no MPI initialisation, no sockets).
"""

from broker.errors import BrokerError, ProtocolError, SparkbusError

from .stream import BatchStream, EpochStats, StreamStats
from .shuffle import ShuffleBuffer, shuffled

__all__ = ["BatchStream", "BrokerError", "EpochStats", "ProtocolError", "SparkbusError", "StreamStats",
           "ShuffleBuffer", "shuffled"]
