"""The four replacement policies of the paper's ablation (docs/design.md 2.3)."""

from __future__ import annotations

from ragcache_core.plan import Tier
from ragcache_core.policy.base import EvictionPolicy, GreedyDualPolicy, NodeStats, Priority


class PGDSF(GreedyDualPolicy):
    """Prefix-aware GDSF (paper Algorithm 1): Cost/Size is the mean, over the requests that
    computed this node, of T(alpha, beta) / beta -- the prefill cost per computed token of a
    request with this prefix cached up to alpha."""

    name = "pgdsf"

    def cost_per_token(self, stats: NodeStats) -> float:
        return stats.avg_cost_per_token


class GDSF(GreedyDualPolicy):
    """Classic GDSF: Cost/Size of the document computed alone, T(0, n) / n."""

    name = "gdsf"

    def cost_per_token(self, stats: NodeStats) -> float:
        return stats.standalone_cost_per_token


class LRU(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        return (float(stats.last_access), 0.0)


class LFU(EvictionPolicy):
    """Least frequently used first; ties broken by recency."""

    name = "lfu"

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        return (float(stats.frequency), float(stats.last_access))
