"""Metrics bookkeeping without an engine: every `record_*` moves its plain counter and its
Prometheus collector together; the tree's counters arrive as deltas, across a `clear()`.
(That each metric moves under a real workload is tested in test_ragcache.py.)"""

from __future__ import annotations

from ragcache_core.metrics import Metrics
from ragcache_core.query_result import CacheHits
from ragcache_core.tree import TreeCounters


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_tree_counters_arrive_as_deltas_and_survive_a_clear() -> None:
    metrics = Metrics()
    metrics.record_tree(TreeCounters(evictions_host=3))
    metrics.record_tree(TreeCounters(evictions_host=5))
    assert _value(metrics, "ragcache_evictions_total", tier="host") == 5
    # The tree was cleared (its counters restart at 0) without `Metrics.reset`: a drop.
    metrics.record_tree(TreeCounters(evictions_host=1))
    assert _value(metrics, "ragcache_evictions_total", tier="host") == 6
    metrics.reset()  # RAGCache.clear(): the tree starts again from 0 too
    metrics.record_tree(TreeCounters(evictions_host=2))
    assert _value(metrics, "ragcache_evictions_total", tier="host") == 8


def test_the_engine_exports_no_gpu_pool_metric() -> None:
    """The tree has no GPU slots (vLLM evicts its own blocks): GPU evictions and swap-outs
    would always read 0, so there is no such series."""
    metrics = Metrics()
    metrics.record_tree(TreeCounters(evictions_host=1))
    names = {s.name for m in metrics.registry.collect() for s in m.samples}
    assert "ragcache_swap_outs_total" not in names
    assert _value(metrics, "ragcache_evictions_total", tier="gpu") == 0
    assert metrics.registry.get_sample_value("ragcache_evictions_total", {"tier": "gpu"}) is None


def test_a_request_moves_its_counters_and_collectors() -> None:
    metrics = Metrics()
    hits = CacheHits(gpu_docs=1, host_docs=1, computed_docs=1, cached_tokens=40)
    for ttft in (0.2, 0.4):
        metrics.record_request(
            hits, num_docs=3, doc_tokens=60, doc_hit_tokens=40, queue_wait_s=0.01, ttft_s=ttft
        )
    stats = metrics.counters.as_dict()
    assert stats["requests"] == 2 and stats["docs_hit_host"] == 2
    assert abs(stats["ttft_sum_s"] - 0.6) < 1e-9 and abs(stats["ttft_mean_s"] - 0.3) < 1e-9
    assert _value(metrics, "ragcache_doc_hits_total", tier="gpu") == 2
    assert _value(metrics, "ragcache_doc_hits_total", tier="host") == 2
    assert _value(metrics, "ragcache_doc_misses_total") == 2
    assert _value(metrics, "ragcache_tokens_saved_total") == 80
    assert _value(metrics, "ragcache_ttft_seconds_count") == 2
    assert _value(metrics, "ragcache_queue_wait_seconds_count") == 2
    metrics.record_speculation("used", search_hidden_s=0.5)
    metrics.record_failure()
    metrics.record_restart()
    assert _value(metrics, "ragcache_speculation_total", outcome="used") == 1
    assert _value(metrics, "ragcache_request_failures_total") == 1
    assert _value(metrics, "ragcache_engine_restarts_total") == 1
    assert metrics.counters.search_hidden_s == 0.5
