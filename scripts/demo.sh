#!/usr/bin/env bash
# The main job: set up (if needed), then run `ragcache demo` (arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ragcache demo "$@"
