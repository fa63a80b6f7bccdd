"""Tune adaptive PGDSF's STEP on some traces; judge it on the others (docs/benchmarks.md,
"Policy hit rates").

For each STEP of the grid, on the tuning traces only, every cell of `policy_hit_rates.py`
(GPU 1%, host 2.5-40% of the distinct prefix tokens): apgdsf's document hit rate relative to
the best fixed policy of that cell. The STEP with the highest lowest share wins (ties: the
highest mean). The held-out traces are not read here; `policy_hit_rates.py` reports apgdsf
(with the STEP the code ships) on every trace. The tier model is `policy_hit_rates.py`'s: the
engine's (`--host-write`, `--vllm-blocks`).

    .venv/bin/python scripts/tune_adaptive_pgdsf.py /tmp/ragcache-traces/{nq_top2,mmlu_top2}.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from adaptive_pgdsf import AdaptivePGDSF
from policy_hit_rates import FIXED, grid, simulate_cell

from ragcache_core.policy import POLICIES

STEPS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", type=Path, nargs="+", help="the tuning traces only")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--gpu-fraction", type=float, default=0.01)
    parser.add_argument("--vllm-blocks", type=int, help="vLLM's blocks (default: GPU share)")
    parser.add_argument("--host-write", choices=("eviction", "compute"), default="compute")
    args = parser.parse_args()
    cell = partial(simulate_cell, vllm_blocks=args.vllm_blocks, host_write=args.host_write)
    cells = []
    for _, requests, gpu, _, host in grid(args.traces, args.gpu_fraction):
        best = max(cell(requests, gpu, host, p, args.system_tokens).doc_hit_rate for p in FIXED)
        cells.append((requests, gpu, host, best))
    scores = []
    for step in STEPS:
        variant = type("Tuned", (AdaptivePGDSF,), {"STEP": step})
        POLICIES["apgdsf-tuning"] = variant
        shares = [
            cell(r, g, h, "apgdsf-tuning", args.system_tokens).doc_hit_rate / best
            for r, g, h, best in cells
        ]
        scores.append((min(shares), statistics.fmean(shares), step))
        print(f"STEP {step}: lowest share {min(shares):.3f}, mean {statistics.fmean(shares):.3f}")
        sys.stdout.flush()
    low, mean, step = max(scores)
    shipped = AdaptivePGDSF.STEP
    print(f"best STEP {step} (lowest share {low:.3f}, mean {mean:.3f}); shipped {shipped}")


if __name__ == "__main__":
    main()
