#!/usr/bin/env bash
# Usage: SPARK_MASTER=spark://master:7077 SPARKBUS_BROKER=broker-host [EXECUTOR_PYTHON=/opt/sparkbus/bin/python] \
#            deploy/standalone/submit-feed.sh [feed_job.py flags...]                  e.g. --rows 10000000 --epochs 3
# The demo's feed job on a Spark standalone cluster: deploy/submit-feed.sh (a spark-submit of deploy/feed_job.py
# --feed tcp://$SPARKBUS_BROKER:${SPARKBUS_FEED_PORT:-5555}) with what a cluster needs on top:
#   - the broker's host named explicitly (127.0.0.1 would be each executor's own machine), and checked first:
#     the driver runs here (client mode; standalone runs Python drivers in no other mode) and talks to the
#     control port, so `sparkbus status` from here must answer within 5 s;
#   - the executors' Python: EXECUTOR_PYTHON (spark.pyspark.python), a Python with sparkbus installed, at that
#     path on every worker (default: $PYSPARK_PYTHON, else this checkout's venv, which then must be on a shared
#     filesystem); the driver keeps this host's Python (spark.pyspark.driver.python);
#   - one BLAS/OpenMP thread per Python worker (spark.executorEnv.*): a task is already one core.
# Executor sizing and other spark-submit options go in SPARK_SUBMIT_FLAGS, after ours (a later --conf wins), e.g.
#   SPARK_SUBMIT_FLAGS="--executor-memory 4g --total-executor-cores 16 --conf spark.executor.cores=4"
# Executors connect to the broker's feed port and feed + 2 (control); open both from the workers to it.
set -euo pipefail
top="$(cd "$(dirname "$0")/../.." && pwd)"      # the checkout
if [ -z "${VIRTUAL_ENV:-}" ] && [ -d "$top/.venv/bin" ]; then PATH="$top/.venv/bin:$PATH"; fi

die() { echo "submit-feed: $*" >&2; exit 1; }
case "${SPARK_MASTER:-}" in
    spark://*) ;;
    *) die "set SPARK_MASTER to the standalone master, e.g. spark://master:7077 (deploy/submit-feed.sh runs local ones)" ;;
esac
[ -n "${SPARKBUS_BROKER:-}" ] || die "set SPARKBUS_BROKER to the broker's host name, as the workers resolve it"
driver_python="$(command -v python3)"
executor_python="${EXECUTOR_PYTHON:-${PYSPARK_PYTHON:-$driver_python}}"

control="tcp://$SPARKBUS_BROKER:$((${SPARKBUS_FEED_PORT:-5555} + 2))"
sparkbus status "$control" --timeout 5s >/dev/null ||
    die "the broker did not answer on $control from here (see above): is it running, is the port open?"

export PYSPARK_PYTHON="$executor_python"
export SPARK_SUBMIT_FLAGS="--conf spark.pyspark.driver.python=$driver_python \
--conf spark.executorEnv.OPENBLAS_NUM_THREADS=1 --conf spark.executorEnv.OMP_NUM_THREADS=1 ${SPARK_SUBMIT_FLAGS:-}"
exec "$top/deploy/submit-feed.sh" "$@"
