"""sparkbus worker: the MPI rank side. ``BatchStream(address, comm=...)`` yields batches epoch by epoch, as
dicts of numpy arrays, numpy masked arrays (nulls) and :class:`RaggedColumn` (binary, strings, arrays of varying
length).

Importing this package starts nothing (no MPI initialisation, no sockets).
"""

from broker.errors import BrokerError, ProtocolError, SparkbusError
from broker.ragged import RaggedColumn, pad

from .shuffle import ShuffleBuffer, shuffled
from .stream import BatchStream, EpochStats, StreamStats

__all__ = ["BatchStream", "BrokerError", "EpochStats", "ProtocolError", "RaggedColumn", "SparkbusError",
           "StreamStats", "ShuffleBuffer", "pad", "shuffled"]
