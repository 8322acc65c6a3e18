"""sparkbus wire: the one contract every side speaks (docs/PROTOCOL.md is its prose).

* :mod:`sparkbus.wire.protocol`: message kinds, their header schemas, validation on receipt, versions.
* :mod:`sparkbus.wire.records`: the records it names by position (:class:`BatchId`, what a rank used), as named tuples.
* :mod:`sparkbus.wire.codec`: a batch's columns as frames, and back.
* :mod:`sparkbus.wire.ragged`: the rank's view of a variable-length column (:class:`RaggedColumn`, :func:`pad`).
* :mod:`sparkbus.wire.remainder`: how an epoch's last batches are shared out so that steps stay equal.
* :mod:`sparkbus.wire.address`: a broker's three endpoints, derived from one.
* :mod:`sparkbus.wire.errors`: every error sparkbus raises, under one root (:class:`SparkbusError`).

The feeder (``sparkbus.feeder``), the broker (``sparkbus.broker``) and the ranks (``sparkbus.worker``) import it;
it imports none of them. Importing it opens no socket.
"""

from sparkbus.wire.errors import BrokerError, FeedError, FeedTimeout, ProtocolError, SparkbusError, VersionMismatch
from sparkbus.wire.protocol import VERSION, Kind

__all__ = ["BrokerError", "FeedError", "FeedTimeout", "Kind", "ProtocolError", "SparkbusError", "VERSION",
           "VersionMismatch"]
