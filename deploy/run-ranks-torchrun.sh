#!/usr/bin/env bash
# Usage: [SPARKBUS_BROKER=host] [NPROC=2] [NNODES=1 NODE_RANK=0 MASTER_ADDR=host MASTER_PORT=29500] \
#        deploy/run-ranks-torchrun.sh [train_ddp.py flags...]
# torchrun of examples/train_ddp.py (or of SCRIPT): NPROC ranks per node (default 2) train with torch
# DistributedDataParallel (gloo on CPU; the script's choice) on the batches of the broker at
# tcp://${SPARKBUS_BROKER:-127.0.0.1}:${SPARKBUS_RANKS_PORT:-5556}. No MPI: each rank reads
# BatchStream(address, rank="auto"), rank and size from torch.distributed, and the broker grants every rank the same
# number of steps. On several nodes run it once per node with the same NNODES, MASTER_ADDR (node 0's address) and
# MASTER_PORT, and NODE_RANK 0 .. NNODES - 1. Extra flags go to the script (--epochs must match the feed's;
# --out DIR for every rank's figures). Feed with: python examples/train_ddp.py --feed tcp://BROKER:5555 ...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${VIRTUAL_ENV:-}" ] && [ -d "$here/../.venv/bin" ]; then PATH="$here/../.venv/bin:$PATH"; fi
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC:-2}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
    "${SCRIPT:-$here/../examples/train_ddp.py}" \
    --ranks "tcp://${SPARKBUS_BROKER:-127.0.0.1}:${SPARKBUS_RANKS_PORT:-5556}" "$@"
