"""The simulator (`ragcache simulate`): a request trace through one simulated engine, in time.

Requests arrive as the trace says and wait in the runtime's own admission queue
(`runtime/reorder.py`: FCFS, or cache-aware reordering with `reorder`, scored by the runtime's
`Lifecycle.score`); the engine (`sim/engine.py`: vLLM's blocks and the host tier) serves one at
a time, each in the document order the runtime would give it (`document_order`). A request's
TTFT is its wait plus its time to first token (host loads, the copies on its prefill steps'
critical path, the prefill T(cached, computed)); the copies of its decode steps keep the
engine busy after that. Decoding itself is not timed, and prefills are not batched (a
prefill-bound engine; the engine overlaps a few: docs/control-plane.md, "The simulator").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ragcache_core.cost import CopyCost, CostModel
from ragcache_core.errors import ConfigError
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.runtime.reorder import RequestQueue, make_queue
from ragcache_core.sim.engine import (
    EngineConfig,
    EngineRequest,
    EngineSimulator,
    Served,
    ratio,
)
from ragcache_core.trace import TraceRequest
from ragcache_core.tree import DocSpec

SIM_DOCUMENT_ORDERS = ("retrieval", "cache", "sorted", "first_seen")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One engine (`engine`) serving a trace: the root's tokens (`system_tokens`), the queue
    (`reorder`: cache-aware with a starvation `window` counted in overtakes; else FCFS) and
    the documents' order in each prompt (`document_order`)."""

    engine: EngineConfig
    system_tokens: int = 0
    reorder: bool = False
    window: int = 16
    document_order: str = "retrieval"
    """"retrieval", "cache" (`KnowledgeTree.cache_order` when the request opens, as
    `document_order="cache"` serves it), or the two canonical orders measured against it
    (simulator only): "sorted" (by document id) and "first_seen" (by when the run first met
    each document, scored or served)."""

    def __post_init__(self) -> None:
        if self.document_order not in SIM_DOCUMENT_ORDERS:
            raise ConfigError(
                f"unknown document_order {self.document_order!r}; "
                f"choose one of {', '.join(SIM_DOCUMENT_ORDERS)}"
            )
        if self.system_tokens < 0:
            raise ConfigError("system_tokens cannot be negative")
        if self.window < 0:
            raise ConfigError(f"reordering window cannot be negative, got {self.window}")


@dataclass(frozen=True, slots=True)
class SimResult:
    """Totals of one `Simulator.run`; rates are over requested documents/tokens (document
    tokens: `token_hit_rate`; prompt tokens, the root included: `prompt_token_hit_rate`).
    Seconds: `estimated_prefill_s` (T(cached, computed)), `load_s` (host loads), `copy_s`
    (copies on the prefills' critical path), `decode_copy_s` (copies in decode steps)."""

    requests: int
    requested_docs: int
    cached_docs: int
    doc_hit_rate: float
    token_hit_rate: float
    prompt_token_hit_rate: float
    gpu_doc_hit_rate: float
    host_doc_hit_rate: float
    recomputed_tokens: int
    loaded_tokens: int
    estimated_prefill_s: float
    load_s: float
    copy_s: float
    decode_copy_s: float
    wait_mean_s: float
    wait_p95_s: float
    ttft_mean_s: float
    ttft_p95_s: float
    host_slots_written: int
    vllm_block_evictions: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def p95(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass(slots=True)
class Tally:
    """Running totals of one `Simulator.run` (or of one replica of a `ClusterSimulator`)."""

    served: list[Served] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)

    def add(self, served: Served, wait_s: float) -> None:
        self.served.append(served)
        self.waits.append(wait_s)
        self.ttfts.append(wait_s + served.first_token_s)

    @property
    def requested(self) -> int:
        return sum(s.docs for s in self.served)

    @property
    def cached(self) -> int:
        return sum(s.gpu_docs + s.host_docs for s in self.served)

    @property
    def doc_tokens(self) -> int:
        return sum(s.doc_tokens for s in self.served)

    @property
    def cached_doc_tokens(self) -> int:
        return sum(s.cached_doc_tokens for s in self.served)

    def result(self, engine: EngineSimulator) -> SimResult:
        served = self.served
        counted = engine.result(served)
        return SimResult(
            requests=len(served),
            requested_docs=self.requested,
            cached_docs=self.cached,
            doc_hit_rate=counted.doc_hit_rate,
            token_hit_rate=counted.doc_token_hit_rate,
            prompt_token_hit_rate=counted.token_hit_rate,
            gpu_doc_hit_rate=counted.gpu_doc_hit_rate,
            host_doc_hit_rate=counted.host_doc_hit_rate,
            recomputed_tokens=sum(s.computed_tokens for s in served),
            loaded_tokens=sum(s.loaded_tokens for s in served),
            estimated_prefill_s=sum(s.prefill_s for s in served),
            load_s=sum(s.load_s for s in served),
            copy_s=sum(s.copy_s for s in served),
            decode_copy_s=sum(s.after_s for s in served),
            wait_mean_s=ratio(sum(self.waits), len(self.waits)),
            wait_p95_s=p95(self.waits),
            ttft_mean_s=ratio(sum(self.ttfts), len(self.ttfts)),
            ttft_p95_s=p95(self.ttfts),
            host_slots_written=counted.host_slots_written,
            vllm_block_evictions=counted.vllm_block_evictions,
        )


@dataclass(eq=False, slots=True)
class _Waiting:
    """A request in the queue, with its prompt in the order it would be served now."""

    trace: TraceRequest
    request: EngineRequest


class Simulator:
    """One simulated engine serving traces in time; its caches persist across `run` calls
    (time restarts at 0 each run). `cost_model`: T(cached, computed); `copies`: the copy
    bandwidth (both default to the built-in analytic profile's)."""

    def __init__(
        self,
        config: SimConfig,
        cost_model: CostModel | None = None,
        copies: CopyCost | None = None,
    ) -> None:
        from ragcache_core.cost import analytic_profile

        self.config = config
        default = analytic_profile()
        self.engine = EngineSimulator(
            config.engine, cost_model, copies if copies is not None else default.copy_cost
        )
        self.free_at = 0.0
        """When the engine finishes what it is serving (seconds since the run began)."""
        self._first_seen: dict[str, int] = {}

    def request(self, trace: TraceRequest) -> EngineRequest:
        return EngineRequest.from_trace(trace, self.config.system_tokens)

    def served_prompt(self, request: EngineRequest) -> BuiltPrompt:
        """`request`'s prompt with its documents in the order served (`served_docs`)."""
        return request.prompt(self.served_docs(request))

    def served_docs(self, request: EngineRequest) -> tuple[DocSpec, ...]:
        """`request`'s documents in the order served (`document_order`) against the tree
        now."""
        order = self.config.document_order
        specs = request.docs
        if order == "cache":  # as `Generator.reordering` orders it: by document id
            ranks = self.engine.tree.cache_order([spec.key.doc_id for spec in specs])
            specs = tuple(specs[rank] for rank in ranks)
        elif order == "sorted":
            specs = tuple(sorted(specs, key=lambda spec: spec.key.doc_id))
        elif order == "first_seen":
            seen = self._first_seen
            for spec in specs:
                seen.setdefault(spec.key.doc_id, len(seen))
            specs = tuple(sorted(specs, key=lambda spec: seen[spec.key.doc_id]))
        return specs

    def score(self, request: EngineRequest) -> tuple[int, int]:
        """(cached tokens, tokens to compute) of `request` against the tree now, in the order
        it would be served now: the runtime's own score (`Lifecycle.score`, or
        `Lifecycle.score_ordered` for the order that follows the cache)."""
        lifecycle = self.engine.lifecycle
        if self.config.document_order == "cache":
            return lifecycle.score_ordered(request.prompt())
        return lifecycle.score(self.served_prompt(request))

    def serve(self, request: EngineRequest) -> Served:
        """Serve one request now (in its served order)."""
        return self.engine.serve(request, self.served_prompt(request))

    def run(self, requests: list[TraceRequest]) -> SimResult:
        """Simulate `requests` (served in arrival order, or reordered). Time starts at 0."""
        cfg = self.config
        pending = sorted(requests, key=lambda r: r.arrival_s)  # stable: ties keep file order
        queue: RequestQueue[_Waiting] = make_queue(
            "cache_aware" if cfg.reorder else "fcfs",
            score=lambda waiting: self.score(waiting.request),
            window=cfg.window,
        )
        tally = Tally()
        now, next_index = 0.0, 0
        while next_index < len(pending) or len(queue):
            if not len(queue):
                now = max(now, pending[next_index].arrival_s)
            while next_index < len(pending) and pending[next_index].arrival_s <= now:
                trace = pending[next_index]
                queue.push(_Waiting(trace, self.request(trace)))
                next_index += 1
            waiting = queue.pop()
            served = self.serve(waiting.request)
            tally.add(served, now - waiting.trace.arrival_s)
            now += served.first_token_s + served.after_s
        self.free_at = now
        return tally.result(self.engine)


def simulate(
    requests: list[TraceRequest],
    config: SimConfig,
    cost_model: CostModel | None = None,
    copies: CopyCost | None = None,
) -> SimResult:
    """One fresh simulator, one run."""
    return Simulator(config, cost_model, copies).run(requests)
