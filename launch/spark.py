"""Spark on this machine: loopback only, no UI, and the venv's Python on the executors.

For a session in this process use :func:`local_session`; for a job of its own, :func:`submit_command` with
:func:`local_env` in its environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"      # pyspark installs it next to the venv's python

# Spark settings of every local run: the driver on loopback, no web UI, no progress bars in the logs.
LOCAL_CONF = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
              "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"}


def local_env() -> dict[str, str]:
    """Environment of a local Spark driver: this interpreter on the executors and the driver, loopback only."""
    return {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
            "SPARK_LOCAL_IP": "127.0.0.1"}


def local_session(master: str = "local[2]", app: str = "sparkbus", conf: Mapping[str, Any] | None = None,
                  log_level: str = "ERROR") -> Any:
    """The SparkSession of a local run, with :data:`LOCAL_CONF` and 4 shuffle partitions (few cores).

    Sets :func:`local_env` in ``os.environ`` first (the executors inherit it). Settings of the JVM itself
    (``spark.driver.memory``) only apply if no session has been started in this process yet.

    Args:
        master: e.g. ``local[2]``, or ``local[2,4]`` to retry a failed task as a cluster would.
        app: the application name.
        conf: more settings; they win over the defaults.
        log_level: Spark's log level.

    Returns:
        The ``pyspark.sql.SparkSession``; the caller stops it.
    """
    os.environ.update(local_env())
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:
        raise ImportError(f"a local Spark run needs pyspark ({exc}): pip install 'sparkbus[spark]'") from exc

    builder = SparkSession.builder.master(master).appName(app)
    for key, value in {**LOCAL_CONF, "spark.sql.shuffle.partitions": "4", **(conf or {})}.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    return session


def submit_command(script: Path | str, *args: str, master: str = "local[2]", driver_memory: str | None = None,
                   conf: Mapping[str, Any] | None = None) -> list[str]:
    """The argv of ``spark-submit`` running ``script args`` with :data:`LOCAL_CONF` (and ``conf`` over it)."""
    settings = {**LOCAL_CONF, **(conf or {})}
    return [str(SPARK_SUBMIT), "--master", master,
            *(["--driver-memory", driver_memory] if driver_memory else []),
            *[arg for key, value in settings.items() for arg in ("--conf", f"{key}={value}")],
            str(script), *args]
