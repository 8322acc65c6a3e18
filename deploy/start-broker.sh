#!/usr/bin/env bash
# Usage: deploy/start-broker.sh [sparkbus broker flags...]     e.g. --max-buffer 4GiB
# Runs the sparkbus broker in the foreground on every interface: feed on ${SPARKBUS_FEED_PORT:-5555}, ranks on
# ${SPARKBUS_RANKS_PORT:-5556}, control on the feed port + 2. Stop it with Ctrl-C or SIGTERM.
# Every interface means other hosts: give the broker its keys (--auth DIR, or SPARKBUS_AUTH=DIR; see
# docs/OPERATIONS.md), or say --insecure (SPARKBUS_INSECURE=1) on a network where nobody else can reach it.
set -euo pipefail
venv="$(dirname "$0")/../.venv/bin"      # the checkout's venv, unless one is active
if [ -z "${VIRTUAL_ENV:-}" ] && [ -d "$venv" ]; then PATH="$venv:$PATH"; fi
exec sparkbus broker --feed "tcp://0.0.0.0:${SPARKBUS_FEED_PORT:-5555}" \
    --ranks "tcp://0.0.0.0:${SPARKBUS_RANKS_PORT:-5556}" "$@"
