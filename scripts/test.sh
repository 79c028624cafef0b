#!/usr/bin/env bash
# Install (first time) and run every check: lint, types, and the whole test suite against real services.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYSPARK_PYTHON="$PWD/.venv/bin/python"
.venv/bin/ruff check .
.venv/bin/ruff format --check . >/dev/null || { .venv/bin/ruff format --diff . | head -50; exit 1; }
.venv/bin/mypy
exec .venv/bin/pytest -p no:cacheprovider "$@"
