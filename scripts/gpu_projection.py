"""The paper's GPU, projected: RAGCache, vLLM without prefix caching and a GPU-only LRU prefix
cache (SGLang's) on the simulator with the paper's A10G profile (`--profile paper-a10g`).

Each system is one `ragcache simulate` run on the same trace, at each request rate (the trace's
arrival times, built at 1 request/s by `scripts/build_sim_traces.py`, divided by the rate:
the same as building it with `--rate R`, whose Poisson gaps scale exactly so):

  ragcache   vLLM's blocks (the KV 24 GB leaves a 7B model: 15,360 tokens, blocks of 16)
             with prefix caching, a 192 GiB host tier (393,216 tokens) written at eviction,
             DGDSF, cache-aware reordering (window 8, the runtime's default)
  vllm       the same vLLM blocks without prefix caching, FCFS
  sglang     the same blocks with prefix caching (an LRU of the GPU's KV), no host tier, FCFS

It prints one markdown row per trace and rate: mean TTFT of each system and the ratios, beside
the prompt-token hit rates, and what RAGCache's host tier saves and costs a request: the
prefill it saves against SGLang's, its loads and the copies on its prefill's critical path
(documents copied as vLLM hands their blocks out).

    .venv/bin/python scripts/build_sim_traces.py --out /tmp/ragcache-traces
    .venv/bin/python scripts/gpu_projection.py /tmp/ragcache-traces/{nq_top2,mmlu_top2}.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ragcache_core.cost import InterpolatedCostModel
from ragcache_core.cost.paper import paper_a10g
from ragcache_core.sim import EngineConfig, SimConfig, SimResult, simulate
from ragcache_core.trace import TraceRequest, load_trace

GIB = 1 << 30
KV_TOKENS = 15_360
"""vLLM's KV on the A10G: 90% of 24 GiB less 12.6 GiB of weights and ~1.5 GiB of activations
(7.5 GiB) at LLaMA2-7B's 512 KiB a token (`cost/paper.py`)."""
HOST_TOKENS = 192 * GIB // (512 * 1024)
BLOCK_SIZE = 16
"""vLLM's default block size on CUDA."""
BATCHED_TOKENS = 8192
"""vLLM's `max_num_batched_tokens` on CUDA (its chunked-prefill step)."""
SYSTEM_TOKENS = 64

BASE = EngineConfig(
    vllm_blocks=KV_TOKENS // BLOCK_SIZE + 1,
    host_tokens=0,
    block_size=BLOCK_SIZE,
    page_size=16,
    max_num_batched_tokens=BATCHED_TOKENS,
)
SYSTEMS: dict[str, SimConfig] = {
    "ragcache": SimConfig(
        dataclasses.replace(BASE, host_tokens=HOST_TOKENS, host_write="eviction"),
        system_tokens=SYSTEM_TOKENS,
        reorder=True,
        window=8,
    ),
    "vllm": SimConfig(dataclasses.replace(BASE, prefix_caching=False), system_tokens=SYSTEM_TOKENS),
    "sglang": SimConfig(BASE, system_tokens=SYSTEM_TOKENS),
}
"""The systems, as `ragcache simulate --profile paper-a10g --vllm-blocks 961 --block-size 16
--max-num-batched-tokens 8192 --system-tokens 64` plus: `--host-tokens 393216 --reorder --window
8` (ragcache), `--no-prefix-caching` (vllm), nothing more (sglang)."""


def at_rate(requests: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """A trace built at 1 request/s, as if built at `rate`."""
    return [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", type=Path, nargs="+", help="traces built at 1 request/s")
    parser.add_argument(
        "--load",
        type=float,
        nargs="+",
        default=[0.25, 0.5, 0.75, 0.9],
        help="request rates as shares of vLLM's capacity (1 / its mean prefill)",
    )
    args = parser.parse_args()
    profile = paper_a10g()
    cost, copies = InterpolatedCostModel(profile), profile.copy_cost
    print(
        "| trace | rate (req/s) | vLLM load | TTFT ms: ragcache / vllm / sglang | "
        "vllm / ragcache | sglang / ragcache | token hits: ragcache / sglang | "
        "ragcache ms a request: prefill saved / loads / copies |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for path in args.traces:
        requests = load_trace(path)
        idle = simulate(at_rate(requests, 1e-3), SYSTEMS["vllm"], cost, copies)
        capacity = idle.requests / idle.estimated_prefill_s
        for load in args.load:
            rate = round(load * capacity, 2)
            timed = at_rate(requests, rate)
            results: dict[str, SimResult] = {
                name: simulate(timed, config, cost, copies) for name, config in SYSTEMS.items()
            }
            ms = {name: 1000 * r.ttft_mean_s for name, r in results.items()}
            ours, sglang, n = results["ragcache"], results["sglang"], len(requests)
            print(
                f"| {path.stem} | {rate:g} | {load:.0%} | "
                f"{ms['ragcache']:.0f} / {ms['vllm']:.0f} / {ms['sglang']:.0f} | "
                f"{ms['vllm'] / ms['ragcache']:.2f} | {ms['sglang'] / ms['ragcache']:.2f} | "
                f"{results['ragcache'].prompt_token_hit_rate:.1%} / "
                f"{results['sglang'].prompt_token_hit_rate:.1%} | "
                f"{1000 * (sglang.estimated_prefill_s - ours.estimated_prefill_s) / n:.1f} / "
                f"{1000 * ours.load_s / n:.1f} / "
                f"{1000 * ours.copy_s / n:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
