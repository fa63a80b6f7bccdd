"""Document order (issue 40) in the simulator: token and document hit rates of each order.

For each trace, the host tier is sized at a fraction of the trace's distinct document tokens
(the sum over distinct document ids of their token counts), the GPU tier is 0 (the host tier
is the cache), the policy PGDSF, store policy "always", FCFS, batch size 1: the same run as

    ragcache simulate --trace T --gpu-tokens 0 --host-tokens H --document-order O --json

for every order O. Prints one markdown table row per (trace, fraction).

    .venv/bin/python scripts/build_sim_traces.py --out /tmp/ragcache-traces
    .venv/bin/python scripts/document_order_sim.py --traces /tmp/ragcache-traces
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ragcache_core.sim import SimConfig, simulate
from ragcache_core.sim.simulator import SIM_DOCUMENT_ORDERS
from ragcache_core.trace import TraceRequest, load_trace


def distinct_doc_tokens(requests: list[TraceRequest]) -> int:
    sizes: dict[str, int] = {}
    for request in requests:
        sizes.update(zip(request.docs, request.doc_tokens, strict=True))
    return sum(sizes.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument(
        "--names", nargs="+", default=["nq_top2", "nq_top3", "mmlu_top2", "mmlu_top3"]
    )
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--orders", nargs="+", default=list(SIM_DOCUMENT_ORDERS))
    args = parser.parse_args()
    head = " | ".join(f"{o} tok/doc" for o in args.orders)
    print(f"| trace | host % | host tokens | {head} | cache/retrieval tok |")
    print("|---|---|---|" + "---|" * len(args.orders) + "---|")
    for name in args.names:
        requests = load_trace(args.traces / f"{name}.jsonl")
        distinct = distinct_doc_tokens(requests)
        for fraction in args.fractions:
            host = int(fraction * distinct)
            rates = {}
            for order in args.orders:
                config = SimConfig(gpu_tokens=0, host_tokens=host, document_order=order)
                result = simulate(requests, config)
                rates[order] = (result.token_hit_rate, result.doc_hit_rate)
            cells = " | ".join(f"{t:.3f}/{d:.3f}" for t, d in rates.values())
            gain = ""
            if "cache" in rates and "retrieval" in rates and rates["retrieval"][0]:
                gain = f"{rates['cache'][0] / rates['retrieval'][0]:.2f}x"
            print(f"| {name} | {fraction:.0%} | {host} | {cells} | {gain} |", flush=True)


if __name__ == "__main__":
    main()
