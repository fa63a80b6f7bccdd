"""KnowledgeTree mechanics: matching, plans, tiers, pins, invalidation, failures."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _tree_helpers import (
    ROOT,
    cached_paths,
    doc,
    host_used,
    make,
    node_path,
    record_evictions,
    run,
)

from ragcache_core.errors import ConfigError, InputError, RAGCacheError
from ragcache_core.plan import LoadSpan, Plan, StoreSpan, Tier
from ragcache_core.tree import (
    DocKey,
    DocSpec,
    IntegrityError,
    KnowledgeTree,
    RootKey,
    SlotAllocator,
    TreeCounters,
    bytes_for_tokens,
    kv_bytes_per_token,
    slots_for_tokens,
    tokens_for_bytes,
)


def test_first_request_stores_root_then_docs_with_prompt_offsets() -> None:
    cache = make(page=4)
    a, b = doc("a", 10), doc("b", 5)
    handle = cache.begin_request(7, [a, b], 3)
    plan = handle.plan
    assert plan.load == ()
    starts = [(s.token_start, s.num_tokens, len(s.slots)) for s in plan.store]
    assert starts == [(0, 7, 2), (7, 10, 3), (17, 5, 2)]
    assert handle.cached_tokens == 0 and handle.computed_tokens == 25
    assert handle.stored_root and handle.stored_docs == 2
    assert Plan.from_json(plan.to_json()) == plan
    cache.check_integrity()


def test_unconfirmed_nodes_are_in_flight_not_hits() -> None:
    cache = make()
    first = cache.begin_request(8, [doc("a")], 2)
    assert cache.match([doc("a")]).hits == ()
    second = cache.begin_request(8, [doc("a")], 2)
    assert second.plan.load == () and second.plan.store == ()  # blocked, not duplicated
    cache.confirm(first)
    cache.confirm(second)
    result = cache.match([doc("a").key])
    assert [h.tier for h in result.hits] == [Tier.HOST, Tier.HOST]
    assert result.root_cached and result.cached_tokens == 18


def test_hit_plan_loads_prefix_in_order_and_stores_the_tail() -> None:
    cache = make(page=4)
    run(cache, doc("a", 6), doc("b", 6), root=4)
    handle = cache.begin_request(4, [doc("a", 6), doc("c", 9)], 5)
    loads = [(s.tier, s.token_start, s.num_tokens) for s in handle.plan.load]
    assert loads == [(Tier.HOST, 0, 4), (Tier.HOST, 4, 6)]
    assert [(s.token_start, s.num_tokens) for s in handle.plan.store] == [(10, 9)]
    assert handle.cached_tokens == 10 and handle.computed_tokens == 14
    assert handle.hits.docs_on(Tier.HOST) == 1 and handle.hits.doc_tokens_on(Tier.HOST) == 6
    cache.confirm(handle)
    cache.check_integrity()


def test_match_does_not_modify_the_cache() -> None:
    cache = make(host=6, page=4)
    run(cache, doc("a", 8), root=4)
    before = {n.key: (dict(n.slots), n.pins, n.stats.frequency) for n in cache.iter_nodes()}
    for _ in range(3):
        cache.match([doc("a", 8), doc("b", 8)])
    after = {n.key: (dict(n.slots), n.pins, n.stats.frequency) for n in cache.iter_nodes()}
    assert before == after


class _PerRequest:
    """T(alpha, beta) = 1 s for any request: a node's GDSF Cost/Size is 1 / its tokens, so a
    longer document has the lower priority."""

    def prefill_time(self, cached_tokens: int, new_tokens: int) -> float:
        return 1.0 if new_tokens else 0.0


def test_host_eviction_frees_and_parent_before_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """a (8 tokens) -> b (4) fill the host tier; host pressure then evicts the leaf b
    (freeing its slot, the node leaves the tree) and keeps a, although a's priority is the
    lower one: a host copy is never evicted while a child still has a host copy."""
    cache = KnowledgeTree(ROOT, host_slots=3, page_size=4, policy="gdsf", cost_model=_PerRequest())
    evictions = record_evictions(monkeypatch)
    run(cache, doc("a", 8), doc("b", 4))  # host full: a (2 slots), b (1); the root has none
    assert cached_paths(cache)[("a",)] == cached_paths(cache)[("a", "b")] == {"host"}
    assert cache.counters.evictions_host == 0 and cache.stats().host_used_slots == 3
    nodes = {node_path(n): n for n in cache.iter_nodes()}
    a, b = nodes[("a",)], nodes[("a", "b")]
    assert a.priority[Tier.HOST] < b.priority[Tier.HOST]  # a would go first, were it a leaf
    run(cache, doc("c", 4))  # c needs a host slot: one host eviction
    assert [e.path for e in evictions] == [("a", "b")], evictions
    assert not evictions[0].children_in_tier and cache.counters.evictions_host == 1
    paths = cached_paths(cache)
    assert ("a", "b") not in paths and paths[("a",)] == {"host"} and paths[("c",)] == {"host"}
    assert cache.stats().host_used_slots == 3  # b's slot was freed and went to c
    assert [h.tier for h in cache.match([doc("a", 8), doc("b", 4)]).hits] == [Tier.HOST] * 2


def test_pinned_nodes_survive_pressure_and_room_shortage_is_not_an_error() -> None:
    cache = make(host=3, page=4)
    run(cache)  # the (empty) root is confirmed: it no longer blocks other requests
    holder = cache.begin_request(0, [doc("a", 4), doc("b", 4)], 0)
    assert holder.stored_docs == 2
    other = cache.begin_request(0, [doc("c", 4), doc("d", 4)], 0)
    assert other.stored_docs == 1  # one free slot, nothing evictable
    cache.check_integrity()
    cache.confirm(other)
    squeezed = cache.begin_request(0, [doc("e", 8)], 0)
    assert squeezed.stored_docs == 0 or ("a",) in cached_paths(cache)
    assert ("a", "b") in cached_paths(cache)
    cache.confirm(squeezed)
    cache.confirm(holder)
    cache.check_integrity()


def test_computed_documents_are_stored_on_the_host_tier_and_loaded_from_it() -> None:
    """The tree's only slot tier is the host tier (vLLM's prefix cache is the GPU tier):
    computed documents are stored there and later hits load from it."""
    cache = make(host=10)
    first = cache.begin_request(4, [doc("a", 4)], 1)
    assert first.plan.store == (
        StoreSpan(Tier.HOST, (0,), 0, 4),
        StoreSpan(Tier.HOST, (1,), 4, 4),
    )
    assert first.plan.load == () and first.cached_tokens == 0
    cache.confirm(first)
    for _ in range(2):
        handle = cache.begin_request(4, [doc("a", 4)], 1)
        plan = handle.plan
        assert plan.load == (
            LoadSpan(Tier.HOST, (0,), 0, 4),
            LoadSpan(Tier.HOST, (1,), 4, 4),
        )
        assert plan.store == ()
        assert handle.cached_tokens == 8 and handle.hits.docs_on(Tier.HOST) == 1
        cache.confirm(handle)
    assert host_used(cache) == 2
    cache.check_integrity()


def test_an_empty_root_gets_a_plan_the_connector_accepts() -> None:
    """A root of 0 tokens (an empty system prompt, no BOS): the second request must get a
    plan the connector accepts (host spans only), not one that `plan_problems` refuses and
    that then runs uncached."""
    from ragcache_core.engine.connector.spans import plan_problems

    cache = make(host=10)
    cache.confirm(cache.begin_request(0, [doc("a", 4)], 1))
    handle = cache.begin_request(0, [doc("a", 4)], 1)
    assert all(span.tier is Tier.HOST for span in handle.plan.load)
    assert plan_problems(handle.plan, prompt_len=5, page_size=4, host_slots=10) == []
    cache.confirm(handle)
    cache.check_integrity()


def test_no_capacity_at_all_stores_nothing() -> None:
    cache = make(host=0)
    for _ in range(3):
        handle = cache.begin_request(4, [doc("a", 4)], 1)
        assert handle.plan.is_empty and handle.cached_tokens == 0
        cache.confirm(handle)
    cache.check_integrity()


def test_abort_discards_unconfirmed_nodes_and_frees_slots() -> None:
    cache = make(host=10)
    handle = cache.begin_request(4, [doc("a", 4), doc("b", 4)], 0)
    assert host_used(cache) == 3
    cache.abort(handle)
    assert host_used(cache) == 0 and cache.num_nodes == 0
    with pytest.raises(RAGCacheError, match="already aborted"):
        cache.confirm(handle)
    cache.check_integrity()


def test_max_depth_caches_only_the_first_documents() -> None:
    cache = make(max_depth=1)
    run(cache, doc("a"), doc("b"), doc("c"))
    assert set(cached_paths(cache)) == {(), ("a",)}
    handle = cache.begin_request(0, [doc("a"), doc("b")], 0)
    assert len(handle.hits.doc_hits) == 1 and handle.computed_tokens == 10
    cache.confirm(handle)


def test_invalidate_drops_every_prefix_of_the_document_and_subtrees() -> None:
    cache = make()
    run(cache, doc("a"), doc("x"), doc("b"))
    run(cache, doc("x"), doc("c"))
    run(cache, doc("d"))
    assert cache.invalidate("x") == 4  # a/x, a/x/b, x, x/c
    assert set(cached_paths(cache)) == {(), ("a",), ("d",)}
    cache.check_integrity()


def test_invalidate_while_pinned_frees_slots_on_release() -> None:
    cache = make(host=10)
    run(cache, doc("a", 8), root=4)
    reader = cache.begin_request(4, [doc("a", 8)], 0)
    used = host_used(cache)
    cache.invalidate("a")
    assert cache.match([doc("a", 8)]).doc_hits == ()
    assert host_used(cache) == used  # still being read
    cache.check_integrity()
    cache.confirm(reader)
    assert host_used(cache) == 1  # the root only
    cache.check_integrity()


def test_clear_resets_everything_and_open_requests_finish_cleanly() -> None:
    cache = make(host=10)
    run(cache, doc("a"), root=4)
    writer = cache.begin_request(4, [doc("b")], 0)
    cache.clear()
    assert cache.num_nodes == 0 and cache.match([doc("a")]).hits == ()
    cache.confirm(writer)  # its nodes were detached: confirmation makes nothing readable
    assert cache.match([doc("b")]).hits == ()
    assert host_used(cache) == 0
    cache.check_integrity()


def test_losing_vllms_blocks_keeps_only_confirmed_host_copies() -> None:
    """The engine died (`drop_tier(Tier.GPU)`): its open requests are aborted (their copies
    were never confirmed), and every confirmed host copy stays."""
    cache = make(host=10, page=4)
    for name in "abc":
        run(cache, doc(name, 4), root=4)
    open_handle = cache.begin_request(4, [doc("d", 4)], 0)
    cache.drop_tier(Tier.GPU)
    assert not open_handle.is_open
    assert set(cached_paths(cache)) == {(), ("a",), ("b",), ("c",)}
    assert cache.num_nodes == 4 and host_used(cache) == 4
    cache.check_integrity()


def test_mark_final_counts_frequency_once() -> None:
    cache = make()
    handle = cache.begin_request(0, [doc("a")], 0, final=False)
    node = next(n for n in cache.iter_nodes() if n.parent is not None)
    assert node.stats.frequency == 0 and node.stats.num_computed == 1
    cache.mark_final(handle)
    cache.mark_final(handle)
    assert node.stats.frequency == 1
    cache.confirm(handle)


def test_frequency_window_restarts_counts() -> None:
    cache = make(frequency_window=2)
    for _ in range(3):
        run(cache, doc("a"))
    node = next(n for n in cache.iter_nodes() if n.parent is not None)
    assert node.stats.frequency == 1  # third final request opened a new window


def test_root_size_mismatch_and_negative_sizes_are_input_errors() -> None:
    cache = make()
    run(cache, doc("a"), root=4)
    with pytest.raises(InputError, match="root has 4 cached tokens"):
        cache.begin_request(5, [doc("a")], 0)
    with pytest.raises(InputError, match="negative"):
        DocSpec(DocKey("x", "h"), -1)
    with pytest.raises(InputError, match="negative"):
        cache.begin_request(4, [], -1)


def test_a_rejected_request_changes_nothing() -> None:
    cache = make()
    run(cache, doc("a", 10), root=4)
    before = (cache.stats(), cached_paths(cache), cache.match([doc("a", 10)]))
    with pytest.raises(InputError, match="same content hash"):
        cache.begin_request(4, [doc("a", 11)], 0)  # same key, another size
    assert (cache.stats(), cached_paths(cache), cache.match([doc("a", 10)])) == before
    assert cache.stats().open_requests == 0
    cache.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    cache = make()
    run(cache, doc("a"), root=4)
    node = next(n for n in cache.iter_nodes() if n.parent is not None)
    cache._placement.tiers[Tier.HOST].allocator.free(node.slots[Tier.HOST][:1])
    with pytest.raises(IntegrityError, match="also free"):
        cache.check_integrity()


def test_check_integrity_detects_hierarchy_violation() -> None:
    cache = make(host=20)
    run(cache, doc("a"), doc("b"), root=4)
    parent = next(n for n in cache.iter_nodes() if n.depth == 1)
    parent.slots.clear()  # b's host copy is left below a parent without one
    parent.ready.clear()
    parent.parent.tier_children[Tier.HOST] -= 1  # type: ignore[union-attr]
    with pytest.raises(IntegrityError, match="without any copy"):
        cache.check_integrity()


def _drop_from_index(cache: KnowledgeTree) -> None:
    cache._prefixes._doc_index.clear()  # the nodes stay in the tree, unlisted


def _break_parent_link(cache: KnowledgeTree) -> None:
    child = next(n for n in cache.iter_nodes() if n.depth == 2)
    child.parent = cache._prefixes.root


def _add_stray_pin(cache: KnowledgeTree) -> None:
    next(n for n in cache.iter_nodes() if n.parent is not None).pins += 1


def _miscount_pinned_slots(cache: KnowledgeTree) -> None:
    cache._placement.tiers[Tier.HOST].pinned_slots += 1


def _miscount_tier_children(cache: KnowledgeTree) -> None:
    cache._prefixes.root.tier_children[Tier.HOST] += 1


def _unconfirm_a_copy(cache: KnowledgeTree) -> None:
    next(n for n in cache.iter_nodes() if n.parent is not None).ready.clear()


def _lower_max_depth(cache: KnowledgeTree) -> None:
    cache._planner.max_depth = 1


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_drop_from_index, "missing from the document index"),
        (_break_parent_link, "inconsistent link"),
        (_add_stray_pin, "open requests hold"),
        (_miscount_pinned_slots, "pinned_slots="),
        (_miscount_tier_children, "tier_children"),
        (_unconfirm_a_copy, "unconfirmed"),
        (_lower_max_depth, "deeper than max_depth"),
    ],
)
def test_check_integrity_detects_each_parts_corruption(
    corrupt: Callable[[KnowledgeTree], None], message: str
) -> None:
    """Each part checks its own invariants: the structure (index, links), the placement
    (pins, counters, readiness) and the planner (max_depth)."""
    cache = make(host=20)
    run(cache, doc("a"), doc("b"), root=4)
    corrupt(cache)
    with pytest.raises(IntegrityError, match=message):
        cache.check_integrity()


def test_counters_count_victims_and_writes_until_clear() -> None:
    cache = KnowledgeTree(ROOT, host_slots=10, page_size=1, policy="lru")
    assert cache.counters == TreeCounters()
    seen = []
    for name in "abacd":
        run(cache, doc(name, 10))  # room for one document: each new one evicts the last
        seen.append((cache.counters.evictions_host, cache.counters.host_slots_written))
    assert seen == [(0, 10), (1, 20), (2, 30), (3, 40), (4, 50)]
    cache.clear()
    assert cache.counters == TreeCounters()


def test_counters_never_decrease_between_clears() -> None:
    cache = KnowledgeTree(ROOT, host_slots=20, page_size=2, policy="pgdsf")
    previous = (0, 0)
    for i in range(200):
        names = [f"d{(i * 7 + j * 3) % 11}" for j in range(1 + i % 3)]
        handle = cache.begin_request(3, [doc(n, 3 + len(n)) for n in names], 1)
        (cache.confirm if i % 5 else cache.abort)(handle)
        counters = cache.counters
        now = (counters.evictions_host, counters.host_slots_written)
        assert now[0] >= previous[0] and now[1] >= previous[1]
        previous = now
    assert min(previous) > 0
    cache.check_integrity()


def test_capacity_helpers() -> None:
    per_token = kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert per_token == 131072
    assert tokens_for_bytes(8 * 2**30, per_token) == 65536
    assert bytes_for_tokens(65536, per_token) == 8 * 2**30
    assert slots_for_tokens(33, 16) == 3 and slots_for_tokens(0, 16) == 0
    cache = KnowledgeTree.from_tokens(ROOT, host_tokens=33, page_size=16)
    assert cache.stats().host_slots == 2
    with pytest.raises(ConfigError):
        kv_bytes_per_token(num_layers=0, num_kv_heads=1, head_dim=1, dtype_bytes=1)


def test_allocator_double_free_and_exhaustion() -> None:
    alloc = SlotAllocator(3, page_size=16)
    slots = alloc.allocate(2)
    assert alloc.num_free == 1
    with pytest.raises(RAGCacheError):
        alloc.allocate(2)
    alloc.free(slots)
    with pytest.raises(RAGCacheError, match="twice"):
        alloc.free(slots[:1])


def test_different_roots_never_share_kv() -> None:
    other = RootKey("model", "tokenizer", "another system prompt", "float16")
    assert other != ROOT
    a, b = make(), KnowledgeTree(other, host_slots=10, page_size=4)
    run(a, doc("x"), root=4)
    assert b.match([doc("x")]).hits == ()


def test_load_and_store_spans_tile_the_prompt_prefix() -> None:
    cache = make(host=100, page=3)
    run(cache, doc("a", 5), doc("b", 7), root=4)
    handle = cache.begin_request(4, [doc("a", 5), doc("b", 7), doc("c", 2)], 6)
    spans: list[LoadSpan | StoreSpan] = [*handle.plan.load, *handle.plan.store]
    position = 0
    for span in spans:
        assert span.token_start == position
        assert len(span.slots) == slots_for_tokens(span.num_tokens, 3)
        position += span.num_tokens
    assert position == 4 + 5 + 7 + 2
    cache.confirm(handle)


def test_a_failed_load_removes_only_the_node_it_read() -> None:
    cache = make()
    run(cache, doc("a"), doc("x"), doc("b"), root=4)
    run(cache, doc("x"), doc("c"), root=4)
    reader = cache.begin_request(4, [doc("a"), doc("x"), doc("b")], 2)
    cache.confirm(reader)  # confirmed at its first token; the final report comes later
    # Load spans: 0 = root, 1 = a, 2 = a/x, 3 = a/x/b. Span 2 failed.
    assert cache.invalidate_loads(reader, [2]) == 2  # a/x and its subtree a/x/b
    assert set(cached_paths(cache)) == {(), ("a",), ("x",), ("x", "c")}
    cache.check_integrity()


def test_a_failed_root_load_empties_the_tree_but_keeps_the_policys_clocks() -> None:
    cache = make(host=6, policy="pgdsf")  # a policy with clocks
    for name in "abcdef":  # evictions move the host clock
        run(cache, doc(name, 8), root=4)
    clock = cache.policy.clocks[Tier.HOST]  # type: ignore[attr-defined]
    assert clock > 0
    reader = cache.begin_request(4, [doc("f", 8)], 2)
    cache.invalidate_loads(reader, [0])
    assert cache.num_nodes == 0 and cache.policy.clocks[Tier.HOST] == clock  # type: ignore[attr-defined]
    cache.confirm(reader)  # its pinned nodes are freed now
    assert host_used(cache) == 0
    cache.check_integrity()


def test_copies_of_a_plan_that_did_not_run_are_dropped() -> None:
    cache = make()
    run(cache, doc("a"), root=4)
    writer = cache.begin_request(4, [doc("a"), doc("b"), doc("c")], 2)
    cache.confirm(writer)
    assert cache.invalidate_written(writer) == 2  # a/b and a/b/c
    assert set(cached_paths(cache)) == {(), ("a",)}
    cache.check_integrity()


def test_store_policy_second_stores_a_document_on_its_second_retrieval() -> None:
    cache = make(store_policy="second")
    run(cache, doc("a"), root=4)
    assert set(cached_paths(cache)) == {()}  # the root is always stored; "a" seen once
    run(cache, doc("a"), root=4)
    assert set(cached_paths(cache)) == {(), ("a",)}
    run(cache, doc("b"), doc("a"), root=4)  # another prefix: seen once again
    assert set(cached_paths(cache)) == {(), ("a",)}


def test_store_policy_no_evict_never_evicts_to_store() -> None:
    cache = make(host=4, store_policy="no_evict")  # root 1 slot + a 3 slots
    run(cache, doc("a", 12), root=4)
    run(cache, doc("b", 12), root=4)
    assert set(cached_paths(cache)) == {(), ("a",)}
    with pytest.raises(ConfigError, match="store_policy"):
        make(store_policy="sometimes")
