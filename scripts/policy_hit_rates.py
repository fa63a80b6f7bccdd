"""Policy hit-rate table: every policy over host capacities, relative to the best, plus the
infinite ceiling and the "second" store policy.

GPU capacity is fixed; host capacities are fractions of the trace's *distinct prefix tokens*
(the tokens an infinite cache would end up holding: every distinct document prefix once).
Served FCFS one request at a time (hit rates then do not depend on arrival times).

Each cell is the document hit rate / document-token hit rate, then (in brackets) the document
hit rate relative to the best of the fixed policies (pgdsf, gdsf, lru, lfu, arc) in that row.
Then the default policy (pgdsf) with `store_policy="second"` (a document is stored on its
second sight, as vLLM's `store_threshold=2`) and adaptive PGDSF (`apgdsf`), each relative to
the same best. The verdict lines say whether the default comes within 1% of the best in every
row, and how close apgdsf comes on the traces its STEP was tuned on (`--tuned`, by file stem:
`scripts/tune_adaptive_pgdsf.py`) and on the others, apart.

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
ADAPTIVE = "apgdsf"
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


def simulate_cell(
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
    parser.add_argument(
        "--tuned", default="nq_top2,mmlu_top2", help="traces apgdsf was tuned on (file stems)"
    )
    args = parser.parse_args()
    tuned = set(args.tuned.split(","))
    worst: list[tuple[float, str]] = []
    adaptive: dict[bool, list[tuple[float, str]]] = {True: [], False: []}
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
        role = "tuned" if path.stem in tuned else "held out"
        heads = [*FIXED, f"{DEFAULT} + second", f"{ADAPTIVE} ({role})"]
        print("| host tokens (share) | " + " | ".join(heads) + " |")
        print("|---|" + "---|" * (len(FIXED) + 2))
        for fraction in FRACTIONS:
            host = int(distinct * fraction)
            results = {p: simulate_cell(requests, gpu, host, p, args.system_tokens) for p in FIXED}
            second = simulate_cell(requests, gpu, host, DEFAULT, args.system_tokens, "second")
            adapted = simulate_cell(requests, gpu, host, ADAPTIVE, args.system_tokens)
            best = max(r.doc_hit_rate for r in results.values())
            cells = [_cell(results[p], best) for p in FIXED]
            cells += [_cell(second, best), _cell(adapted, best)]
            where = f"{path.stem} at {fraction:.1%}"
            adaptive[path.stem in tuned].append(
                (adapted.doc_hit_rate / best if best else 1.0, where)
            )
            print(f"| {host} ({fraction:.1%}) | " + " | ".join(cells) + " |")
            share = results[DEFAULT].doc_hit_rate / best if best else 1.0
            worst.append((share, where))
            sys.stdout.flush()
    share, where = min(worst)
    verdict = "within" if share >= WITHIN else "NOT within"
    print(
        f"\n{DEFAULT} is {verdict} {1 - WITHIN:.0%} of the best fixed policy in every cell: "
        f"its lowest share is {share:.3f} ({where}); "
        f"cells below {WITHIN}: {sum(1 for s, _ in worst if s < WITHIN)} of {len(worst)}"
    )
    for is_tuned, shares in adaptive.items():
        if shares:
            low, where = min(shares)
            mean = sum(s for s, _ in shares) / len(shares)
            print(
                f"{ADAPTIVE} on {'tuning' if is_tuned else 'held-out'} traces: lowest share "
                f"{low:.3f} ({where}), mean {mean:.3f}, cells below {WITHIN}: "
                f"{sum(1 for s, _ in shares if s < WITHIN)} of {len(shares)}"
            )


if __name__ == "__main__":
    main()
