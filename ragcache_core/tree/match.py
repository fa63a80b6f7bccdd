"""What a prefix match of the tree found: each cached node of the prefix with the tier it is
read from (`TierHit`), and the readable prefix as a whole (`MatchResult`). Frozen; safe to keep
and share."""

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
