"""DGDSF, the default policy: GDSF's Cost/Size times a frequency whose retrievals' weights
halve every `FREQUENCY_HALF_LIFE` final requests (docs/design.md 2.3)."""

from __future__ import annotations

import math

import pytest
from _tree_helpers import ROOT, cached_paths, doc, node_path, run

from ragcache_core.config import CacheConfig
from ragcache_core.plan import Tier
from ragcache_core.policy import DGDSF, FREQUENCY_HALF_LIFE, NodeStats
from ragcache_core.tree import KnowledgeTree

HALF = int(FREQUENCY_HALF_LIFE)


def retrieved(at: list[int], *, tokens: int = 10, cost: float = 1.0) -> NodeStats:
    """Statistics of a node retrieved by the final requests numbered `at`."""
    stats = NodeStats(tokens, cost, now=0)
    for final in at:
        stats.touch(final, count=True, window=0, final=final)
    return stats


def decayed(at: list[int], now: int) -> float:
    """The decayed frequency as of final request `now`, summed directly."""
    return sum(2.0 ** ((t - now) / FREQUENCY_HALF_LIFE) for t in at)


def test_the_default_policy_is_dgdsf() -> None:
    assert CacheConfig().policy == "dgdsf"


def test_the_stored_value_is_the_decayed_frequency_scaled_to_time_zero() -> None:
    at = [3, 10, 2500, 7000]
    stats = retrieved(at)
    assert stats.frequency == 4
    # log2 of the sum of 2^(t / H): at any time `now`, that minus now / H is log2 of the
    # frequency decayed to `now`.
    for now in (7000, 9000, 20000):
        expected = math.log2(decayed(at, now))
        assert stats.log2_decayed_frequency - now / FREQUENCY_HALF_LIFE == pytest.approx(expected)


def test_priorities_taken_at_different_times_order_as_the_products_at_one_time() -> None:
    """No clock: a priority snapshot never goes stale. Three documents retrieved at
    different times order as their decayed frequencies at one later time: four retrievals
    near 0 are worth about one retrieval two half-lives later (a little more, as it is 9
    requests short of that), and two retrievals then are worth twice that."""
    policy = DGDSF()
    times = {
        "old": [1, 2, 3, 4],
        "recent_one": [1 + 2 * HALF - 10],
        "recent_two": [1 + 2 * HALF + 10, 1 + 2 * HALF + 20],
    }
    priority = {k: policy.priority(retrieved(t), Tier.HOST) for k, t in times.items()}
    at_once = {k: decayed(t, 3 * HALF) for k, t in times.items()}
    assert sorted(priority, key=priority.__getitem__) == ["recent_one", "old", "recent_two"]
    assert sorted(at_once, key=at_once.__getitem__) == ["recent_one", "old", "recent_two"]


def test_cost_per_token_weighs_the_frequency_and_more_retrievals_weigh_more() -> None:
    policy = DGDSF()
    same_time = [5, 6]
    cheap = policy.priority(retrieved(same_time, cost=1.0), Tier.HOST)
    dear = policy.priority(retrieved(same_time, cost=2.0), Tier.HOST)
    assert dear[0] - cheap[0] == pytest.approx(1.0)  # log2 of the cost ratio
    assert policy.priority(retrieved([5, 6, 7]), Tier.HOST) > cheap


def test_a_document_whose_cost_is_clamped_at_zero_is_still_ranked_by_frequency() -> None:
    policy = DGDSF()
    once, twice = retrieved([5], cost=0.0), retrieved([5, 6], cost=0.0)
    assert policy.priority(once, Tier.HOST) < policy.priority(twice, Tier.HOST)
    assert policy.priority(twice, Tier.HOST) < policy.priority(retrieved([5], cost=1e-6), Tier.HOST)


def test_a_node_never_retrieved_by_a_final_request_ranks_below_every_other() -> None:
    policy = DGDSF()
    never = NodeStats(10, 1.0, now=0)
    never.touch(1, count=False, window=0, final=0)  # a speculative request's access
    assert never.log2_decayed_frequency == -math.inf
    assert policy.priority(never, Tier.HOST) < policy.priority(retrieved([1]), Tier.HOST)


def test_a_new_frequency_window_restarts_the_decayed_frequency() -> None:
    stats = retrieved([1, 2, 3])
    stats.touch(10, count=True, window=1, final=10)
    assert stats.frequency == 1
    assert stats.log2_decayed_frequency == pytest.approx(10 / FREQUENCY_HALF_LIFE)


def test_on_the_tree_a_document_that_stops_being_retrieved_gives_way() -> None:
    """A host tier of two 10-token documents. `old` is retrieved 8 times, then the stream
    moves on: `new` twice in a row, then two one-off documents, and again. Plain LFU keeps
    `old` for good (its count never fades), so the first one-off pushes `new` out each time
    (2 < 8; a node that leaves the tree takes its count with it); DGDSF lets `old` go once its
    retrievals have faded below a fresh pair of `new`'s (after about two half-lives), and
    then `new` stays."""

    def tree(policy: str) -> KnowledgeTree:
        return KnowledgeTree(ROOT, host_slots=20, page_size=1, policy=policy)

    for policy, keeps_new in (("lfu", False), ("dgdsf", True)):
        cache = tree(policy)
        for _ in range(8):
            run(cache, doc("old"))
        for i in range(4 * HALF):  # new, new, once, once, ...
            run(cache, doc("new") if i % 4 < 2 else doc(f"once{i}"))
        paths = set(cached_paths(cache))
        assert (("new",) in paths) is keeps_new, policy
        assert (("old",) in paths) is not keeps_new, policy


def test_an_adopted_speculation_counts_the_documents_it_computed() -> None:
    """With eviction-time writes a document not yet in the tree lives in a shadow until the
    request settles; a speculative request's counts nothing until it is adopted. Adopting it
    counts the documents it computed too, not only its path's nodes, so DGDSF does not rank
    them below every document ever counted (the lowest priority is for never retrieved)."""
    tree = KnowledgeTree(
        ROOT, host_slots=32, page_size=4, host_write="eviction", host_lease_slots=8
    )
    handle = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3, final=False)
    tree.confirm(handle)  # settled: vLLM's blocks hold root, a and a/b; nodes now
    nodes = {node_path(n): n for n in tree.iter_nodes()}
    assert set(nodes) == {(), ("a",), ("a", "b")}
    assert all(n.stats.frequency == 0 for n in nodes.values())
    tree.mark_final(handle)
    for name, node in nodes.items():
        assert node.stats.frequency == 1, name
        assert node.stats.log2_decayed_frequency > -math.inf, name
    tree.check_integrity()
