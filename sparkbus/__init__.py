"""sparkbus: stream training data from Apache Spark into deep-learning ranks through a ZeroMQ broker.

The way in for users: everything public, from one place::

    from sparkbus import feed, feed_epochs, BatchStream, RaggedColumn, pad

The three parts stay where they are, one role each: ``feeder`` (the Spark side), ``broker`` (the daemon and the
wire protocol both sides import) and ``worker`` (the rank side). Importing this package starts nothing and
imports neither pyspark, mpi4py nor torch; those are imported where they are used.
"""

from sparkbus.broker.config import BrokerConfig
from sparkbus.feeder import DivergedPartitionsWarning, FeedReport, NoRanksWarning, epoch_order, feed, feed_epochs
from sparkbus.feeder.elastic import feed_elastic
from sparkbus.feeder.mixture import MixturePlan, feed_mixture
from sparkbus.wire.errors import (
    AuthError,
    BrokerError,
    BrokerUnreachable,
    FeedError,
    FeedTimeout,
    ProtocolError,
    SparkbusError,
    VersionMismatch,
)
from sparkbus.wire.protocol import VERSION
from sparkbus.wire.ragged import Carry, Packed, RaggedColumn, pack, pad
from sparkbus.worker import BatchStream, EpochStats, ShuffleBuffer, StreamStats, shuffled
from sparkbus.worker.checkpoint import ElasticCheckpoints

__version__ = "0.3.0"

__all__ = ["AuthError", "BatchStream", "BrokerConfig", "BrokerError", "BrokerUnreachable", "Carry",
           "DivergedPartitionsWarning", "ElasticCheckpoints", "EpochStats", "FeedError", "FeedReport", "FeedTimeout",
           "MixturePlan", "NoRanksWarning", "Packed", "ProtocolError", "RaggedColumn", "ShuffleBuffer", "SparkbusError",
           "StreamStats", "VERSION", "VersionMismatch", "epoch_order", "feed", "feed_elastic", "feed_epochs",
           "feed_mixture", "pack", "pad", "shuffled"]
