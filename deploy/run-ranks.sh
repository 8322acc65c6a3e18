#!/usr/bin/env bash
# Usage: [SPARKBUS_BROKER=host] [NP=8] [HOSTFILE=hosts] deploy/run-ranks.sh [train.py flags...]
# mpiexec of deploy/train.py: NP ranks (default 2; on the hosts of HOSTFILE if set) train on the batches of the
# broker at tcp://${SPARKBUS_BROKER:-127.0.0.1}:${SPARKBUS_RANKS_PORT:-5556}. Extra flags go to train.py
# (--epochs must match the feed job's; --summary out.json). With another MPI, use its mpirun and hostfile flag.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -d "$here/../.venv/bin" ]; then PATH="$here/../.venv/bin:$PATH"; fi
exec mpiexec -n "${NP:-2}" ${HOSTFILE:+-f "$HOSTFILE"} "${PYTHON:-python3}" "$here/train.py" \
    --ranks "tcp://${SPARKBUS_BROKER:-127.0.0.1}:${SPARKBUS_RANKS_PORT:-5556}" "$@"
