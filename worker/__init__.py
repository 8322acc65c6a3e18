"""sparkbus worker: the MPI rank side. ``BatchStream(address, comm=...)`` yields batches epoch by epoch, as
dicts of numpy arrays, numpy masked arrays (nulls) and :class:`RaggedColumn` (binary, strings, arrays of varying
length).

Importing this package starts nothing (no MPI initialisation, no sockets).
"""

from sparkbus.wire.errors import BrokerError, ProtocolError, SparkbusError
from sparkbus.wire.ragged import RaggedColumn, pad
from sparkbus.worker.shuffle import ShuffleBuffer, shuffled
from sparkbus.worker.stats import EpochStats, StreamStats
from sparkbus.worker.stream import BatchStream

__all__ = ["BatchStream", "BrokerError", "EpochStats", "ProtocolError", "RaggedColumn", "SparkbusError",
           "StreamStats", "ShuffleBuffer", "pad", "shuffled"]
