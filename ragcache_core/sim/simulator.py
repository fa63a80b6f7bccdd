"""Trace-driven simulation of the control plane: hit rates, recomputation, queueing.

One engine serves prefill batches of at most `max_prefill_bs` requests. A batch's requests
all begin (match, plan, store) before any of them confirms, as in the real engine, so a
request cannot hit KV that a batch-mate is still computing. Batch time is the sum of the
requests' estimated prefill times T(cached, computed) from the cost model; every request of
a batch gets its first token when the batch ends (TTFT = wait + batch time). Decoding is not
modelled. Without reordering the queue is FCFS, so the same run gives the baseline.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ragcache_core.capacity import slots_in_tokens
from ragcache_core.cost import CostModel, default_cost_model
from ragcache_core.errors import ConfigError
from ragcache_core.plan import Tier
from ragcache_core.policy import DEFAULT_POLICY
from ragcache_core.runtime.reorder import make_queue
from ragcache_core.sim.two_pools import TwoPools
from ragcache_core.trace import TraceRequest
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RequestHandle, RootKey

SIM_DOCUMENT_ORDERS = ("retrieval", "cache", "sorted", "first_seen")
SIM_ROOT = RootKey(model="sim", tokenizer="sim", template="sim", kv_dtype="sim")


@dataclass(frozen=True, slots=True)
class SimConfig:
    gpu_tokens: int
    host_tokens: int
    policy: str = DEFAULT_POLICY
    system_tokens: int = 0
    max_depth: int | None = None
    reorder: bool = False
    max_prefill_bs: int = 1
    window: int = 16
    page_size: int = 1
    store_policy: str = "always"
    document_order: str = "retrieval"
    """"retrieval", "cache" (`KnowledgeTree.cache_order` when the request begins), or the two
    canonical orders measured against it (simulator only): "sorted" (by document id) and
    "first_seen" (by when the run first met each document, scored or served)."""

    def __post_init__(self) -> None:
        if self.document_order not in SIM_DOCUMENT_ORDERS:
            raise ConfigError(
                f"unknown document_order {self.document_order!r}; "
                f"choose one of {', '.join(SIM_DOCUMENT_ORDERS)}"
            )
        if self.max_prefill_bs < 1:
            raise ConfigError(f"max_prefill_bs must be >= 1, got {self.max_prefill_bs}")
        for name in ("gpu_tokens", "host_tokens", "system_tokens"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} cannot be negative")


@dataclass(frozen=True, slots=True)
class SimResult:
    """Totals of one `Simulator.run`; rates are over requested documents/tokens."""

    requests: int
    requested_docs: int
    cached_docs: int
    doc_hit_rate: float
    token_hit_rate: float
    gpu_doc_hit_rate: float
    host_doc_hit_rate: float
    recomputed_tokens: int
    estimated_prefill_s: float
    wait_mean_s: float
    wait_p95_s: float
    ttft_mean_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def p95(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


class Simulator:
    """Runs traces through one `KnowledgeTree` over the paper's two pools (`TwoPools`); the
    tree persists across `run` calls."""

    def __init__(self, config: SimConfig, cost_model: CostModel | None = None) -> None:
        self.config = config
        self.cost_model: CostModel = cost_model or default_cost_model()
        self.gpu_pool = TwoPools(slots_in_tokens(config.gpu_tokens, config.page_size))
        """The paper's GPU pool (sim/two_pools.py), above the tree's host tier."""
        self.tree = KnowledgeTree.from_tokens(
            SIM_ROOT,
            gpu_pool=self.gpu_pool,
            host_tokens=config.host_tokens,
            page_size=config.page_size,
            policy=config.policy,
            cost_model=self.cost_model,
            max_depth=config.max_depth,
            store_policy=config.store_policy,
        )
        self._first_seen: dict[str, int] = {}

    @staticmethod
    def specs(request: TraceRequest) -> list[DocSpec]:
        # The trace has no content hashes; the token count stands in (same id, same text).
        return [
            DocSpec(DocKey(doc, str(n)), n)
            for doc, n in zip(request.docs, request.doc_tokens, strict=True)
        ]

    def served_specs(self, request: TraceRequest) -> list[DocSpec]:
        """`request`'s documents in the order the prompt serves them (`document_order`)
        against the tree now."""
        specs = self.specs(request)
        order = self.config.document_order
        if order == "cache":
            ranks = self.tree.cache_order(specs)
            return [specs[rank] for rank in ranks]
        if order == "sorted":
            return sorted(specs, key=lambda spec: spec.key.doc_id)
        if order == "first_seen":
            seen = self._first_seen
            for spec in specs:
                seen.setdefault(spec.key.doc_id, len(seen))
            return sorted(specs, key=lambda spec: seen[spec.key.doc_id])
        return specs

    def score(self, request: TraceRequest) -> tuple[int, int]:
        """(cached tokens, tokens to compute) of `request` against the tree now, in the
        order it would be served now (the reordering queue scores with the same order)."""
        specs = self.served_specs(request)
        if self.config.max_depth is not None:
            specs = specs[: self.config.max_depth]
        cached = self.tree.cached_tokens(specs)
        total = self.config.system_tokens + sum(request.doc_tokens) + request.question_tokens
        return cached, total - cached

    def run(self, requests: list[TraceRequest]) -> SimResult:
        """Simulate `requests` (served in arrival order, or reordered). Time starts at 0."""
        cfg = self.config
        pending = sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep file order
        queue = make_queue(
            "cache_aware" if cfg.reorder else "fcfs", score=self.score, window=cfg.window
        )
        tally = Tally()
        now, next_index = 0.0, 0
        while next_index < len(pending) or len(queue):
            if not len(queue):
                now = max(now, pending[next_index].arrival_s)
            while next_index < len(pending) and pending[next_index].arrival_s <= now:
                queue.push(pending[next_index])
                next_index += 1
            batch = [queue.pop() for _ in range(min(cfg.max_prefill_bs, len(queue)))]
            batch_s = self.prefill_batch(batch, tally)
            for request in batch:
                tally.waits.append(now - request.arrival_s)
                tally.ttfts.append(now - request.arrival_s + batch_s)
            now += batch_s
        return tally.result(len(pending))

    def prefill_batch(self, batch: list[TraceRequest], tally: Tally) -> float:
        """One prefill batch: every request begins before any confirms (a request cannot hit
        a batch-mate's stores). Mutates the tree and adds the batch's hits to `tally`.
        Returns the batch time."""
        cfg = self.config
        handles = [
            self.tree.begin_request(cfg.system_tokens, self.served_specs(r), r.question_tokens)
            for r in batch
        ]
        batch_s = 0.0
        for request, handle in zip(batch, handles, strict=True):
            batch_s += self.cost_model.prefill_time(handle.cached_tokens, handle.computed_tokens)
            tally.add(request, handle)
        for handle in handles:
            self.tree.confirm(handle)
        tally.prefill_s += batch_s
        return batch_s


@dataclass(slots=True)
class Tally:
    """Running totals of one `Simulator.run` (or of one replica of a `ClusterSimulator`)."""

    requested: int = 0
    cached: int = 0
    gpu_docs: int = 0
    host_docs: int = 0
    requested_tokens: int = 0
    cached_doc_tokens: int = 0
    recomputed: int = 0
    prefill_s: float = 0.0
    waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def add(self, request: TraceRequest, handle: RequestHandle) -> None:
        hits = handle.hits
        self.requested += len(request.docs)
        self.requested_tokens += sum(request.doc_tokens)
        self.cached += len(hits.doc_hits)
        self.gpu_docs += hits.docs_on(Tier.GPU)
        self.host_docs += hits.docs_on(Tier.HOST)
        self.cached_doc_tokens += sum(h.num_tokens for h in hits.doc_hits)
        self.recomputed += handle.computed_tokens

    def result(self, requests: int) -> SimResult:
        return SimResult(
            requests=requests,
            requested_docs=self.requested,
            cached_docs=self.cached,
            doc_hit_rate=ratio(self.cached, self.requested),
            token_hit_rate=ratio(self.cached_doc_tokens, self.requested_tokens),
            gpu_doc_hit_rate=ratio(self.gpu_docs, self.requested),
            host_doc_hit_rate=ratio(self.host_docs, self.requested),
            recomputed_tokens=self.recomputed,
            estimated_prefill_s=self.prefill_s,
            wait_mean_s=ratio(sum(self.waits), len(self.waits)),
            wait_p95_s=p95(self.waits),
            ttft_mean_s=ratio(sum(self.ttfts), len(self.ttfts)),
        )


def simulate(
    requests: list[TraceRequest], config: SimConfig, cost_model: CostModel | None = None
) -> SimResult:
    """One fresh simulator, one run."""
    return Simulator(config, cost_model).run(requests)
