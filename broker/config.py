"""Settings: human units (``512MiB``, ``30s``), ``SPARKBUS_*`` environment variables and ``--config broker.toml``.

Every broker setting (:data:`BROKER_SETTINGS`) can be given four ways; the first that is set wins:

1. the flag (``--max-buffer 4GiB``),
2. the environment variable ``SPARKBUS_<NAME>`` (``SPARKBUS_MAX_BUFFER=4GiB``),
3. the config file (``--config broker.toml`` or ``SPARKBUS_CONFIG``; keys as the flags without dashes, ``-`` or
   ``_``: ``max_buffer = "4GiB"``; relative paths there are relative to the file),
4. the default.

A bad value anywhere is an error that names where it came from (:class:`ValueError`; the CLI makes it a usage
error, exit code 2): a typo never silently falls back to a default.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:                                  # pragma: no cover - the same parser, from PyPI (a dependency on 3.10)
    import tomli as tomllib

log = logging.getLogger("sparkbus.config")
T = TypeVar("T")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "tb": 10**12}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
SCHEMES = ("tcp", "ipc", "inproc")


def parse_size(text: str | int) -> int:
    """Bytes from ``1073741824``, ``1GiB``, ``512MiB``, ``64k`` (SI and binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"not a size: {text!r} (a size cannot be negative)")
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text) if isinstance(text, str) else None
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (try 1GiB, 512MiB or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(text: str | float) -> float:
    """Seconds from ``30``, ``30s``, ``250ms``, ``2m``, ``1h``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"not a duration: {text!r} (a duration cannot be negative)")
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text) if isinstance(text, str) else None
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (try 30s, 250ms or 2m)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def parse_count(text: str | int) -> int:
    """A whole number of at least 1 (``64``)."""
    if isinstance(text, str) and text.strip().isdigit():
        text = int(text.strip())
    if isinstance(text, bool) or not isinstance(text, int) or text < 1:
        raise ValueError(f"not a count: {text!r} (a whole number, 1 or more)")
    return text


def parse_optional_duration(text: str | float) -> float:
    """A duration (:func:`parse_duration`); ``never`` and ``off`` are 0 (what turns the setting off)."""
    if isinstance(text, str) and text.strip().lower() in ("never", "off"):
        return 0.0
    return parse_duration(text)


def parse_log_level(text: str) -> str:
    """``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or ``CRITICAL``, in any case."""
    if not isinstance(text, str) or text.strip().upper() not in LOG_LEVELS:
        raise ValueError(f"not a log level: {text!r} (one of {', '.join(LOG_LEVELS)})")
    return text.strip().upper()


def parse_bool(text: str | bool) -> bool:
    """``true/false``, ``yes/no``, ``on/off``, ``1/0`` (for variables; the file takes TOML booleans)."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower() if isinstance(text, str) else None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (true or false)")


def parse_port(text: str | int) -> int:
    """A TCP port, 0 (the system picks one) to 65535."""
    if isinstance(text, str) and text.strip().isdigit():
        text = int(text.strip())
    if isinstance(text, bool) or not isinstance(text, int) or not 0 <= text <= 65535:
        raise ValueError(f"not a port: {text!r} (0 to 65535)")
    return text


def parse_endpoint(text: str) -> str:
    """A ZeroMQ endpoint to bind: ``tcp://HOST:PORT`` (PORT a number or ``*``), ``ipc://PATH`` or
    ``inproc://NAME``."""
    if not isinstance(text, str):
        raise ValueError(f"not an endpoint: {text!r} (e.g. tcp://127.0.0.1:5555)")
    scheme, sep, location = text.strip().partition("://")
    if not sep or scheme not in SCHEMES or not location:
        raise ValueError(f"not an endpoint: {text!r} (e.g. tcp://127.0.0.1:5555, ipc:///run/sparkbus/feed)")
    if scheme == "tcp":
        host, colon, port = location.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and 0 < int(port) <= 65535)):
            raise ValueError(f"not a tcp endpoint: {text!r} (tcp://HOST:PORT, PORT a number or *)")
    return text.strip()


def parse_text(text: str) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a non-empty string, not {text!r}")
    return text.strip()


def from_env(name: str, parse: Callable[[str], T], default: T) -> T:
    """``SPARKBUS_<NAME>`` parsed with ``parse``; ``default`` when it is unset or empty.

    Raises:
        ValueError: the variable is set to a bad value; the message names the variable.
    """
    key = f"SPARKBUS_{name.upper()}"
    raw = os.environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"{key}={raw!r}: {exc}") from None


@dataclass
class BrokerConfig:
    """What a broker binds and how it behaves. Recorded here; sockets are made by the loop that owns them."""

    feed: str                          # PULL: data batches from Spark tasks
    ranks: str                         # ROUTER: the ranks' DEALER sockets
    control: str | None = None         # ROUTER: feeders' and drivers' requests (derived from feed if None)
    max_buffer: int = 1 << 30          # bytes of batches held before the feed socket stops being read
    max_message: int = 1 << 30         # ZeroMQ MAXMSGSIZE on every socket: no peer makes us allocate more
    heartbeat: float = 1.0             # seconds between heartbeats to ranks
    dead_after: float = 5.0            # a rank's connection silent this long (no transport heartbeat) is dead
    rejoin_grace: float = 10.0         # a lost rank's unacknowledged batches wait this long for it to rejoin
    journal: str | None = None         # directory of the append-only journal; None: state lives in memory only
    ready_file: str | None = None      # written (JSON of the bound endpoints) once every socket is bound
    auth: str | None = None            # key directory (broker/auth.py): CURVE on every socket; None: no keys
    insecure: bool = False             # allow binding a non-loopback address without auth
    metrics_port: int | None = None    # Prometheus GET /metrics on this port (0: the system picks); None: off
    metrics_host: str = "127.0.0.1"    # the address the metrics server listens on
    keep_epochs: int = 64              # delivered epochs per stream whose figures are kept; older ones are summed
    retire_streams_after: float = 3600.0   # drop a stream unused this long (0: never)


@dataclass(frozen=True)
class Setting:
    """One broker setting: its flag ``--NAME`` (dashes), variable ``SPARKBUS_NAME`` and file key ``name``."""

    name: str                           # BrokerConfig field (or log_level)
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str = ""                   # the flag's value in --help
    shown: str = ""                     # the default as --help says it
    path: bool = False                  # a path: relative ones in the config file are relative to the file
    flag: bool = True                   # False: a switch (--insecure), given without a value

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return f"SPARKBUS_{self.name.upper()}"


BROKER_SETTINGS: list[Setting] = [
    Setting("feed", parse_endpoint, "tcp://127.0.0.1:5555",
            "PULL endpoint Spark tasks push batches to; a port of * is chosen by the system (see --ready-file)",
            "ENDPOINT"),
    Setting("ranks", parse_endpoint, "tcp://127.0.0.1:5556", "ROUTER endpoint the ranks connect to", "ENDPOINT"),
    Setting("control", parse_endpoint, None, "ROUTER endpoint for feeders' requests", "ENDPOINT",
            "the feed port + 2"),
    Setting("max_buffer", parse_size, 1 << 30, "bytes of batches held before the feed is throttled", "SIZE",
            "1GiB"),
    Setting("max_message", parse_size, 1 << 30, "largest message any peer may send", "SIZE", "1GiB"),
    Setting("heartbeat", parse_duration, 1.0, "interval of heartbeats to the ranks", "DURATION", "1s"),
    Setting("dead_after", parse_duration, 5.0, "declare a rank dead when its connection is silent this long",
            "DURATION", "5s"),
    Setting("rejoin_grace", parse_duration, 10.0,
            "a rank whose connection was lost keeps its unacknowledged batches this long, so that it finds them "
            "when it rejoins; then they go to the other ranks", "DURATION", "10s"),
    Setting("journal", parse_text, None, "directory for the append-only journal that lets a restarted broker go on",
            "DIR", "none: state in memory only", path=True),
    Setting("ready_file", parse_text, None, "write the bound endpoints as JSON here once listening", "FILE",
            "none", path=True),
    Setting("auth", parse_text, None,
            "key directory: DIR/broker.key_secret, DIR/feeders/*.key, DIR/ranks/*.key; CURVE on every socket, "
            "reloaded on SIGHUP", "DIR", "none: no keys, loopback only", path=True),
    Setting("insecure", parse_bool, False,
            "allow binding a non-loopback address without --auth (anyone who reaches the ports can feed and "
            "consume)", shown="off", flag=False),
    Setting("metrics_port", parse_port, None, "serve Prometheus metrics on this port (GET /metrics)", "PORT",
            "off"),
    Setting("metrics_host", parse_text, "127.0.0.1", "address the metrics server listens on", "HOST"),
    Setting("keep_epochs", parse_count, 64,
            "delivered epochs per stream whose figures `sparkbus status` and the metrics keep; older ones are "
            "summed into the stream's totals", "N"),
    Setting("retire_streams_after", parse_optional_duration, 3600.0,
            "drop a stream nobody has used this long (no ranks, no epoch in progress, no message), remembering "
            "which epochs it delivered; 0 or never: keep every stream", "DURATION", "1h"),
    Setting("log_level", parse_log_level, "INFO", "logging level of the sparkbus.* loggers", "LEVEL"),
]
SETTINGS_BY_NAME = {s.name: s for s in BROKER_SETTINGS}


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The settings in a TOML file, parsed and checked, by setting name; relative paths made absolute.

    Raises:
        ValueError: the file is missing or not TOML, has a key that is not a setting, or a bad value.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the config file {path} is not valid TOML: {exc}") from None
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        setting = SETTINGS_BY_NAME.get(key.replace("-", "_"))
        if setting is None:
            raise ValueError(f"{path}: unknown setting {key!r}; known: "
                             f"{', '.join(s.name for s in BROKER_SETTINGS)}")
        try:
            parsed = setting.parse(value)
        except ValueError as exc:
            raise ValueError(f"{path}: {key} = {value!r}: {exc}") from None
        if setting.path and parsed is not None:
            parsed = str((path.parent / parsed).absolute()) if not Path(parsed).is_absolute() else parsed
        settings[setting.name] = parsed
    return settings


def resolve_settings(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None,
                     config_file: str | os.PathLike | None = None) -> dict[str, Any]:
    """Every broker setting's value: flag, else environment, else file, else default.

    Args:
        flags: values given on the command line, already parsed; None (or absent) for a flag not given.
        environ: the environment (``os.environ`` by default).
        config_file: a TOML file; None: ``SPARKBUS_CONFIG`` if set, else no file.
    Raises:
        ValueError: a bad variable or file (the message names it), or the exposure rule of :func:`check_exposure`.
    """
    environ = os.environ if environ is None else environ
    if config_file is None:
        config_file = environ.get("SPARKBUS_CONFIG") or None
    from_file = read_config_file(config_file) if config_file else {}
    values: dict[str, Any] = {}
    for setting in BROKER_SETTINGS:
        if flags.get(setting.name) is not None:
            values[setting.name] = flags[setting.name]
        elif environ.get(setting.variable, "") != "":
            raw = environ[setting.variable]
            try:
                values[setting.name] = setting.parse(raw)
            except ValueError as exc:
                raise ValueError(f"{setting.variable}={raw!r}: {exc}") from None
        elif setting.name in from_file:
            values[setting.name] = from_file[setting.name]
        else:
            values[setting.name] = setting.default
    check_exposure(values)
    return values


def broker_config(settings: Mapping[str, Any]) -> BrokerConfig:
    """The :class:`BrokerConfig` of resolved settings (those that are not its fields, like log_level, left out)."""
    names = {f.name for f in fields(BrokerConfig)}
    return BrokerConfig(**{k: v for k, v in settings.items() if k in names})


def is_loopback_endpoint(endpoint: str) -> bool:
    """Whether binding ``endpoint`` listens on this host only: ipc and inproc, or tcp on a loopback address (a
    host name counts when every address it resolves to is loopback)."""
    scheme, _, location = endpoint.partition("://")
    if scheme != "tcp":
        return True
    host = location.rpartition(":")[0].strip("[]")
    if host in ("*", ""):
        return False
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False                      # an interface name or an unknown host: not known to be loopback
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addresses)


def check_exposure(settings: Mapping[str, Any]) -> None:
    """Without ``auth``, refuse to bind a non-loopback address unless ``insecure`` says so.

    Raises:
        ValueError: naming the endpoint and the two ways out.
    """
    if settings.get("auth") or settings.get("insecure"):
        return
    for name in ("feed", "ranks", "control"):
        endpoint = settings.get(name)
        if endpoint and not is_loopback_endpoint(endpoint):
            raise ValueError(f"--{name} {endpoint} is reachable from other hosts, and no --auth key directory is "
                             f"set: anyone who reaches it could feed or take training data. Give --auth DIR (see "
                             f"`sparkbus keys create`), bind a loopback address, or pass --insecure on a trusted "
                             f"network")
