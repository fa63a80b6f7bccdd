"""Policy hit-rate table: every policy over host capacities, relative to the best, plus the
infinite ceiling and the "second" store policy.

GPU capacity is fixed; host capacities are fractions of the trace's *distinct prefix tokens*
(the tokens an infinite cache would end up holding: every distinct document prefix once).
Served FCFS one request at a time (hit rates then do not depend on arrival times).

Each cell is the document hit rate / document-token hit rate, then (in brackets) the document
hit rate relative to the best of the fixed policies (pgdsf, gdsf, lru, lfu, arc) in that row.
The last column is the default policy (pgdsf) with `store_policy="second"` (a document is
stored on its second sight, as vLLM's `store_threshold=2`), relative to the same best. The
verdict line says whether the default comes within 1% of the best in every row.

    .venv/bin/python scripts/policy_hit_rates.py /tmp/ragcache-traces/*.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ragcache_core.sim import SimConfig, SimResult, simulate
from ragcache_core.trace import TraceRequest, load_trace

FRACTIONS = (0.025, 0.05, 0.1, 0.2, 0.4)
FIXED = ("pgdsf", "gdsf", "lru", "lfu", "arc")
DEFAULT = "pgdsf"
WITHIN = 0.99
"""The default must reach this share of the best fixed policy's document hit rate."""


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


def _run(
    requests: list[TraceRequest],
    gpu: int,
    host: int,
    policy: str,
    system_tokens: int,
    store_policy: str = "always",
) -> SimResult:
    config = SimConfig(
        gpu_tokens=gpu,
        host_tokens=host,
        policy=policy,
        system_tokens=system_tokens,
        store_policy=store_policy,
    )
    return simulate(requests, config)


def _cell(result: SimResult, best: float) -> str:
    relative = result.doc_hit_rate / best if best else 1.0
    return f"{result.doc_hit_rate:.3f} / {result.token_hit_rate:.3f} ({relative:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--gpu-fraction", type=float, default=0.01)
    args = parser.parse_args()
    worst: list[tuple[float, str]] = []
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
        print("| host tokens (share) | " + " | ".join(FIXED) + f" | {DEFAULT} + second |")
        print("|---|" + "---|" * (len(FIXED) + 1))
        for fraction in FRACTIONS:
            host = int(distinct * fraction)

            results = {p: _run(requests, gpu, host, p, args.system_tokens) for p in FIXED}
            second = _run(requests, gpu, host, DEFAULT, args.system_tokens, "second")
            best = max(r.doc_hit_rate for r in results.values())
            cells = [_cell(results[p], best) for p in FIXED] + [_cell(second, best)]
            print(f"| {host} ({fraction:.1%}) | " + " | ".join(cells) + " |")
            share = results[DEFAULT].doc_hit_rate / best if best else 1.0
            worst.append((share, f"{path.stem} at {fraction:.1%}"))
            sys.stdout.flush()
    share, where = min(worst)
    verdict = "within" if share >= WITHIN else "NOT within"
    print(
        f"\n{DEFAULT} is {verdict} {1 - WITHIN:.0%} of the best fixed policy in every cell: "
        f"its lowest share is {share:.3f} ({where}); "
        f"cells below {WITHIN}: {sum(1 for s, _ in worst if s < WITHIN)} of {len(worst)}"
    )


if __name__ == "__main__":
    main()
