"""The four replacement policies of the paper's ablation, and DGDSF, the default
(docs/design.md 2.3)."""

from __future__ import annotations

import math

from ragcache_core.plan import Tier
from ragcache_core.policy.base import EvictionPolicy, GreedyDualPolicy, NodeStats, Priority

LOWEST = -1e300
"""The priority of a node never retrieved by a final request (DGDSF): below every other."""
MIN_COST = 1e-30
"""DGDSF's floor on Cost/Size (seconds per token), below any cost a profile measures."""


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


class DGDSF(EvictionPolicy):
    """GDSF with decayed frequency (the default): Frequency x Cost/Size, Cost/Size as GDSF's
    (the document computed alone, T(0, n) / n), each retrieval's weight in the frequency
    halving every `FREQUENCY_HALF_LIFE` final requests instead of GDSF's clock.

    The priority is log2 of that product, kept as `NodeStats.log2_decayed_frequency` +
    log2(Cost/Size): the decayed sum is scaled to time 0, so a priority taken at any time
    orders against any other as the products would at one common time, and a snapshot never
    goes stale (no clock). Ties are broken by recency. With eviction-time host writes the host
    tier holds what vLLM's LRU let go, so recency is already served and what the tier adds is
    frequency; the decay lets a document that stopped being retrieved go (docs/benchmarks.md,
    "Decayed frequency")."""

    name = "dgdsf"

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        if stats.log2_decayed_frequency == -math.inf:
            return (LOWEST, float(stats.last_access))
        # A cost model may clamp a tiny document's cost at 0: its frequency still ranks it.
        cost = max(stats.standalone_cost_per_token, MIN_COST)
        value = stats.log2_decayed_frequency + math.log2(cost)
        return (value, float(stats.last_access))
