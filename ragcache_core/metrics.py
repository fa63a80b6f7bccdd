"""Counters of one `RAGCache`, exposed through `stats()` and as Prometheus collectors.

Each `RAGCache` has its own `CollectorRegistry` (no global state); serve it with
`prometheus_client.start_http_server(port, registry=cache.metrics.registry)` or
`generate_latest(cache.metrics.registry)`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

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
    search_hidden_s: float = 0.0
    ttft_sum_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        ttfts = data.pop("ttfts")
        docs = max(1, self.docs_requested)
        data["doc_hit_rate"] = (self.docs_hit_gpu + self.docs_hit_host) / docs
        data["gpu_doc_hit_rate"] = self.docs_hit_gpu / docs
        data["host_doc_hit_rate"] = self.docs_hit_host / docs
        data["token_hit_rate"] = self.doc_tokens_hit / max(1, self.doc_tokens_requested)
        data["ttft_mean_s"] = sum(ttfts) / len(ttfts) if ttfts else 0.0
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
        self.tokens_saved = Counter("ragcache_tokens_saved", "Prompt tokens loaded", registry=r)
        self.speculation = Counter(
            "ragcache_speculation", "Speculative generations", ["outcome"], registry=r
        )
        self.evictions = Counter("ragcache_evictions", "Nodes evicted", ["tier"], registry=r)
        self.swaps = Counter("ragcache_swap_outs", "GPU-to-host copies", registry=r)
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

    def reset(self) -> None:
        self.counters = Counters()
