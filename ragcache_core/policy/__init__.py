"""Replacement policies (DGDSF, PGDSF, GDSF, LRU, LFU, ARC) behind a registry."""

from __future__ import annotations

from ragcache_core.config import DEFAULT_POLICY
from ragcache_core.policy.arc import ARC
from ragcache_core.policy.base import (
    FREQUENCY_HALF_LIFE,
    EvictionPolicy,
    GreedyDualPolicy,
    NodeStats,
    Priority,
)
from ragcache_core.policy.policies import DGDSF, GDSF, LFU, LRU, PGDSF
from ragcache_core.policy.registry import POLICIES, make_policy

__all__ = [
    "ARC",
    "DEFAULT_POLICY",
    "DGDSF",
    "FREQUENCY_HALF_LIFE",
    "GDSF",
    "LFU",
    "LRU",
    "PGDSF",
    "POLICIES",
    "EvictionPolicy",
    "GreedyDualPolicy",
    "NodeStats",
    "Priority",
    "make_policy",
]
