"""One import name: installed, sparkbus is ``sparkbus.*`` and nothing else (tests/test_install.py checks the wheel)."""

import sys

import sparkbus

from harness import run_child


def test_every_part_imports_under_sparkbus_and_no_bare_folder_name_is_loaded():
    from sparkbus import broker, feeder, launch, wire, worker

    for part in (broker, feeder, launch, wire, worker):
        assert part.__name__.startswith("sparkbus.") and part.__name__.count(".") == 1
    assert sparkbus.BrokerError is wire.BrokerError is broker.BrokerError
    assert not [name for name in sys.modules if name.split(".")[0] in ("broker", "feeder", "worker", "wire", "launch")]


def test_a_users_own_worker_and_broker_modules_do_not_shadow_sparkbus(tmp_path):
    for name in ("worker", "broker", "feeder", "launch", "wire"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py was imported')\n")
    script = ("import sys; sys.path.insert(0, '.')\n"
              "from sparkbus import BatchStream, feed, feed_epochs\n"
              "import sparkbus.broker.daemon, sparkbus.wire.protocol, sparkbus.launch.processes\n"
              "print(BatchStream.__module__, feed.__module__)\n")
    out = run_child([sys.executable, "-c", script], timeout=60, check=True, cwd=tmp_path).stdout
    assert out.split() == ["sparkbus.worker.stream", "sparkbus.feeder.driver"]
