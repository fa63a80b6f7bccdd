"""Replacement policies: one contract suite run against every policy, plus the exact
eviction order of each policy on constructed scenarios."""

from __future__ import annotations

import pytest
from _tree_helpers import (
    PREFIX_COST_TOKENS,
    ROOT,
    PrefixCost,
    cached_paths,
    doc,
    evicted_in_order,
    prefix_cost_victim,
    record_evictions,
    run,
)

from ragcache_core.config import CacheConfig
from ragcache_core.errors import ConfigError
from ragcache_core.plan import Tier
from ragcache_core.policy import POLICIES, NodeStats, make_policy
from ragcache_core.tree import KnowledgeTree

ALL = sorted(POLICIES)


def make(policy: str, host: int, page: int = 1, **kw: object) -> KnowledgeTree:
    """The engine's tree with a host tier of `host` slots written at compute (the tier the
    policy governs; vLLM's blocks are vLLM's)."""
    return KnowledgeTree(ROOT, host_slots=host, page_size=page, policy=policy, **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- contract


@pytest.mark.parametrize("policy", ALL)
def test_priority_is_a_deterministic_pair(policy: str) -> None:
    p = make_policy(policy)
    stats = NodeStats(10, 0.5, now=3)
    stats.touch(4, count=True, window=0)
    stats.record_computed(0.25)
    first = p.priority(stats, Tier.HOST)
    assert first == p.priority(stats, Tier.HOST)
    assert len(first) == 2 and all(isinstance(x, float) for x in first)


@pytest.mark.parametrize("policy", ALL)
def test_no_eviction_below_capacity(policy: str) -> None:
    cache = make(policy, host=50)
    for name in "abcde":
        run(cache, doc(name))
    assert len(cached_paths(cache)) == 6
    for name in "abcde":
        assert len(cache.match([doc(name)]).doc_hits) == 1


@pytest.mark.parametrize("policy", ALL)
def test_capacity_is_never_exceeded_and_hot_item_repeats_hit(policy: str) -> None:
    cache = make(policy, host=30)
    hits = 0
    for i in range(40):
        name = "hot" if i % 2 == 0 else f"cold{i}"
        handle = cache.begin_request(0, [doc(name)], 0)
        hits += len(handle.hits.doc_hits) if name == "hot" else 0
        cache.confirm(handle)
        assert cache.stats().host_used_slots <= 30
        cache.check_integrity()
    assert hits >= 15  # every policy keeps a document requested every other time


@pytest.mark.parametrize("policy", ALL)
def test_pinned_nodes_are_never_victims(policy: str) -> None:
    cache = make(policy, host=30)
    run(cache)
    holder = cache.begin_request(0, [doc("pinned")], 0)
    for i in range(10):
        run(cache, doc(f"other{i}"))
        assert ("pinned",) in cached_paths(cache)
    cache.confirm(holder)


@pytest.mark.parametrize("policy", ALL)
def test_only_leaves_are_evicted(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cold inner node a (below it: b) ties its leaf b on every policy's priority and
    entered the candidate heap first, so only the leaf rule keeps it from being evicted."""
    cache = make(policy, host=30)
    evictions = record_evictions(monkeypatch)
    run(cache, doc("a"), doc("b"))  # a -> b, computed together: same statistics
    run(cache, doc("c"))
    run(cache, doc("c"))  # c is hotter and more recent than a and b
    run(cache, doc("d"))  # 10 more tokens in a full tier of 30: one eviction
    assert [(e.path, e.tier) for e in evictions] == [(("a", "b"), Tier.HOST)]
    assert all(not e.children_in_tier and not e.pinned for e in evictions), evictions
    assert set(cached_paths(cache)) == {(), ("a",), ("c",), ("d",)}


@pytest.mark.parametrize("policy", ALL)
def test_clear_resets_policy_state(policy: str) -> None:
    cache = make(policy, host=20)
    for name in "abcd":
        run(cache, doc(name))
    cache.clear()
    fresh = make_policy(policy)
    stats = NodeStats(10, 1.0, now=0)
    assert cache.policy.priority(stats, Tier.HOST) == fresh.priority(stats, Tier.HOST)


@pytest.mark.parametrize("policy", ALL)
def test_the_tree_stores_loads_and_evicts_on_the_host_tier(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's tree (its slot tier is the host tier): stores and loads there, evictions
    there, capacity kept, and a document requested every other time keeps hitting."""
    cache = make(policy, host=30)
    evictions = record_evictions(monkeypatch)
    hits = 0
    for i in range(40):
        name = "hot" if i % 2 == 0 else f"cold{i}"
        # A 4-token root (the engine's prompts have one; a 0-token root on a host-only tree
        # is tests/test_tree_cache.py's xfail).
        handle = cache.begin_request(4, [doc(name)], 0)
        plan = handle.plan
        assert all(span.tier is Tier.HOST for span in (*plan.load, *plan.store))
        hits += handle.hits.docs_on(Tier.HOST) if name == "hot" else 0
        cache.confirm(handle)
        assert cache.stats().host_used_slots <= 30
        cache.check_integrity()
    assert hits >= 15
    assert cache.match([doc("hot")]).root_cached
    assert evictions and all(e.tier is Tier.HOST for e in evictions)


# --------------------------------------------------------------------------- exact orders


# Stream [a] [b] [c] [a] [a] [c]: frequency a=3, b=1, c=2; recency b < a < c.
# LRU evicts by recency; LFU by frequency (d, new with frequency 1, goes before c);
# GDSF ages: evicting b raises the clock, so new d (clock + 1 unit) ties c (0 + 2 units)
# and the older c goes first.
FREQUENCY_ORDER = {
    "lru": ["b", "a", "c"],
    "lfu": ["b", "d", "e"],
    "gdsf": ["b", "c", "d"],
    "pgdsf": ["b", "c", "d"],
    "arc": ["b", "d", "e"],  # a and c were reused (T2); b, then each newcomer, is T1's LRU
    "dgdsf": ["b", "d", "e"],  # no clock: frequency decides (a few requests decay nothing)
}


@pytest.mark.parametrize("policy", ALL)
def test_exact_order_frequency_and_recency(policy: str) -> None:
    cache = make(policy, host=30)  # three 10-token documents, root of 0 tokens
    for name in ["a", "b", "c", "a", "a", "c"]:
        run(cache, doc(name))
    assert evicted_in_order(cache, ["d", "e", "f"]) == FREQUENCY_ORDER[policy]


# Two leaves of equal size and frequency: x was computed after a 1,000-token cached prefix
# (cost/token 11), y after a 10-token one (1.1). x is older. Only PGDSF keeps x.
PREFIX_ORDER = {
    "lru": "x",
    "lfu": "x",
    "gdsf": "x",
    "pgdsf": "y",
    "arc": "x",
    "dgdsf": "x",  # GDSF's standalone cost: equal; x's retrieval is older
}


@pytest.mark.parametrize("policy", ALL)
def test_exact_order_prefix_aware_cost(policy: str) -> None:
    cache = make(policy, host=PREFIX_COST_TOKENS, cost_model=PrefixCost())
    assert prefix_cost_victim(cache) == PREFIX_ORDER[policy]


# ARC (vLLM's ARCCachePolicy): a tier of 30 tokens, a reused (T2), b and c stored once (T1).
# Each insert below evicts T1's LRU while |T1| >= target; each re-entry of a key in ghost list
# B1 grows the target by its 10 tokens (B2 empty: the factor is 1), capped at the capacity, 30:
#   d: evict b (B1 b)           b: evict c (B1 b c), b re-enters: target 10, B1 c
#   c: evict d (T1 20 >= 10), target 20     d: evict b (T1 20 >= 20), target 30
#   e: T1 is 20 < 30: evict T2's LRU, a (B2 a)
#   a: T1 30 >= 30: evict c; a re-enters from B2: target 30 - 10 x max(1, |B1| / |B2|) = 10
ARC_ORDER = ["b", "c", "d", "b", "a", "c"]


def test_exact_order_arc_adapts_its_target_from_ghost_hits() -> None:
    cache = make("arc", host=30)
    for name in ["a", "a", "b", "c"]:
        run(cache, doc(name))
    assert evicted_in_order(cache, ["d", "b", "c", "d", "e", "a"]) == ARC_ORDER
    state = cache.policy.tiers[Tier.HOST]  # type: ignore[attr-defined]
    assert state.target == 10.0
    assert list(state.b1) and not state.b2


def test_arc_forgets_a_copy_that_leaves_without_eviction() -> None:
    """An invalidated copy leaves T1/T2 but no ghost: only the policy's own evictions teach
    it (vLLM's `remove`); an evicted one leaves a ghost of its size."""
    cache = make("arc", host=20)
    for name in ["a", "a", "b"]:
        run(cache, doc(name))
    state = cache.policy.tiers[Tier.HOST]  # type: ignore[attr-defined]
    assert (state.t1_tokens, state.t2_tokens) == (10, 10)  # b stored once, a reused
    assert cache.invalidate("a") == 1
    assert (state.t1_tokens, state.t2_tokens) == (10, 0) and not state.b1 and not state.b2
    run(cache, doc("c"))
    run(cache, doc("d"))  # evicts b (T1's LRU): a ghost in B1
    assert [key[-1].doc_id for key in state.b1] == ["b"] and state.ghost[1.0] == 10


def test_a_removed_policy_is_refused_naming_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """`apgdsf` (adaptive PGDSF, now in scripts/) is refused by name wherever a policy name is
    taken, in one line naming the default."""
    monkeypatch.delitem(POLICIES, "apgdsf", raising=False)  # a script may have registered it
    refused = r"policy 'apgdsf' was removed \(adaptive PGDSF.*\); use the default, 'dgdsf'$"
    with pytest.raises(ConfigError, match=refused):
        make_policy("apgdsf")
    with pytest.raises(ConfigError, match=refused):
        CacheConfig(policy="apgdsf")
    with pytest.raises(ConfigError, match="unknown replacement policy 'fifo'"):
        make_policy("fifo")
