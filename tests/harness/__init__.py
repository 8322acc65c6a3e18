"""The tests' one harness, in the spirit of dask's ``utils_test.py``: every test starts brokers, ranks, Spark,
sockets and child processes through it, imports its helpers from it (``from harness import ...``; no test module
imports another), and teardown fails the test that leaves a socket or a process behind.

- :mod:`harness.sockets`: ``context``, a ZeroMQ context that fails the test if the code under test leaves a socket
  open (as pyzmq's own ``tests/conftest.py`` does); ``sockets(type, address)``, a connected socket closed after the
  test; ``free_port_triple``, ``free_ports``; ``recv_header`` (bounded) and ``send``.
- :mod:`harness.processes`: ``children``, child processes started in a session of their own, waited for boundedly
  and killed with all they started if still running at the end of the test; ``run_child`` runs one to its end (a
  CLI call); ``wait_for``, the bounded wait.
- :mod:`harness.brokers`: ``start_broker_thread(**config)``, a broker in a thread of this process on fresh
  ``inproc://`` endpoints (unit tests); ``start_broker_process(*flags)``, ``python -m sparkbus.broker`` as a child
  process (integration tests); ``FakeBroker`` and ``joined``, a stand-in broker a rank talks to; ``key_directory``.
- :mod:`harness.ranks`: a rank's ``hello``, ``send_hello``, ``steps_of``; ``start_ranks`` (mpiexec ranks or a
  consumer) and ``start_group`` (ranks without MPI), both giving :class:`Ranks`.
- :mod:`harness.spark`: ``spark``, one local session for the run, and ``small_arrow_batches``.
- :mod:`harness.ledger`: the broker's rules without sockets: ``STREAM``, ``batch_frames``, ``push``, ``end``,
  ``join``, ``feed``, ``window``, ``ack``, ``nbytes``, ``Wire``, the fake ranks socket; ``journals`` and
  ``restart``, a ledger replayed from its journal as a restarted broker's.

tests/conftest.py registers this package as a pytest plugin (``pytest_plugins``): its fixtures serve every test.
"""

from harness.brokers import FakeBroker, joined, key_directory, start_broker_process, start_broker_thread
from harness.ledger import STREAM, Wire, ack, batch_frames, end, feed, join, journals, nbytes, push, restart, window
from harness.processes import Children, children, run_child, wait_for
from harness.ranks import Ranks, hello, send_hello, start_group, start_ranks, steps_of
from harness.sockets import TrackedContext, context, free_port_triple, free_ports, recv_header, send, sockets
from harness.spark import small_arrow_batches, spark

__all__ = [
    "STREAM", "Children", "FakeBroker", "Ranks", "TrackedContext", "Wire", "ack", "batch_frames", "children",
    "context", "end", "feed", "free_port_triple", "free_ports", "hello", "join", "joined", "journals",
    "key_directory", "nbytes", "push", "restart", "recv_header", "run_child", "send", "send_hello",
    "small_arrow_batches", "sockets", "spark", "start_broker_process", "start_broker_thread", "start_group",
    "start_ranks", "steps_of", "wait_for", "window",
]
