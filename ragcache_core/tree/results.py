"""Typed results that cross the tree's boundary (frozen; safe to keep and share)."""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_core.plan import Tier
from ragcache_core.tree.keys import DocKey, RootKey


@dataclass(frozen=True, slots=True)
class TierHit:
    """One cached node of a request's prefix: its key, size and the tier it is read from."""

    key: RootKey | DocKey
    num_tokens: int
    tier: Tier

    @property
    def is_root(self) -> bool:
        return isinstance(self.key, RootKey)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The readable prefix of a document sequence (root first, if cached), and how many
    nodes right after it exist but are still in flight (being written; not loadable).
    `vllm_tokens`: the tokens of the nodes right after the readable prefix that vLLM's own
    blocks hold (`Node.resident`; eviction-time host writes): cached, but never loaded."""

    hits: tuple[TierHit, ...]
    in_flight: int
    vllm_tokens: int = 0

    @property
    def root_cached(self) -> bool:
        return bool(self.hits) and self.hits[0].is_root

    @property
    def doc_hits(self) -> tuple[TierHit, ...]:
        return tuple(h for h in self.hits if not h.is_root)

    @property
    def cached_tokens(self) -> int:
        """Tokens loadable from the cache (system prompt included)."""
        return sum(h.num_tokens for h in self.hits)

    def docs_on(self, tier: Tier) -> int:
        return sum(1 for h in self.hits if not h.is_root and h.tier is tier)

    def doc_tokens_on(self, tier: Tier) -> int:
        return sum(h.num_tokens for h in self.hits if not h.is_root and h.tier is tier)


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache's occupancy."""

    nodes: int
    gpu_slots: int
    gpu_used_slots: int
    host_slots: int
    host_used_slots: int
    pinned_nodes: int
    open_requests: int
    page_size: int
    roots: int = 1
    """Roots holding a copy (one per template/system prompt/salt in use)."""
    protected_nodes: int = 0
    """Nodes in the protected set (held in vLLM's blocks, or asked for)."""
    protected_tokens: int = 0
    """Their tokens, in whole vLLM blocks (at most the set's budget)."""


@dataclass(frozen=True, slots=True)
class TreeCounters:
    """Evictions since the cache was created or last cleared (a snapshot; every field only
    grows until `clear()` resets them all to 0, which a reader of deltas sees as a drop).

    - `evictions_gpu`: nodes chosen as GPU victims (with or without a swap-out);
    - `evictions_host`: nodes chosen as host victims;
    - `swap_outs`: GPU victims copied to host (their first GPU eviction with host room). A
      GPU victim already on host is freed without a copy: an eviction, not a swap-out.
    - `host_slots_written`: host slots the engine wrote with KV: confirmed stores (written as
      computed) and eviction-time copies reported done (used or not).
    Nodes removed with a victim's subtree, by invalidation or by `drop_tier` are not victims.
    """

    evictions_gpu: int = 0
    evictions_host: int = 0
    swap_outs: int = 0
    host_slots_written: int = 0
