#!/usr/bin/env bash
# Install (first time) and run the local stack in the foreground; Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/xinfra up "$@"
