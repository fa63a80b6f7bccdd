"""Policy hit-rate table: pgdsf/gdsf/lru/lfu over host capacities, plus the infinite ceiling.

GPU capacity is fixed; host capacities are fractions of the trace's *distinct prefix tokens*
(the tokens an infinite cache would end up holding: every distinct document prefix once).
Served FCFS one request at a time (hit rates then do not depend on arrival times).

    .venv/bin/python scripts/policy_hit_rates.py /tmp/ragcache-traces/*.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragcache_core.policy import POLICIES
from ragcache_core.sim import SimConfig, simulate
from ragcache_core.trace import TraceRequest, load_trace

FRACTIONS = (0.025, 0.05, 0.1, 0.2, 0.4)


def distinct_prefix_tokens(requests: list[TraceRequest]) -> int:
    seen: set[tuple[str, ...]] = set()
    total = 0
    for r in requests:
        for depth in range(1, len(r.docs) + 1):
            prefix = r.docs[:depth]
            if prefix not in seen:
                seen.add(prefix)
                total += r.doc_tokens[depth - 1]
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--gpu-fraction", type=float, default=0.01)
    args = parser.parse_args()
    policies = sorted(POLICIES, key=lambda p: ["pgdsf", "gdsf", "lru", "lfu"].index(p))
    for path in args.traces:
        requests = load_trace(path)
        distinct = distinct_prefix_tokens(requests)
        gpu = int(distinct * args.gpu_fraction)
        ceiling = simulate(
            requests, SimConfig(gpu_tokens=10**12, host_tokens=0, system_tokens=args.system_tokens)
        )
        print(
            f"\n{path.stem}: {len(requests)} requests, distinct prefix tokens {distinct}, "
            f"GPU {gpu} tokens; infinite ceiling doc hit {ceiling.doc_hit_rate:.3f}, "
            f"token hit {ceiling.token_hit_rate:.3f}"
        )
        print("| host tokens (share) | " + " | ".join(policies) + " |")
        print("|---|" + "---|" * len(policies))
        for fraction in FRACTIONS:
            host = int(distinct * fraction)
            cells = []
            for policy in policies:
                r = simulate(
                    requests,
                    SimConfig(
                        gpu_tokens=gpu,
                        host_tokens=host,
                        policy=policy,
                        system_tokens=args.system_tokens,
                    ),
                )
                cells.append(f"{r.doc_hit_rate:.3f} / {r.token_hit_rate:.3f}")
            print(f"| {host} ({fraction:.1%}) | " + " | ".join(cells) + " |")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
