"""Test-only: Python workers that outlive their pyspark daemon's shutdown (the cluster tests, the fault table).

Spark's executors start ``python -m pyspark.daemon``, which forks a Python worker per task. When the executor JVM
dies, the daemon reads EOF on its stdin and sends SIGHUP to its process group; each forked worker has reset SIGHUP
to SIG_DFL (``worker()`` in pyspark/daemon.py), so on an idle machine it dies at once. On a busy one it may first
read EOF on its own input socket, at an Arrow message boundary, take that for the end of its partition and end a
prefix of it: the case sparkbus must survive. Holding the worker makes that race certain.

With ``SPARKBUS_TEST_HOLD_WORKERS=DIR`` in the executors' environment and this directory on their PYTHONPATH
(``launch.cluster.HELD_WORKERS_SITE``; tests/integration/cluster_driver.py sets both for one feed, the fault
table's cluster for its driver's executors), ``signal.signal(SIGHUP, SIG_DFL)`` becomes ``SIG_IGN``, and the
process records itself as ``DIR/held-PID.json`` (pid, parent, start time), so that whoever started it kills what is
left of it by pid (``launch.cluster.held_workers`` lists them). A held worker lives on after the JVM: it reads its
input's EOF, ends what it has, then fails writing its result to the dead JVM and exits. Without the variable,
nothing changes.
"""

import json
import os
import signal

_HOLD = os.environ.get("SPARKBUS_TEST_HOLD_WORKERS")


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()[19]


def _record(directory: str) -> None:
    pid = os.getpid()
    path = os.path.join(directory, f"held-{pid}.json")
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump({"pid": pid, "parent": os.getppid(), "start": _start_time(pid)}, f)
    os.replace(temporary, path)


if _HOLD:
    _directory = _HOLD
    _signal = signal.signal

    def _held(signalnum, handler):
        if signalnum == signal.SIGHUP and handler == signal.SIG_DFL:
            handler = signal.SIG_IGN
            try:
                _record(_directory)
            except OSError:
                pass
        return _signal(signalnum, handler)

    signal.signal = _held
