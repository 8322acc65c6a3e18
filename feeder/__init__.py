"""sparkbus feeder: the Spark side. ``feed(df_or_rdd, address, ...)`` streams every partition to the broker, from a
classic SparkSession or a Spark Connect one (DataFrames only: Connect has no RDDs). A broker lost while it feeds
(restarted without ``--journal``, or gone) costs a recomputation from Spark's lineage (:mod:`feeder.recovery`,
under the watch of :mod:`feeder.watch`), and ``feed_epochs(..., resume=state)`` re-feeds an epoch for ranks resuming
from a mid-epoch checkpoint. docs/DESIGN.md ("Feeder") maps the modules.

Importing this package starts nothing; it imports pyspark only when ``feed`` is called.
"""

from sparkbus.feeder.brokers import NoRanksWarning
from sparkbus.feeder.driver import DivergedPartitionsWarning, FeedReport, feed
from sparkbus.feeder.epochs import default_partitions, epoch_order, feed_epochs
from sparkbus.feeder.jobs import is_connect_dataframe
from sparkbus.feeder.schema import prepare_dataframe
from sparkbus.feeder.task import PartitionReport, stream_partition
from sparkbus.wire.errors import BrokerError, FeedError, FeedTimeout, SparkbusError

__all__ = ["feed", "feed_epochs", "epoch_order", "FeedReport", "FeedError", "FeedTimeout", "BrokerError",
           "SparkbusError", "DivergedPartitionsWarning", "NoRanksWarning", "PartitionReport", "prepare_dataframe",
           "stream_partition", "is_connect_dataframe", "default_partitions"]
