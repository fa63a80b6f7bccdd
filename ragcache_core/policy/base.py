"""Replacement policies: a policy maps a node's statistics to a sortable priority.

The tree keeps the statistics (`NodeStats`) and a min-heap of each tier's eviction candidates;
the lowest priority is evicted first. A policy never sees nodes, slots or tiers' contents: it
reads `NodeStats`, may keep per-tier state (GDSF's clocks), and hears about each eviction.
A policy that keeps state beside the statistics (ARC's lists and ghost lists, docs/design.md
2.3) also hears each copy enter and leave a tier, under an opaque stable key, and may split the
candidates into lanes whose order it picks at each eviction (`lane_order`).
Adding a policy is adding one small subclass and one registry entry (`registry.py`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import ClassVar

from ragcache_core.plan import Tier

Priority = tuple[float, float]
"""Sortable priority; compared lexicographically, lowest evicted first."""

FREQUENCY_HALF_LIFE = 2000.0
"""Final requests over which a retrieval's weight in `NodeStats.log2_decayed_frequency` halves
(DGDSF's aging, docs/design.md 2.3; the figure that chose it: docs/benchmarks.md, "Decayed
frequency")."""


class NodeStats:
    """What the tree records about one node; policies read it.

    - `frequency`: retrievals of this document at this prefix by *final* requests in the
      current frequency window (speculative requests do not count).
    - `cost_per_token_sum` / `num_computed`: the paper's prefix-aware Cost/Size: sum over the
      requests that computed this node (it was not cached) of T(alpha, beta) / beta.
    - `standalone_cost_per_token`: T(0, n) / n, the cost of the document computed alone
      (classic GDSF's Cost/Size).
    - `last_access`: logical time (request counter) of the latest access, any request.
    - `accesses`: accesses of any request since the node was created (never windowed; ARC
      tells a reuse from the store by it).
    - `log2_decayed_frequency`: log2 of the sum, over the counted retrievals, of
      2^(f / FREQUENCY_HALF_LIFE), f the number of final requests at that retrieval: the
      frequency with each retrieval's weight halving every `FREQUENCY_HALF_LIFE` final
      requests, on a scale where every node's value compares with every other's whenever it
      was taken (-inf before the first count; windowed as `frequency` is).
    """

    __slots__ = (
        "accesses",
        "cost_per_token_sum",
        "frequency",
        "last_access",
        "log2_decayed_frequency",
        "num_computed",
        "num_tokens",
        "standalone_cost_per_token",
        "window",
    )

    def __init__(self, num_tokens: int, standalone_cost_per_token: float, now: int) -> None:
        self.num_tokens = num_tokens
        self.standalone_cost_per_token = standalone_cost_per_token
        self.frequency = 0
        self.cost_per_token_sum = 0.0
        self.num_computed = 0
        self.last_access = now
        self.window = 0
        self.accesses = 0
        self.log2_decayed_frequency = -math.inf

    @property
    def avg_cost_per_token(self) -> float:
        """Algorithm 1's `avg_cost`: mean of T(alpha, beta) / beta over computing requests."""
        return self.cost_per_token_sum / self.num_computed if self.num_computed else 0.0

    def touch(self, now: int, *, count: bool, window: int, final: int | None = None) -> None:
        """An access at logical time `now`; `count` bumps the frequency (final requests).

        `window` is the current frequency-window index; a count from an older window is reset.
        `final` is the number of final requests so far, the decayed frequency's time (None:
        `now`).
        """
        self.last_access = now
        self.accesses += 1
        if count:
            if self.window != window:
                self.window = window
                self.frequency = 0
                self.log2_decayed_frequency = -math.inf
            self.frequency += 1
            weight = (now if final is None else final) / FREQUENCY_HALF_LIFE
            self.log2_decayed_frequency = _log2_add(self.log2_decayed_frequency, weight)

    def record_computed(self, cost_per_new_token: float) -> None:
        """The node was computed (not cached) by a request whose prefill cost this much per
        computed token."""
        self.cost_per_token_sum += cost_per_new_token
        self.num_computed += 1


def _log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b), without overflow."""
    high, low = (a, b) if a >= b else (b, a)
    if low == -math.inf:
        return high
    return high + math.log2(1.0 + 2.0 ** (low - high))


class EvictionPolicy(ABC):
    """A priority function, plus optional per-tier state updated on evictions.

    `priority` must be pure given the policy's state; the tree calls it when a node is accessed
    or enters a tier and stores the result (so a priority is a snapshot, as in GDSF).
    """

    name: ClassVar[str]
    tracks_residency: ClassVar[bool] = False
    """True: the tree calls `on_enter`/`on_leave` for every copy."""
    lanes: ClassVar[bool] = False
    """True: the tree keeps one candidate heap per lane (a priority's first element), popped
    in `lane_order`."""

    @abstractmethod
    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        """The node's priority in `tier` as of now."""

    def on_evict(self, tier: Tier, priority: Priority) -> None:  # noqa: B027 (optional hook)
        """A node of priority `priority` was evicted from `tier`."""

    def reset(self) -> None:  # noqa: B027 (optional hook)
        """Forget all state (the cache was cleared)."""

    def on_enter(self, tier: Tier, key: Hashable, stats: NodeStats) -> None:  # noqa: B027
        """A copy of the node `key` (stable across the node's removal and re-creation) entered
        `tier`. Called only when `tracks_residency`, before its first `priority` there."""

    def on_leave(  # noqa: B027 (optional hook)
        self, tier: Tier, key: Hashable, stats: NodeStats, *, evicted: bool
    ) -> None:
        """The node's copy left `tier`: `evicted` by this policy's choice, or dropped
        otherwise (invalidated, aborted, cleared). Called only when `tracks_residency`."""

    def lane_order(self, tier: Tier) -> tuple[float, ...]:
        """The lanes to take the next victim of `tier` from, in order (only with `lanes`): the
        lowest priority of the first lane with a candidate goes."""
        return ()


class GreedyDualPolicy(EvictionPolicy):
    """Greedy-Dual-Size-Frequency family: Clock[tier] + Frequency x Cost/Size.

    One logical clock per tier, starting at 0; on each eviction the tier's clock becomes
    max(clock, evicted priority), so nodes not accessed for a while fall below newly refreshed
    ones (aging). Ties are broken by recency.
    """

    def __init__(self) -> None:
        self.clocks: dict[Tier, float] = {Tier.GPU: 0.0, Tier.HOST: 0.0}

    @abstractmethod
    def cost_per_token(self, stats: NodeStats) -> float:
        """Cost/Size of the node."""

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        value = self.clocks[tier] + stats.frequency * self.cost_per_token(stats)
        return (value, float(stats.last_access))

    def on_evict(self, tier: Tier, priority: Priority) -> None:
        self.clocks[tier] = max(self.clocks[tier], priority[0])

    def reset(self) -> None:
        self.clocks = {Tier.GPU: 0.0, Tier.HOST: 0.0}
