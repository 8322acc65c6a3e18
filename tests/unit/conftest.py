"""In-process fixtures: a broker in a thread on inproc:// endpoints (``start_broker_thread``, from the harness, as
``context`` and ``sockets`` are)."""

import pytest
from harness import start_broker_thread  # noqa: F401


@pytest.fixture
def start_broker(start_broker_thread):  # noqa: F811
    """The old name of ``start_broker_thread``, until test_broker.py and test_small_batches.py say the new one."""
    return start_broker_thread
