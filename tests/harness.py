"""The tests' fixtures, in the spirit of dask's ``utils_test.py``: every test starts brokers, sockets and child
processes through these, and teardown fails the test that leaves something behind.

- ``context``: a ZeroMQ context that tracks every socket made from it; a socket still open at the end of the
  test (other than those the harness made) fails the test, as pyzmq's own ``tests/conftest.py`` does.
- ``sockets``: ``sockets(type, address)``, a connected socket closed after the test.
- ``start_broker_thread``: ``start_broker_thread(**config)``, a :class:`broker.daemon.Broker` in a thread of this
  process on fresh ``inproc://`` endpoints (unit tests).
- ``start_broker_process``: ``start_broker_process(*flags)``, ``python -m sparkbus.broker`` as a child process on
  loopback ports it picks itself (:class:`launch.broker.BrokerProcess`; integration tests).
- ``children``: child processes started by :func:`launch.processes.spawn`, waited for boundedly, and killed with
  all they started if still running at the end of the test; :func:`run_child` runs one to its end (a CLI call).

The conftests import what they offer from here; tests import plain helpers (waits, ports, fakes, HELLOs) from
``helpers``.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq

from sparkbus.launch.broker import BrokerProcess
from sparkbus.launch.processes import kill_tree, spawn

TERM_SECONDS = 5.0      # a context whose sockets are all closed terminates at once; this only bounds a hang


# ---- sockets ------------------------------------------------------------------------------------------------

class TrackedContext(zmq.Context):
    """A :class:`zmq.Context` that keeps every socket made from it (strongly: a leaked socket is not collected
    and closed behind the test's back), with where it was made."""

    made: list   # class-level declarations: zmq.Context treats other attribute names as context options
    harness: set

    def __init__(self) -> None:
        super().__init__()
        self.made = []
        self.harness = set()

    def _add_socket(self, socket: Any) -> None:
        super()._add_socket(socket)
        self.made.append((socket, _caller()))

    def harness_socket(self, kind: int) -> zmq.Socket:
        """A socket (linger 0) the harness closes itself: not a leak of the code under test."""
        sock = self.socket(kind)
        sock.linger = 0
        self.harness.add(sock)
        return sock

    def close_all(self) -> list[str]:
        """Close every socket still open (linger 0) and terminate; returns where each open one not made by the
        harness was made."""
        leaked = [f"{zmq.SocketType(sock.type).name} socket made at {where}"
                  for sock, where in self.made if not sock.closed and sock not in self.harness]
        for sock, _ in self.made:
            if not sock.closed:
                sock.close(linger=0)
        self.made.clear()
        term = threading.Thread(target=self.term, name="context-term", daemon=True)
        term.start()
        term.join(TERM_SECONDS)
        if term.is_alive():
            leaked.append(f"the context did not terminate within {TERM_SECONDS:g} s (a socket made elsewhere?)")
        return leaked


def _caller() -> str:
    # The innermost frame outside pyzmq and this module: the line that asked for the socket.
    for frame in reversed(traceback.extract_stack(limit=12)[:-2]):
        if "/zmq/" not in frame.filename and not frame.filename.endswith("harness.py"):
            return f"{frame.filename}:{frame.lineno} (in {frame.name})"
    return "an unknown place"


@pytest.fixture
def context():
    """A :class:`TrackedContext`; the test fails if it leaves a socket open (each is then closed, linger 0)."""
    ctx = TrackedContext()
    yield ctx
    leaked = ctx.close_all()
    if leaked:
        pytest.fail("sockets left open at the end of the test:\n  " + "\n  ".join(leaked), pytrace=False)


@pytest.fixture
def sockets(context):
    """``sockets(type, address)``: a connected socket, closed with linger 0 after the test."""
    made = []

    def make(kind: int, address: str) -> zmq.Socket:
        sock = context.harness_socket(kind)
        sock.connect(address)
        made.append(sock)
        return sock

    yield make
    for sock in made:
        sock.close(linger=0)


# ---- brokers ------------------------------------------------------------------------------------------------

_inproc_names = itertools.count()


@pytest.fixture
def start_broker_thread(context):
    """``start_broker_thread(**config)``: a Broker in a thread on fresh inproc endpoints of ``context`` (settings
    are :class:`broker.config.BrokerConfig` fields); stopped, and its thread joined, after the test.

    ``tcp=True``: on free loopback ports instead, for clients that make contexts of their own (the feeder's task
    code, a ``BatchStream`` without ``context=``).
    """
    from sparkbus.broker.config import BrokerConfig
    from sparkbus.broker.daemon import Broker

    from helpers import free_port_triple

    running = []

    def start(*, tcp: bool = False, **settings: Any) -> Broker:
        settings.setdefault("heartbeat", 30.0)     # quiet: tests that check "nothing arrives" see no heartbeats
        settings.setdefault("dead_after", 60.0)
        if tcp:
            base = free_port_triple()
            feed, ranks, control = (f"tcp://127.0.0.1:{base + i}" for i in range(3))
        else:
            n = next(_inproc_names)
            feed, ranks, control = f"inproc://feed-{n}", f"inproc://ranks-{n}", f"inproc://control-{n}"
        config = BrokerConfig(feed=feed, ranks=ranks, control=control, **settings)
        broker = Broker(config, context=context)
        thread = threading.Thread(target=broker.run, daemon=True)
        thread.start()
        running.append((broker, thread))
        return broker

    yield start
    for broker, thread in running:
        broker.stop()
        thread.join(5)
        assert not thread.is_alive(), "broker thread did not stop"


@pytest.fixture
def start_broker_process(tmp_path):
    """``start_broker_process(*flags)``: ``python -m sparkbus.broker`` on loopback ports it picks itself, ready when
    it says so.

    The :class:`launch.broker.BrokerProcess` has ``feed``, ``ranks``, ``control``, ``proc``, ``log``,
    ``stats()`` and ``restart()``; each must stop on SIGTERM at the end of the test.
    """
    started = []

    def start(*flags: str) -> BrokerProcess:
        broker = BrokerProcess(tmp_path / f"broker-{len(started)}.log", *flags)
        started.append(broker)
        return broker.start(timeout=15)

    yield start
    for broker in started:
        broker.stop()
    assert not [broker for broker in started if broker.killed], "broker did not stop on SIGTERM"


# ---- child processes ----------------------------------------------------------------------------------------

class Children:
    """The child processes of one test: started by :func:`launch.processes.spawn` (a session of their own, ended
    if the test process dies), waited for with a bound, and killed with all they started at teardown."""

    def __init__(self) -> None:
        self.running: list[subprocess.Popen] = []

    def spawn(self, command: Sequence[str | Path], **popen: Any) -> subprocess.Popen:
        """Start ``command`` (``popen``: ``env`` set over this environment, ``stdout``, ``stderr``, ``text``...)."""
        proc = spawn([str(part) for part in command], **popen)
        self.running.append(proc)
        return proc

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float, what: str) -> tuple[Any, Any]:
        """``proc.communicate()`` within ``timeout`` seconds: its ``(stdout, stderr)``. If it does not finish in
        time, it and all it started (mpiexec, its proxies, the ranks) are killed and the test fails, naming
        ``what`` and showing the end of its stderr."""
        try:
            return proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _, err = Children.kill(proc)
            raise AssertionError(f"{what} did not finish within {timeout:g} s:\n{(err or '')[-3000:]}") from None

    @staticmethod
    def kill(proc: subprocess.Popen) -> tuple[Any, Any]:
        """SIGKILL ``proc`` and everything it started, at once; its remaining ``(stdout, stderr)``."""
        kill_tree(proc)
        return proc.communicate(timeout=10)

    def end(self) -> None:
        """Kill every child still running."""
        for proc in self.running:
            if proc.poll() is None:
                self.kill(proc)


def run_child(command: Sequence[str | Path], timeout: float, *, check: bool = False,
              **popen: Any) -> subprocess.CompletedProcess:
    """Run ``command`` to its end as :meth:`Children.spawn` starts it, its output captured as text: as
    :func:`subprocess.run` does, except that a timeout kills all it started too and fails the test (see
    :meth:`Children.finish`). ``check``: raise :class:`subprocess.CalledProcessError` if it exits non-zero."""
    proc = spawn([str(part) for part in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 **popen)
    try:
        out, err = Children.finish(proc, timeout, " ".join(str(part) for part in command[:3]))
    finally:
        if proc.poll() is None:
            Children.kill(proc)
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture
def children():
    """:class:`Children`: ``children.spawn(command, ...)``, ``children.finish(proc, timeout, what)``; those still
    running at the end of the test are killed with all they started."""
    started = Children()
    yield started
    started.end()
