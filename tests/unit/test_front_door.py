"""``from sparkbus import ...``: the public API in one place, importing nothing heavy."""

import sys

import sparkbus

from harness import run_child


def test_the_public_api_is_importable_from_sparkbus():
    from sparkbus import feeder, worker

    assert sparkbus.feed is feeder.feed and sparkbus.feed_epochs is feeder.feed_epochs
    assert sparkbus.BatchStream is worker.BatchStream and sparkbus.RaggedColumn is worker.RaggedColumn
    assert all(hasattr(sparkbus, name) for name in sparkbus.__all__)
    assert issubclass(sparkbus.BrokerError, sparkbus.SparkbusError)


def test_importing_sparkbus_imports_neither_spark_nor_mpi_nor_torch():
    code = ("import sys, sparkbus; heavy = {'pyspark', 'mpi4py', 'torch'} & set(sys.modules); "
            "assert not heavy, heavy")
    run_child([sys.executable, "-c", code], timeout=60, check=True)
