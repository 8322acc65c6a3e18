"""In-process fixtures: a broker in a thread on inproc:// endpoints (``start_broker_thread``, from the harness, as
``context`` and ``sockets`` are)."""

from harness import start_broker_thread  # noqa: F401
