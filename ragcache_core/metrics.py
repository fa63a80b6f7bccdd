"""Counters of one `RAGCache`, exposed through `stats()` and as Prometheus collectors.

Each `RAGCache` has its own `CollectorRegistry` (no global state); serve it with
`prometheus_client.start_http_server(port, registry=cache.metrics.registry)` or
`generate_latest(cache.metrics.registry)`. Every collector, what moves it and its `stats()`
twin are listed in docs/configuration.md ("Metrics"). The `record_*` methods are the only
writers: each moves a plain counter and its Prometheus collector together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragcache_core.query_result import CacheHits
from ragcache_core.tree.stats import TreeCounters

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class Counters:
    """Plain totals since start (or `clear()`)."""

    requests: int = 0
    requests_failed: int = 0
    retries: int = 0
    engine_restarts: int = 0
    docs_requested: int = 0
    docs_hit_gpu: int = 0
    docs_hit_host: int = 0
    doc_tokens_requested: int = 0
    doc_tokens_hit: int = 0
    tokens_saved: int = 0
    tokens_computed: int = 0
    speculation_started: int = 0
    speculation_aborted: int = 0
    speculation_used: int = 0
    speculation_gated: int = 0
    """Searches that could speculate but did not: recent searches were faster than
    `CacheConfig.speculation_min_search_s`."""
    search_hidden_s: float = 0.0
    speculation_aborted_s: float = 0.0
    """Time the aborted speculations were in flight (started to aborted): wasted work."""
    ttft_sum_s: float = 0.0
    prompt_moved_cuts: int = 0
    prompt_unplaced_docs: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        docs = max(1, self.docs_requested)
        data["doc_hit_rate"] = (self.docs_hit_gpu + self.docs_hit_host) / docs
        data["gpu_doc_hit_rate"] = self.docs_hit_gpu / docs
        data["host_doc_hit_rate"] = self.docs_hit_host / docs
        data["token_hit_rate"] = self.doc_tokens_hit / max(1, self.doc_tokens_requested)
        data["ttft_mean_s"] = self.ttft_sum_s / self.requests if self.requests else 0.0
        return data


class Metrics:
    """Counters plus the Prometheus view of them."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.registry = CollectorRegistry()
        r = self.registry
        self.hits = Counter(
            "ragcache_doc_hits", "Documents served from a pool", ["tier"], registry=r
        )
        self.misses = Counter("ragcache_doc_misses", "Documents computed", registry=r)
        self.tokens_saved = Counter(
            "ragcache_tokens_saved",
            "Prompt tokens not computed (vLLM's hit + host loads)",
            registry=r,
        )
        self.speculation = Counter(
            "ragcache_speculation", "Speculative generations", ["outcome"], registry=r
        )
        # Host victims: the engine's GPU tier is vLLM's blocks, which vLLM evicts itself.
        self.evictions = Counter(
            "ragcache_evictions", "Nodes evicted from the host tier", registry=r
        )
        self.ttft = Histogram(
            "ragcache_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "ragcache_queue_wait_seconds",
            "Wait in the reordering queue",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.failures = Counter("ragcache_request_failures", "Failed requests", registry=r)
        self.restarts = Counter("ragcache_engine_restarts", "Engine restarts", registry=r)
        self.roots = Gauge(
            "ragcache_roots", "Roots in the knowledge tree (templates x salts)", registry=r
        )
        self.moved_cuts = Counter(
            "ragcache_prompt_moved_cuts",
            "Prompt cuts moved left of a token that straddled them",
            registry=r,
        )
        self.unplaced_docs = Counter(
            "ragcache_prompt_unplaced_docs",
            "Documents not found in the rendered prompt (computed, not cached)",
            registry=r,
        )
        self._tree_seen = TreeCounters()

    def watch_roots(self, count: Callable[[], int]) -> None:
        """`ragcache_roots` reads `count()` at each scrape (the tree's root count)."""
        self.roots.set_function(count)

    def reset(self) -> None:
        """Zero the plain counters (`RAGCache.clear()`, which also clears the tree and with it
        its counters). Prometheus collectors are monotonic and keep their totals."""
        self.counters = Counters()
        self._tree_seen = TreeCounters()

    def record_request(
        self,
        hits: CacheHits,
        *,
        num_docs: int,
        doc_tokens: int,
        doc_hit_tokens: int,
        queue_wait_s: float,
        ttft_s: float,
    ) -> None:
        """One request answered."""
        c = self.counters
        c.requests += 1
        c.docs_requested += num_docs
        c.docs_hit_gpu += hits.gpu_docs
        c.docs_hit_host += hits.host_docs
        c.doc_tokens_requested += doc_tokens
        c.doc_tokens_hit += doc_hit_tokens
        c.tokens_saved += hits.cached_tokens
        c.tokens_computed += hits.computed_tokens
        c.ttft_sum_s += ttft_s
        self.hits.labels("gpu").inc(hits.gpu_docs)
        self.hits.labels("host").inc(hits.host_docs)
        self.misses.inc(hits.computed_docs)
        self.tokens_saved.inc(hits.cached_tokens)
        self.queue_wait.observe(queue_wait_s)
        self.ttft.observe(ttft_s)

    def record_prompt(self, *, moved_cuts: int, unplaced_docs: int) -> None:
        """What building one prompt could not do cleanly (docs/design.md 3.3)."""
        c = self.counters
        c.prompt_moved_cuts += moved_cuts
        c.prompt_unplaced_docs += unplaced_docs
        self.moved_cuts.inc(moved_cuts)
        self.unplaced_docs.inc(unplaced_docs)

    def record_failure(self) -> None:
        """One attempt failed (timeout or engine death)."""
        self.counters.requests_failed += 1
        self.failures.inc()

    def record_retry(self) -> None:
        self.counters.retries += 1

    def record_restart(self) -> None:
        self.counters.engine_restarts += 1
        self.restarts.inc()

    def record_speculation(
        self,
        outcome: Literal["started", "aborted", "used", "gated"],
        *,
        search_hidden_s: float = 0.0,
        in_flight_s: float = 0.0,
    ) -> None:
        """A speculative generation `started`, was `aborted` (wrong documents; `in_flight_s`:
        how long it ran) or `used` (`search_hidden_s`: the search time it overlapped); or a
        search did not speculate because searches were fast (`gated`)."""
        c = self.counters
        if outcome == "started":
            c.speculation_started += 1
        elif outcome == "aborted":
            c.speculation_aborted += 1
            c.speculation_aborted_s += in_flight_s
        elif outcome == "used":
            c.speculation_used += 1
            c.search_hidden_s += search_hidden_s
        elif outcome == "gated":
            c.speculation_gated += 1
        else:
            raise ValueError(f"unknown speculation outcome {outcome!r}")
        self.speculation.labels(outcome).inc()

    def record_tree(self, now: TreeCounters) -> None:
        """Move the host eviction collector by what the tree counted since the last call (the
        tree has no GPU slots: vLLM evicts its own blocks). The tree's counters only
        grow until its `clear()`: a drop means a clear, after which everything counted is new."""
        seen = self._tree_seen
        if now.evictions_host < seen.evictions_host:
            seen = TreeCounters()
        self.evictions.inc(now.evictions_host - seen.evictions_host)
        self._tree_seen = now
