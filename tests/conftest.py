import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))   # tests/harness/, the one harness

pytest_plugins = ["harness"]      # the fixtures of every suite: tests/harness/__init__.py lists them


def _keys_for_every_broker_and_client() -> None:
    """SPARKBUS_TEST_AUTH=1: every broker a test starts runs with --auth, and every client (the driver, Spark's
    executors, mpiexec ranks, in-process streams) holds a key allowed in both roles. Set before any test starts
    Spark or a broker, through the variables the broker and the clients read."""
    from sparkbus.broker.auth import create_keypair

    directory = Path(tempfile.mkdtemp(prefix="sparkbus-test-keys-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    for folder in ("feeders", "ranks", "clients"):
        (directory / folder).mkdir()
    create_keypair(directory / "broker")
    public, secret = create_keypair(directory / "clients" / "tests")
    for role in ("feeders", "ranks"):
        shutil.copy(public, directory / role / public.name)
    os.environ.update(SPARKBUS_AUTH=str(directory), SPARKBUS_KEY=str(secret),
                      SPARKBUS_BROKER_KEY=str(directory / "broker.key"))


if os.environ.get("SPARKBUS_TEST_AUTH") == "1":
    _keys_for_every_broker_and_client()


def pytest_report_header(config):
    return "brokers run with --auth (SPARKBUS_TEST_AUTH=1)" if os.environ.get("SPARKBUS_TEST_AUTH") == "1" else None


def pytest_collection_modifyitems(items):
    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)


# One import name (pyproject.toml, package-dir): the folders feeder/, broker/, worker/, wire/ and launch/ are the
# packages sparkbus.*. A bare `import broker` from the repository root would load a folder a second time as another
# module (two BrokerError classes: an `except BrokerError` that misses), so after a whole session none may be there.
# Checked at the end of each process's session (each pytest-xdist worker's too): a failure is the last test's error.
BARE_NAMES = ("broker", "feeder", "worker", "wire", "launch")


@pytest.fixture(scope="session", autouse=True)
def only_sparkbus_import_names():
    yield
    bare = sorted(name for name in sys.modules if name.split(".")[0] in BARE_NAMES)
    assert not bare, f"modules imported by their bare folder names, not as sparkbus.*: {bare[:10]}"
