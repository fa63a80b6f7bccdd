"""Replacement policies (PGDSF, GDSF, LRU, LFU, ARC, adaptive PGDSF) behind a registry."""

from __future__ import annotations

from ragcache_core.policy.adaptive import AdaptivePGDSF
from ragcache_core.policy.arc import ARC
from ragcache_core.policy.base import EvictionPolicy, GreedyDualPolicy, NodeStats, Priority
from ragcache_core.policy.policies import GDSF, LFU, LRU, PGDSF
from ragcache_core.policy.registry import POLICIES, make_policy

__all__ = [
    "ARC",
    "GDSF",
    "LFU",
    "LRU",
    "PGDSF",
    "POLICIES",
    "AdaptivePGDSF",
    "EvictionPolicy",
    "GreedyDualPolicy",
    "NodeStats",
    "Priority",
    "make_policy",
]
