#!/usr/bin/env bash
# The test command: set up (if needed), then lint, format check, type check and every test,
# including the slow ones that start the real vLLM engine. Fails on the first failing step.
# With arguments, one pytest run with them (`bash scripts/test.sh tests/test_exact.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAGCACHE_HOME=${RAGCACHE_HOME:-$PWD/.ragcache}
export PYTHONUNBUFFERED=1
echo "== ruff check"; .venv/bin/ruff check .
echo "== ruff format --check"; .venv/bin/ruff format --check .
echo "== mypy ragcache_core"; .venv/bin/mypy
if (($#)); then
    echo "== pytest $*"; .venv/bin/python -m pytest "$@"
else
    # The suite, then the tests of the real model apart (`real_model`: an engine start and its
    # runs, a few minutes on 2 cores), so that each phase's time is its own.
    echo "== pytest (without the real model)"; .venv/bin/python -m pytest -m "not real_model"
    echo "== pytest (the real model)"; .venv/bin/python -m pytest -m real_model
fi
