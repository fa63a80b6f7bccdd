"""Policy hit-rate table: every policy over host capacities, relative to the best, plus the
infinite ceiling and the "second" store policy.

On the engine's tier model (`sim.engine.EngineSimulator`): vLLM's prefix-cached blocks under
LRU (`--vllm-blocks`, else the GPU share below in 32-token blocks) and the host tier, written
at eviction or as documents are computed (`--host-write`); the policy decides host admission
and eviction. (Until issue 57 `--two-pool` ran the paper's two pools; that model is gone.)

GPU capacity is fixed; host capacities are fractions of the trace's *distinct prefix tokens*
(the tokens an infinite cache would end up holding: every distinct document prefix once).
Served FCFS one request at a time (hit rates then do not depend on arrival times).

Each cell is the document hit rate / document-token hit rate, then (in brackets) the document
hit rate relative to the best of the fixed policies (pgdsf, gdsf, lru, lfu, arc) in that row.
Then the default policy (`DEFAULT_POLICY`, dgdsf), the default with `store_policy="second"`
(a document is stored on its second sight, as vLLM's `store_threshold=2`) and adaptive PGDSF
(`apgdsf`: no longer a policy of the package, `adaptive_pgdsf.py` here registers it), each
relative to the same best. The verdict lines say whether the default comes
within 1% of the best in every row, and how close apgdsf comes on the traces its STEP was
tuned on (`--tuned`, by file stem: `scripts/tune_adaptive_pgdsf.py`) and on the others, apart.

    .venv/bin/python scripts/policy_hit_rates.py /tmp/ragcache-traces/*.jsonl
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import adaptive_pgdsf

from ragcache_core.policy import DEFAULT_POLICY
from ragcache_core.sim import EngineConfig, EngineRequest, EngineSimulator
from ragcache_core.trace import TraceRequest, load_trace

FRACTIONS = (0.025, 0.05, 0.1, 0.2, 0.4)
FIXED = ("pgdsf", "gdsf", "lru", "lfu", "arc")
DEFAULT = DEFAULT_POLICY
ADAPTIVE = "apgdsf"
BLOCK_SIZE = 32
WITHIN = 0.99
"""The default must reach this share of the best fixed policy's document hit rate."""


def infinite_ceiling(requests: list[TraceRequest]) -> _Cell:
    """Document and document-token hit rates with unbounded memory: a document hits when an
    earlier request had the same documents before it (its KV is its prefix's)."""
    seen: set[tuple[str, ...]] = set()
    docs = hits = tokens = hit_tokens = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        for depth in range(1, len(r.docs) + 1):
            prefix = r.docs[:depth]
            docs, tokens = docs + 1, tokens + r.doc_tokens[depth - 1]
            if prefix in seen:
                hits, hit_tokens = hits + 1, hit_tokens + r.doc_tokens[depth - 1]
            seen.add(prefix)
    return _Cell(hits / docs if docs else 0.0, hit_tokens / tokens if tokens else 0.0)


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


class _Cell:
    """One cell's rates: document hit rate and document-token hit rate."""

    def __init__(self, doc_hit_rate: float, token_hit_rate: float) -> None:
        self.doc_hit_rate = doc_hit_rate
        self.token_hit_rate = token_hit_rate


def grid(
    traces: Sequence[Path], gpu_fraction: float, fractions: Sequence[float] = FRACTIONS
) -> Iterator[tuple[Path, list[TraceRequest], int, float, int]]:
    """Every cell of the table: (trace, its requests, GPU tokens, host share, host tokens),
    both capacities as shares of the trace's distinct prefix tokens."""
    for path in traces:
        requests = load_trace(path)
        distinct = distinct_prefix_tokens(requests)
        for fraction in fractions:
            yield path, requests, int(distinct * gpu_fraction), fraction, int(distinct * fraction)


def print_shares(
    path: Path, fraction: float, shares: dict[str, float], worst: dict[str, tuple[float, str]]
) -> None:
    """One table row of `shares` (each policy's rate over the best fixed one in the cell), and
    each policy's lowest share so far kept in `worst` (share, where)."""
    cells = " | ".join(f"{share:.3f}" for share in shares.values())
    print(f"| {path.stem} | {fraction:.1%} | {cells} |", flush=True)
    where = f"{path.stem} at {fraction:.1%}"
    for name, share in shares.items():
        worst[name] = min(worst.get(name, (float("inf"), "")), (share, where))


def engine_blocks(requests: list[TraceRequest], gpu: int, system_tokens: int) -> int:
    """vLLM's blocks for `gpu` tokens (its null block added), at least a long prompt's."""
    longest = max(system_tokens + sum(r.doc_tokens) + r.question_tokens for r in requests)
    return max(gpu // BLOCK_SIZE, -(-longest // BLOCK_SIZE) + 2) + 1


def simulate_cell(
    requests: list[TraceRequest],
    gpu: int,
    host: int,
    policy: str,
    system_tokens: int,
    store_policy: str = "always",
    *,
    vllm_blocks: int | None = None,
    host_write: str = "compute",
) -> _Cell:
    """One cell: `gpu` tokens of GPU (or `vllm_blocks`), `host` tokens of host tier."""
    engine = EngineConfig(
        vllm_blocks=vllm_blocks or engine_blocks(requests, gpu, system_tokens),
        host_tokens=host,
        block_size=BLOCK_SIZE,
        policy=policy,
        store_policy=store_policy,
        host_write=host_write,
    )
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    served = EngineSimulator(engine).run(
        [EngineRequest.from_trace(r, system_tokens) for r in ordered]
    )
    return _Cell(served.doc_hit_rate, served.doc_token_hit_rate)


def _cell(result: _Cell, best: float) -> str:
    relative = result.doc_hit_rate / best if best else 1.0
    return f"{result.doc_hit_rate:.3f} / {result.token_hit_rate:.3f} ({relative:.3f})"


def cell_arguments() -> argparse.ArgumentParser:
    """The arguments every policy script's grid takes: traces, the system prompt's tokens, the
    GPU share and the host write mode (adaptive_variants.py, lfu_variants.py, shadow_follow.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--gpu-fraction", type=float, default=0.01)
    parser.add_argument("--host-write", choices=("eviction", "compute"), default="compute")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    adaptive_pgdsf.register()
    parser = cell_arguments()
    parser.add_argument(
        "--tuned", default="nq_top2,mmlu_top2", help="traces apgdsf was tuned on (file stems)"
    )
    parser.add_argument("--vllm-blocks", type=int, help="vLLM's blocks (default: GPU share)")
    parser.add_argument(
        "--fractions", default=",".join(map(str, FRACTIONS)), help="host shares, comma-separated"
    )
    args = parser.parse_args(argv)
    fractions = tuple(float(f) for f in args.fractions.split(","))
    cell = partial(simulate_cell, vllm_blocks=args.vllm_blocks, host_write=args.host_write)
    print(f"tier model: engine (host_write={args.host_write})")
    tuned = set(args.tuned.split(","))
    worst: list[tuple[float, str]] = []
    adaptive: dict[bool, list[tuple[float, str]]] = {True: [], False: []}
    for path in args.traces:
        requests = load_trace(path)
        distinct = distinct_prefix_tokens(requests)
        gpu = int(distinct * args.gpu_fraction)
        ceiling = infinite_ceiling(requests)
        print(
            f"\n{path.stem}: {len(requests)} requests, distinct prefix tokens {distinct}, "
            f"GPU {gpu} tokens; infinite ceiling doc hit {ceiling.doc_hit_rate:.3f}, "
            f"token hit {ceiling.token_hit_rate:.3f}"
        )
        role = "tuned" if path.stem in tuned else "held out"
        shown = [*FIXED, *([] if DEFAULT in FIXED else [DEFAULT])]
        heads = [*shown, f"{DEFAULT} + second", f"{ADAPTIVE} ({role})"]
        print("| host tokens (share) | " + " | ".join(heads) + " |")
        print("|---|" + "---|" * len(heads))
        for fraction in fractions:
            host = int(distinct * fraction)
            results = {p: cell(requests, gpu, host, p, args.system_tokens) for p in shown}
            second = cell(requests, gpu, host, DEFAULT, args.system_tokens, "second")
            adapted = cell(requests, gpu, host, ADAPTIVE, args.system_tokens)
            best = max(results[p].doc_hit_rate for p in FIXED)
            cells = [_cell(results[p], best) for p in shown]
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
