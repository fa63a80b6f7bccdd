"""Knowledge tree: prefix tree over document ids, over vLLM's blocks and the slot tiers below.

`KnowledgeTree` (knowledge_tree.py) is the entry point (match, begin_request -> Plan, confirm/abort,
invalidate, clear, drop_tier, counters, check_integrity), a manager over three parts: the
prefix structure (prefix.py), the placement over the slot tiers (placement.py, over
tier_slots.py and allocator.py), the planner (planner.py) and the host tier's eviction-time
writes (host_writes.py). Pure Python: it never touches tensors.
"""

from __future__ import annotations

from ragcache_core.capacity import (
    bytes_for_tokens,
    kv_bytes_per_token,
    slots_for_tokens,
    slots_in_tokens,
    tokens_for_bytes,
)
from ragcache_core.tree.allocator import SlotAllocator
from ragcache_core.tree.integrity import IntegrityError
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey
from ragcache_core.tree.knowledge_tree import KnowledgeTree
from ragcache_core.tree.match import MatchResult, TierHit
from ragcache_core.tree.order import cache_order
from ragcache_core.tree.request import RequestHandle, RequestState
from ragcache_core.tree.stats import CacheStats, TreeCounters

__all__ = [
    "CacheStats",
    "DocKey",
    "DocSpec",
    "IntegrityError",
    "KnowledgeTree",
    "MatchResult",
    "RequestHandle",
    "RequestState",
    "RootKey",
    "SlotAllocator",
    "TierHit",
    "TreeCounters",
    "bytes_for_tokens",
    "cache_order",
    "kv_bytes_per_token",
    "slots_for_tokens",
    "slots_in_tokens",
    "tokens_for_bytes",
]
