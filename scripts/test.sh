#!/usr/bin/env bash
# The test command: set up (if needed), then lint, format check, type check and every test,
# including the slow ones that start the real vLLM engine. Fails on the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAGCACHE_HOME=${RAGCACHE_HOME:-$PWD/.ragcache}
export PYTHONUNBUFFERED=1
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy ragcache_core"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest "$@"
