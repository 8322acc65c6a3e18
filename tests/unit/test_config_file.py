"""Broker settings from flags, SPARKBUS_* variables and --config broker.toml (broker/config.py, broker/cli.py).

Precedence: flag > environment > file > default. Bad values anywhere are usage errors (exit code 2, a message,
no traceback), tested through real ``python -m sparkbus.broker`` and ``sparkbus status`` processes with timeouts.
Without --auth a broker binds loopback only unless --insecure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkbus.broker.config import (
    BROKER_SETTINGS,
    BrokerConfig,
    broker_config,
    check_exposure,
    is_loopback_endpoint,
    read_config_file,
    resolve_settings,
)
from sparkbus.launch.broker import BrokerProcess

RUN_SECONDS = 30
SPARKBUS = Path(sys.executable).with_name("sparkbus")


def clean_environ(**variables):
    """An environment without the caller's SPARKBUS_* variables, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKBUS_")}
    return {**env, **variables}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---- precedence ---------------------------------------------------------------------------------------------

def test_defaults_bind_loopback_and_leave_auth_and_metrics_off():
    settings = resolve_settings({}, environ={})
    config = broker_config(settings)
    assert (config.feed, config.ranks, config.control) == ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", None)
    assert (config.auth, config.insecure, config.metrics_port, config.metrics_host) == (None, False, None,
                                                                                         "127.0.0.1")
    assert (config.max_buffer, config.heartbeat, settings["log_level"]) == (1 << 30, 1.0, "INFO")
    assert config == BrokerConfig(feed="tcp://127.0.0.1:5555", ranks="tcp://127.0.0.1:5556")


@pytest.mark.parametrize("name, flag, variable, in_file, default", [
    ("max_buffer", 16 << 20, "32MiB", '"64MiB"', 1 << 30),
    ("heartbeat", 0.25, "500ms", "2", 1.0),
    ("metrics_port", 9101, "9102", "9103", None),
    ("log_level", "DEBUG", "warning", '"error"', "INFO"),
    ("feed", "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002", '"tcp://127.0.0.1:7003"', "tcp://127.0.0.1:5555"),
])
def test_a_flag_beats_the_variable_which_beats_the_file_which_beats_the_default(tmp_path, name, flag, variable,
                                                                                 in_file, default):
    variable_name = f"SPARKBUS_{name.upper()}"
    config = write(tmp_path / "broker.toml", f"{name} = {in_file}\n")
    parsed = {"max_buffer": (32 << 20, 64 << 20), "heartbeat": (0.5, 2.0), "metrics_port": (9102, 9103),
              "log_level": ("WARNING", "ERROR"), "feed": ("tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003")}[name]
    env = {variable_name: variable}
    assert resolve_settings({name: flag}, env, config)[name] == flag
    assert resolve_settings({name: None}, env, config)[name] == parsed[0]
    assert resolve_settings({}, {}, config)[name] == parsed[1]
    assert resolve_settings({}, {variable_name: ""}, config)[name] == parsed[1]     # empty is unset
    assert resolve_settings({}, {}, None)[name] == default


def test_sparkbus_config_names_the_file_when_no_flag_does(tmp_path):
    first = write(tmp_path / "a.toml", 'max_buffer = "8MiB"\n')
    second = write(tmp_path / "b.toml", 'max_buffer = "4MiB"\n')
    assert resolve_settings({}, {"SPARKBUS_CONFIG": str(first)})["max_buffer"] == 8 << 20
    assert resolve_settings({}, {"SPARKBUS_CONFIG": str(first)}, second)["max_buffer"] == 4 << 20


def test_the_file_takes_every_setting_in_toml_types_and_both_key_spellings(tmp_path):
    path = write(tmp_path / "broker.toml", """
feed = "tcp://127.0.0.1:6000"
ranks = "tcp://127.0.0.1:6001"
control = "ipc:///tmp/sparkbus-control"
max-buffer = 1048576
max_message = "2MiB"
heartbeat = 0.5
dead_after = "3s"
rejoin_grace = "1m"
journal = "journal"
ready_file = "/run/sparkbus/ready.json"
auth = "keys"
insecure = false
metrics_port = 9105
metrics_host = "::1"
keep_epochs = 16
retire-streams-after = "2h"
log_level = "debug"
""")
    settings = read_config_file(path)
    assert set(settings) == {s.name for s in BROKER_SETTINGS}
    assert settings["max_buffer"] == 1 << 20 and settings["max_message"] == 2 << 20
    assert (settings["heartbeat"], settings["dead_after"], settings["rejoin_grace"]) == (0.5, 3.0, 60.0)
    # relative paths are the file's neighbours, wherever the broker is started from
    assert settings["journal"] == str(tmp_path / "journal") and settings["auth"] == str(tmp_path / "keys")
    assert settings["ready_file"] == "/run/sparkbus/ready.json"
    assert (settings["metrics_port"], settings["metrics_host"], settings["log_level"]) == (9105, "::1", "DEBUG")
    assert (settings["keep_epochs"], settings["retire_streams_after"]) == (16, 7200.0)


@pytest.mark.parametrize("text, message", [
    ("max_bufer = 1\n", "unknown setting 'max_bufer'"),
    ('max_buffer = "lots"\n', "max_buffer = 'lots': not a size"),
    ("insecure = \"maybe\"\n", "not a boolean"),
    ("metrics_port = 70000\n", "not a port"),
    ('feed = "5555"\n', "not an endpoint"),
    ('feed = "tcp://127.0.0.1:x"\n', "not a tcp endpoint"),
    ("heartbeat = -1\n", "cannot be negative"),
    ("log_level = 3\n", "not a log level"),
    ("max_buffer = \n", "not valid TOML"),
])
def test_a_bad_file_says_which_file_and_which_key(tmp_path, text, message):
    path = write(tmp_path / "broker.toml", text)
    with pytest.raises(ValueError, match=message) as error:
        resolve_settings({}, {}, path)
    assert str(path) in str(error.value)


def test_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read the config file"):
        resolve_settings({}, {}, tmp_path / "nowhere.toml")


@pytest.mark.parametrize("variable, value, message", [
    ("SPARKBUS_MAX_BUFFER", "lots", "SPARKBUS_MAX_BUFFER='lots': not a size"),
    ("SPARKBUS_HEARTBEAT", "soon", "SPARKBUS_HEARTBEAT='soon': not a duration"),
    ("SPARKBUS_LOG_LEVEL", "FOO", "not a log level"),
    ("SPARKBUS_INSECURE", "perhaps", "not a boolean"),
    ("SPARKBUS_METRICS_PORT", "tcp://10.0.0.1:9105", "not a port"),     # what a Kubernetes service link looks like
])
def test_a_bad_variable_is_an_error_naming_it(variable, value, message):
    with pytest.raises(ValueError, match=message):
        resolve_settings({}, {variable: value})


# ---- loopback unless --auth or --insecure ---------------------------------------------------------------------

@pytest.mark.parametrize("endpoint, loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://127.0.0.2:*", True), ("tcp://localhost:5555", True),
    ("tcp://[::1]:5555", True), ("tcp://lo:5555", True), ("ipc:///tmp/feed", True), ("inproc://feed", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False), ("tcp://192.0.2.7:5555", False),
    ("tcp://[::]:5555", False), ("tcp://eth0:5555", False), ("tcp://no-such-host.invalid:5555", False),
])
def test_loopback_endpoints(endpoint, loopback):
    assert is_loopback_endpoint(endpoint) is loopback


@pytest.mark.parametrize("name", ["feed", "ranks", "control"])
def test_a_non_loopback_bind_without_keys_needs_insecure(name):
    settings = {"feed": "tcp://127.0.0.1:5555", "ranks": "tcp://127.0.0.1:5556", "control": None,
                name: "tcp://0.0.0.0:6000"}
    with pytest.raises(ValueError, match=f"--{name} tcp://0.0.0.0:6000 is reachable from other hosts"):
        check_exposure(settings)
    check_exposure({**settings, "insecure": True})
    check_exposure({**settings, "auth": "/etc/sparkbus/keys"})


def test_insecure_from_the_environment_or_the_file_counts_too(tmp_path):
    flags = {"feed": "tcp://0.0.0.0:5555", "ranks": "tcp://0.0.0.0:5556"}
    assert resolve_settings(flags, {"SPARKBUS_INSECURE": "1"})["insecure"] is True
    assert resolve_settings(flags, {}, write(tmp_path / "b.toml", "insecure = true\n"))["insecure"] is True
    with pytest.raises(ValueError, match="--insecure"):
        resolve_settings(flags, {"SPARKBUS_INSECURE": "0"})


# ---- through the real command line ----------------------------------------------------------------------------

def run(command, env=None, cwd=None):
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_SECONDS, env=env or clean_environ(),
                            cwd=cwd)
    assert "Traceback" not in result.stderr, result.stderr
    return result


@pytest.mark.parametrize("args, variables, message", [
    (["--log-level", "FOO"], {}, "argument --log-level: not a log level: 'FOO'"),
    (["--max-buffer", "lots"], {}, "argument --max-buffer: not a size"),
    (["--metrics-port", "http"], {}, "argument --metrics-port: not a port"),
    (["--feed", "localhost"], {}, "argument --feed: not an endpoint"),
    ([], {"SPARKBUS_MAX_BUFFER": "lots"}, "SPARKBUS_MAX_BUFFER='lots': not a size"),
    ([], {"SPARKBUS_DEAD_AFTER": "never"}, "SPARKBUS_DEAD_AFTER='never': not a duration"),
    (["--feed", "tcp://0.0.0.0:*"], {}, "is reachable from other hosts"),
    (["--config", "/nonexistent/broker.toml"], {}, "cannot read the config file"),
    ([], {"SPARKBUS_CONFIG": "/nonexistent/broker.toml"}, "cannot read the config file"),
])
def test_bad_broker_settings_are_usage_errors(args, variables, message):
    result = run([sys.executable, "-m", "sparkbus.broker", *args], env=clean_environ(**variables))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "error:" in result.stderr


def test_a_bad_config_file_is_a_usage_error(tmp_path):
    path = write(tmp_path / "broker.toml", 'heartbeat = "often"\n')
    result = run([sys.executable, "-m", "sparkbus.broker", "--config", str(path)])
    assert result.returncode == 2 and f"{path}: heartbeat = 'often': not a duration" in result.stderr


def test_an_unusable_key_directory_is_a_usage_error(tmp_path):
    result = run([sys.executable, "-m", "sparkbus.broker", "--auth", str(tmp_path)])
    assert result.returncode == 2 and "broker.key_secret" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--timeout", "x"], "argument --timeout: not a duration: 'x'"),
    (["--key", "/nonexistent/me.key_secret"], "does not exist"),
])
def test_bad_status_arguments_are_usage_errors(args, message):
    result = run([str(SPARKBUS), "status", "tcp://127.0.0.1:1", *args])
    assert result.returncode == 2 and message in result.stderr


def test_precedence_holds_in_a_running_broker(tmp_path):
    """The file sets the buffer and the journal (a path relative to the file); a variable overrides the buffer,
    then a flag overrides both."""
    (tmp_path / "conf").mkdir()
    path = write(tmp_path / "conf" / "broker.toml",
                 'max_buffer = "64MiB"\njournal = "journal"\nlog_level = "WARNING"\n')
    brokers = [BrokerProcess(tmp_path / "from-variable.log", "--config", str(path),
                             env={"SPARKBUS_MAX_BUFFER": "32MiB"}, cwd=tmp_path),
               BrokerProcess(tmp_path / "from-flag.log", "--config", str(path), "--max-buffer", "16MiB",
                             env={"SPARKBUS_MAX_BUFFER": "32MiB"}, cwd=tmp_path)]
    try:
        for broker, expected in zip(brokers, (32 << 20, 16 << 20)):
            broker.start(timeout=RUN_SECONDS)
            stats = broker.stats(timeout=10)["broker"]
            assert stats["max_buffer"] == expected
            assert stats["journal"] == str(tmp_path / "conf" / "journal")
            broker.stop()
    finally:
        for broker in brokers:
            broker.stop()


def test_sighup_reloads_instead_of_ending_the_broker(tmp_path):
    """systemctl reload sends SIGHUP. Its default action ends a process as soon as the signal is delivered, before
    the process runs again: a broker that answers a request sent after the signal has handled it."""
    import signal

    broker = BrokerProcess(tmp_path / "broker.log", env=clean_environ())
    try:
        broker.start(timeout=RUN_SECONDS)
        os.kill(broker.pid, signal.SIGHUP)
        assert broker.stats(timeout=10)["broker"]["pid"] == broker.pid
        assert broker.proc.poll() is None
    finally:
        broker.stop()
