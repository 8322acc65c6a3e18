"""sparkbus worker: the MPI rank side. ``BatchStream(address, comm=...)`` yields batches epoch by epoch.

Importing this package starts nothing (no MPI initialisation, no sockets).
"""

from broker.protocol import BrokerError, ProtocolError

from .stream import BatchStream, EpochStats, StreamStats
from .torch_data import ShuffleBuffer, shuffled

__all__ = ["BatchStream", "BrokerError", "EpochStats", "ProtocolError", "StreamStats",
           "ShuffleBuffer", "shuffled"]
