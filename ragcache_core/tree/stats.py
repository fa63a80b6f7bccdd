"""The tree's snapshots for stats(): its occupancy (`CacheStats`) and its eviction counters
(`TreeCounters`). Frozen; safe to keep and share."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheStats:
    """A snapshot of the cache's occupancy."""

    nodes: int
    host_slots: int
    host_used_slots: int
    """Host slots holding a node's copy (lent slots not yet copied into are not used)."""
    pinned_nodes: int
    open_requests: int
    page_size: int
    roots: int = 1
    """Roots holding a copy (one per template/system prompt/salt in use)."""


@dataclass(frozen=True, slots=True)
class TreeCounters:
    """Evictions since the cache was created or last cleared (a snapshot; every field only
    grows until `clear()` resets them all to 0, which a reader of deltas sees as a drop).
    vLLM's blocks are evicted by vLLM, which counts its own.

    - `evictions_host`: nodes chosen as host victims;
    - `host_slots_written`: host slots the engine wrote with KV: confirmed stores (written as
      computed) and eviction-time copies reported done (used or not).
    Nodes removed with a victim's subtree, by invalidation or by `drop_tier` are not victims.
    """

    evictions_host: int = 0
    host_slots_written: int = 0
