"""Adaptive PGDSF: PGDSF's cost term with its recency/frequency weight adapted online.

An experiment that lost (0.80 of the best fixed policy at worst, docs/benchmarks.md "Policy
hit rates"): removed from the package, kept here for the scripts that measure it
(`policy_hit_rates.py`, `tune_adaptive_pgdsf.py`), which `register()` it as `apgdsf`.

PGDSF's priority is Clock[tier] + frequency x Cost/Size: the clock is its recency (a node
enters at the clock level) and frequency x cost its frequency. `apgdsf` weighs the second by
theta[tier]: Clock[tier] + theta x frequency x Cost/Size. Theta near 0 is recency alone (the
priority is the clock when last accessed: LRU); a large theta is frequency x cost alone
(LFU weighted by cost); theta = 1 is PGDSF.

Theta adapts as ARC's target does (docs/design.md 2.3), from ghost lists of the keys this
policy evicted, each bounded by the tier's capacity in tokens: a key evicted when it had been
retrieved once (frequency <= 1) that enters again says recency was undervalued, so theta
shrinks by the factor (1 + step); one evicted with a higher frequency says frequency was, so
theta grows by it. Theta stays within [1 / THETA_BOUND, THETA_BOUND]. Priorities are
snapshots, so a node keeps the theta of its last access, as it keeps the clock of that moment.

`STEP` was tuned on two traces and is judged on two others (docs/benchmarks.md, "Policy hit
rates": `scripts/tune_adaptive_pgdsf.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import ClassVar

from ragcache_core.plan import Tier
from ragcache_core.policy import PGDSF, POLICIES, NodeStats, Priority


class _Ghosts:
    """One tier's ghost list (evicted key -> (tokens, frequency was <= 1)), its capacity."""

    __slots__ = ("capacity", "keys", "resident", "tokens")

    def __init__(self) -> None:
        self.keys: OrderedDict[Hashable, tuple[int, bool]] = OrderedDict()
        self.tokens = 0
        self.resident = 0
        self.capacity = 0

    def pop(self, key: Hashable) -> tuple[int, bool] | None:
        entry = self.keys.pop(key, None)
        if entry is not None:
            self.tokens -= entry[0]
        return entry

    def add(self, key: Hashable, tokens: int, once: bool) -> None:
        self.pop(key)
        self.keys[key] = (tokens, once)
        self.tokens += tokens
        while self.tokens > self.capacity and self.keys:
            self.tokens -= self.keys.popitem(last=False)[1][0]


class AdaptivePGDSF(PGDSF):
    """PGDSF with theta x frequency x Cost/Size, theta adapted from ghost hits per tier."""

    name = "apgdsf"
    tracks_residency = True
    STEP: ClassVar[float] = 0.05
    THETA_BOUND: ClassVar[float] = 256.0

    def __init__(self) -> None:
        super().__init__()
        self.theta: dict[Tier, float] = {Tier.GPU: 1.0, Tier.HOST: 1.0}
        self.ghosts: dict[Tier, _Ghosts] = {Tier.GPU: _Ghosts(), Tier.HOST: _Ghosts()}

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        value = self.clocks[tier] + self.theta[tier] * stats.frequency * self.cost_per_token(stats)
        return (value, float(stats.last_access))

    def on_enter(self, tier: Tier, key: Hashable, stats: NodeStats) -> None:
        ghosts = self.ghosts[tier]
        ghosts.resident += stats.num_tokens
        ghosts.capacity = max(ghosts.capacity, ghosts.resident)
        entry = ghosts.pop(key)
        if entry is None:
            return
        factor = 1.0 + self.STEP
        theta = self.theta[tier] / factor if entry[1] else self.theta[tier] * factor
        self.theta[tier] = min(max(theta, 1.0 / self.THETA_BOUND), self.THETA_BOUND)

    def on_leave(self, tier: Tier, key: Hashable, stats: NodeStats, *, evicted: bool) -> None:
        ghosts = self.ghosts[tier]
        ghosts.resident -= stats.num_tokens
        if evicted:
            ghosts.add(key, stats.num_tokens, stats.frequency <= 1)

    def reset(self) -> None:
        super().reset()
        self.theta = {Tier.GPU: 1.0, Tier.HOST: 1.0}
        self.ghosts = {Tier.GPU: _Ghosts(), Tier.HOST: _Ghosts()}


def register() -> None:
    """Make `apgdsf` a policy name in this process (`make_policy`, the simulators)."""
    POLICIES[AdaptivePGDSF.name] = AdaptivePGDSF
