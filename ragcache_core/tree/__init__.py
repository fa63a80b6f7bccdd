"""Knowledge tree: prefix tree over document ids, placed over GPU and host slot pools.

`KnowledgeCache` is the entry point (match, begin_request -> Plan, confirm/abort, invalidate,
clear, drop_tier, check_integrity). Pure Python: it never touches tensors.
"""

from __future__ import annotations

from ragcache_core.tree.allocator import SlotAllocator
from ragcache_core.tree.cache import KnowledgeCache
from ragcache_core.tree.capacity import (
    bytes_for_tokens,
    kv_bytes_per_token,
    slots_for_tokens,
    slots_in_tokens,
    tokens_for_bytes,
)
from ragcache_core.tree.integrity import IntegrityError
from ragcache_core.tree.keys import DocKey, DocSpec, RootKey
from ragcache_core.tree.request import RequestHandle, RequestState
from ragcache_core.tree.results import CacheStats, MatchResult, TierHit

__all__ = [
    "CacheStats",
    "DocKey",
    "DocSpec",
    "IntegrityError",
    "KnowledgeCache",
    "MatchResult",
    "RequestHandle",
    "RequestState",
    "RootKey",
    "SlotAllocator",
    "TierHit",
    "bytes_for_tokens",
    "kv_bytes_per_token",
    "slots_for_tokens",
    "slots_in_tokens",
    "tokens_for_bytes",
]
