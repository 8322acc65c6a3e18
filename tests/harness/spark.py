"""Spark for the tests: one local session for the run."""

from __future__ import annotations

import pytest

from sparkbus.launch.spark import local_session


@pytest.fixture(scope="session")
def spark():
    # local[2,4]: two cores, and a failed task is retried (up to 4 attempts), as on a cluster. (Spark does not
    # speculate in local mode: test_guarantees runs concurrent attempts through the feeder's task code instead.)
    session = local_session("local[2,4]", "sparkbus-tests")
    yield session
    session.stop()


@pytest.fixture
def small_arrow_batches(spark):
    """Arrow batches of 100 rows between Spark's Python stages, so a task streams part of a partition."""
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
    yield
    spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
