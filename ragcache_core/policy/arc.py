"""ARC (Adaptive Replacement Cache) over a knowledge-tree tier, as vLLM's offloading runs it.

The reference is vLLM's `ARCCachePolicy` (vllm/v1/kv_offload/cpu/policies/arc.py, vLLM 0.32.0
as installed here; `OffloadingConnector` with `eviction_policy="arc"`). Per tier:

  * T1 holds copies not reused since they entered the tier, T2 copies reused at least once
    (vLLM: a ready chunk reused by a request moves from T1 to T2; a store is not a reuse);
  * the victim is T1's least recently used candidate when |T1| >= target, else T2's; when
    the chosen list has no candidate, the other list's (vLLM's `evict`);
  * an evicted copy's key goes to ghost list B1 (from T1) or B2 (from T2), each bounded by the
    tier's capacity; a key that enters again while in B1 grows the target by
    max(1, |B2| / |B1|) per unit, in B2 shrinks it by max(1, |B1| / |B2|) (vLLM's
    `_adapt_to_ghost_hit`), and leaves its ghost list.

Where the tree differs from vLLM's flat chunk cache, and what this does instead:
  * vLLM counts chunks (fixed-size blocks); a document here is one entry of many tokens, so
    sizes, targets and ghost bounds count tokens (a document of n blocks weighs n blocks);
  * vLLM knows its capacity; a tree's policy does not, so it uses the most tokens the tier
    has held (after the first eviction, the capacity within one document);
  * only unpinned leaves are candidates (a prefix cannot go before its children), where vLLM
    skips chunks with readers (`ref_cnt`) and protected ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from ragcache_core.plan import Tier
from ragcache_core.policy.base import EvictionPolicy, NodeStats, Priority

T1 = 1.0
"""Lane of copies not reused since they entered the tier (a priority's first element)."""
T2 = 2.0
"""Lane of copies reused at least once in the tier."""


class _Resident:
    """One copy in a tier: its lane, its size and the access count its entry left."""

    __slots__ = ("baseline", "key", "lane", "tokens")

    def __init__(self, key: Hashable, tokens: int) -> None:
        self.key = key
        self.tokens = tokens
        self.lane = T1
        self.baseline: int | None = None
        """`NodeStats.accesses` at the first priority after entry (the storing access
        included); more accesses than that are reuses."""


class _TierState:
    """ARC's lists for one tier: residents (T1 and T2), ghosts (B1 and B2), target, capacity."""

    __slots__ = ("b1", "b2", "capacity", "ghost", "residents", "t1_tokens", "t2_tokens", "target")

    def __init__(self) -> None:
        self.residents: dict[int, _Resident] = {}
        """By `id(stats)`: a node's statistics object lives as long as the node."""
        self.t1_tokens = 0
        self.t2_tokens = 0
        self.b1: OrderedDict[Hashable, int] = OrderedDict()
        self.b2: OrderedDict[Hashable, int] = OrderedDict()
        self.ghost = {T1: 0, T2: 0}
        """Tokens in B1 (under T1) and B2 (under T2)."""
        self.target = 0.0
        self.capacity = 0

    def forget_ghost(self, key: Hashable) -> None:
        """`key` enters again: drop it from whichever ghost list holds it."""
        for lane, ghost in ((T1, self.b1), (T2, self.b2)):
            tokens = ghost.pop(key, None)
            if tokens is not None:
                self.ghost[lane] -= tokens


class ARC(EvictionPolicy):
    """Adaptive Replacement Cache: recency lists T1 (seen once) and T2 (reused), the split
    between them adapted online from ghost-list hits. Priority = (lane, last access)."""

    name = "arc"
    tracks_residency = True
    lanes = True

    def __init__(self) -> None:
        self.tiers: dict[Tier, _TierState] = {Tier.GPU: _TierState(), Tier.HOST: _TierState()}

    def priority(self, stats: NodeStats, tier: Tier) -> Priority:
        """(T1 or T2, last access). A copy moves from T1 to T2 the first time it is seen
        accessed again after its entry; the move is recorded once (later calls agree)."""
        state = self.tiers[tier]
        resident = state.residents.get(id(stats))
        if resident is None:
            return (T1, float(stats.last_access))  # not in this tier (e.g. a ranking query)
        if resident.baseline is None:
            resident.baseline = stats.accesses
        elif resident.lane == T1 and stats.accesses > resident.baseline:
            resident.lane = T2
            state.t1_tokens -= resident.tokens
            state.t2_tokens += resident.tokens
        return (resident.lane, float(stats.last_access))

    def on_enter(self, tier: Tier, key: Hashable, stats: NodeStats) -> None:
        state = self.tiers[tier]
        tokens = stats.num_tokens
        b1, b2 = state.ghost[T1], state.ghost[T2]
        if key in state.b1:
            grow = tokens * max(1.0, b2 / b1) if b1 else float(tokens)
            state.target = min(state.target + grow, float(state.capacity))
        elif key in state.b2:
            shrink = tokens * max(1.0, b1 / b2) if b2 else float(tokens)
            state.target = max(state.target - shrink, 0.0)
        state.forget_ghost(key)
        state.residents[id(stats)] = _Resident(key, tokens)
        state.t1_tokens += tokens
        state.capacity = max(state.capacity, state.t1_tokens + state.t2_tokens)

    def on_leave(self, tier: Tier, key: Hashable, stats: NodeStats, *, evicted: bool) -> None:
        state = self.tiers[tier]
        resident = state.residents.pop(id(stats), None)
        if resident is None:
            return
        if resident.lane == T1:
            state.t1_tokens -= resident.tokens
        else:
            state.t2_tokens -= resident.tokens
        if not evicted:
            return
        state.forget_ghost(resident.key)
        lane = resident.lane
        ghost = state.b1 if lane == T1 else state.b2
        ghost[resident.key] = resident.tokens
        state.ghost[lane] += resident.tokens
        while state.ghost[lane] > state.capacity and ghost:
            state.ghost[lane] -= ghost.popitem(last=False)[1]

    def lane_order(self, tier: Tier) -> tuple[float, ...]:
        state = self.tiers[tier]
        return (T1, T2) if state.t1_tokens >= int(state.target) else (T2, T1)

    def reset(self) -> None:
        self.tiers = {Tier.GPU: _TierState(), Tier.HOST: _TierState()}
