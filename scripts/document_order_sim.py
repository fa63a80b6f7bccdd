"""Document order (issue 40) in the simulator: token and document hit rates of each order.

For each trace, the host tier is sized at a fraction of the trace's distinct document tokens
(the sum over distinct document ids of their token counts), in one-token slots written as
documents are computed, and is the only cache (vLLM without prefix caching); the policy PGDSF
(pinned: docs/benchmarks.md's figures were measured with it, before DGDSF became the default),
store policy "always", FCFS, one request at a time: the same run as

    ragcache simulate --trace T --vllm-blocks 256 --no-prefix-caching --page-size 1 \
        --host-tokens H --document-order O --policy pgdsf --json

for every order O. Prints one markdown table row per (trace, fraction).

With `--tails`, it measures instead candidate rules for the part of "cache"'s order that does
not continue the cached path (today: retrieval order), each a function of the document set
and the tree state, so the cached walk and the current request's hits stay the same:

- "retrieval": what `tree.order.cache_order` does;
- "known": documents with a readable node anywhere in the tree first, then by retrieval rank;
- "accesses": by the total accesses of the document's readable nodes, most first (the node
  statistics the tree already holds), then by retrieval rank;
- "unknown_first": the opposite of "known" (a control: how much the tail's order matters);
- "first_seen": by when the run first met each document (a per-document table).

    .venv/bin/python scripts/build_sim_traces.py --out /tmp/ragcache-traces
    .venv/bin/python scripts/document_order_sim.py --traces /tmp/ragcache-traces
    .venv/bin/python scripts/document_order_sim.py --traces /tmp/ragcache-traces --tails
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ragcache_core.sim import EngineConfig, EngineRequest, SimConfig, SimResult, simulate
from ragcache_core.sim.simulator import SIM_DOCUMENT_ORDERS, Simulator
from ragcache_core.trace import TraceRequest, load_trace
from ragcache_core.tree import DocSpec

POLICY = "pgdsf"
"""The host tier's policy of every run here (the documented figures' policy)."""
TAIL_RULES = ("retrieval", "known", "accesses", "unknown_first", "first_seen")


def distinct_doc_tokens(requests: list[TraceRequest]) -> int:
    sizes: dict[str, int] = {}
    for request in requests:
        sizes.update(zip(request.docs, request.doc_tokens, strict=True))
    return sum(sizes.values())


class TailSimulator(Simulator):
    """ "cache" order with the part after the cached walk ordered by `tail` (`TAIL_RULES`)."""

    def __init__(self, config: SimConfig, tail: str) -> None:
        super().__init__(config)
        self.tail = tail
        self.seen: dict[str, int] = {}

    def served_docs(self, request: EngineRequest) -> tuple[DocSpec, ...]:
        specs = super().served_docs(request)
        for spec in specs:
            self.seen.setdefault(spec.key.doc_id, len(self.seen))
        if self.tail == "retrieval":
            return specs
        # The walk placed exactly the documents that hit (one root, no vLLM residency here).
        walked = len(self.engine.tree.match(specs).doc_hits)
        rank = {spec.key.doc_id: i for i, spec in enumerate(request.docs)}
        return specs[:walked] + tuple(sorted(specs[walked:], key=self.tail_key(rank)))

    def tail_key(self, rank: dict[str, int]) -> Callable[[DocSpec], tuple[int, int]]:
        accesses: Counter[str] = Counter()
        known: set[str] = set()
        for node in self.engine.tree.iter_nodes():
            doc_id = getattr(node.key, "doc_id", None)
            if doc_id in rank and node.cached:
                known.add(doc_id)
                accesses[doc_id] += node.stats.accesses
        rules: dict[str, Callable[[str], int]] = {
            "known": lambda d: d not in known,
            "accesses": lambda d: -accesses[d],
            "unknown_first": lambda d: d in known,
            "first_seen": lambda d: self.seen[d],
        }
        rule = rules[self.tail]
        return lambda spec: (rule(spec.key.doc_id), rank[spec.key.doc_id])


def host_alone(host: int) -> EngineConfig:
    """The host tier as the only cache: `host` one-token slots, vLLM without prefix caching
    (its 256 blocks of 32 tokens only run each request)."""
    return EngineConfig(
        vllm_blocks=256, host_tokens=host, page_size=1, policy=POLICY, prefix_caching=False
    )


def run_cell(requests: list[TraceRequest], host: int, order: str) -> SimResult:
    """One run: `order` is a document order, or "tail:RULE" ("cache" with that tail)."""
    if order.startswith("tail:"):
        config = SimConfig(host_alone(host), document_order="cache")
        return TailSimulator(config, order.removeprefix("tail:")).run(requests)
    return simulate(requests, SimConfig(host_alone(host), document_order=order))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument(
        "--names", nargs="+", default=["nq_top2", "nq_top3", "mmlu_top2", "mmlu_top3"]
    )
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.2, 0.4])
    parser.add_argument("--orders", nargs="+", default=list(SIM_DOCUMENT_ORDERS))
    parser.add_argument(
        "--tails", action="store_true", help="measure the tail rules instead (TAIL_RULES)"
    )
    args = parser.parse_args()
    orders = ["retrieval", *(f"tail:{t}" for t in TAIL_RULES)] if args.tails else args.orders
    # The orders whose token hit rate is also given over retrieval order's.
    compared = [o for o in orders if o.startswith("tail:") or o == "cache"]
    if "retrieval" not in orders:
        compared = []
    head = " | ".join(f"{o} tok/doc" for o in orders)
    gains = "".join(f" {o}/retrieval tok |" for o in compared)
    print(f"| trace | host % | host tokens | {head} |{gains}")
    print("|---|---|---|" + "---|" * (len(orders) + len(compared)))
    for name in args.names:
        requests = load_trace(args.traces / f"{name}.jsonl")
        distinct = distinct_doc_tokens(requests)
        for fraction in args.fractions:
            host = int(fraction * distinct)
            rates = {}
            for order in orders:
                result = run_cell(requests, host, order)
                rates[order] = (result.token_hit_rate, result.doc_hit_rate)
            cells = " | ".join(f"{t:.3f}/{d:.3f}" for t, d in rates.values())
            base = rates.get("retrieval", (0.0, 0.0))[0]
            gain = "".join(f" {rates[o][0] / base:.2f}x |" if base else " |" for o in compared)
            print(f"| {name} | {fraction:.0%} | {host} | {cells} |{gain}", flush=True)


if __name__ == "__main__":
    main()
