#!/usr/bin/env bash
# Usage: [SPARKBUS_BROKER=host] [SPARK_MASTER=spark://master:7077] deploy/submit-feed.sh [feed_job.py flags...]
# spark-submit of deploy/feed_job.py: generates the synthetic set and feeds it, epoch by epoch, to the broker at
# tcp://${SPARKBUS_BROKER:-127.0.0.1}:${SPARKBUS_FEED_PORT:-5555}. Extra flags go to feed_job.py (--rows, --epochs,
# --batch-size, --partitions ...); spark-submit options go in SPARK_SUBMIT_FLAGS (e.g. "--num-executors 8").
# The executors run ${PYSPARK_PYTHON:-this python3}: sparkbus must be installed in it on every node.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -d "$here/../.venv/bin" ]; then PATH="$here/../.venv/bin:$PATH"; fi
python="${PYSPARK_PYTHON:-$(command -v python3)}"
# shellcheck disable=SC2086  # SPARK_SUBMIT_FLAGS is a list of options
exec spark-submit --master "${SPARK_MASTER:-local[2]}" --driver-memory "${SPARK_DRIVER_MEMORY:-2g}" \
    --conf "spark.pyspark.python=$python" --conf "spark.pyspark.driver.python=$python" ${SPARK_SUBMIT_FLAGS:-} \
    "$here/feed_job.py" --feed "tcp://${SPARKBUS_BROKER:-127.0.0.1}:${SPARKBUS_FEED_PORT:-5555}" "$@"
