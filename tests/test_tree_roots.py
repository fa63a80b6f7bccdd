"""The knowledge tree as a forest: one root per system prompt (or tenant salt), one budget."""

from __future__ import annotations

import pytest
from _tree_helpers import doc, make

from ragcache_core.errors import InputError
from ragcache_core.tree import DocSpec, KnowledgeTree, RootKey


def _root(template: str, salt: str = "") -> RootKey:
    return RootKey("model", "tokenizer", template, "float16", salt)


def _run_under(cache: KnowledgeTree, root: RootKey, *docs: DocSpec, root_tokens: int = 4) -> None:
    cache.confirm(cache.begin_request(root_tokens, list(docs), 2, root_key=root))
    cache.check_integrity()


def test_two_system_prompts_are_two_roots_each_hitting_its_own_documents() -> None:
    cache = make(host=100, page=4)
    one, two = _root("system-one"), _root("system-two")
    _run_under(cache, one, doc("a"), doc("b"))
    _run_under(cache, two, doc("a"), doc("c"))
    assert cache.num_roots == 2 and cache.stats().roots == 2
    hit_one = cache.match([doc("a"), doc("b")], one)
    assert [h.key for h in hit_one.doc_hits] == [doc("a").key, doc("b").key]
    # Root two holds its own copy of "a" (computed after its own system prompt), never "b".
    hit_two = cache.match([doc("a"), doc("b")], two)
    assert [h.key for h in hit_two.doc_hits] == [doc("a").key]
    assert cache.match([doc("a")]).hits == ()  # the default root was never used
    handle = cache.begin_request(4, [doc("a"), doc("c")], 2, root_key=two)
    assert handle.plan.store == () and len(handle.plan.load) == 3  # all hits, root included
    cache.confirm(handle)
    assert cache.invalidate("a") == 4  # both copies of "a" and what hangs below them
    cache.check_integrity()
    cache.clear()
    assert cache.num_roots == 0 and cache.num_nodes == 0
    cache.check_integrity()


def test_salted_roots_never_share_a_node() -> None:
    cache = make(host=100, page=4)
    tenant_a, tenant_b = _root("t", "salt-a"), _root("t", "salt-b")
    _run_under(cache, tenant_a, doc("a"))
    assert cache.match([doc("a")], tenant_b).hits == ()
    handle = cache.begin_request(4, [doc("a")], 2, root_key=tenant_b)
    assert handle.cached_tokens == 0 and handle.stored_root and handle.stored_docs == 1
    cache.confirm(handle)
    assert cache.num_roots == 2


def test_roots_share_one_budget_and_are_evicted_with_their_subtrees() -> None:
    """One memory budget over every root: filling it under one root evicts another root's
    leaves first, then the root itself once it is a leaf."""
    cache = make(host=12, page=4, policy="lru")  # 12 slots of 4 tokens
    old, new = _root("old"), _root("new")
    _run_under(cache, old, doc("a", 8), doc("b", 8))  # root 1 + 2 + 2 slots
    for name in "cdefghi":  # 1 + 7 x 2 slots: no room left for the old root
        _run_under(cache, new, doc(name, 8))
    assert old not in {n.key for n in cache.iter_nodes()}
    assert cache.num_roots == 1 and cache.counters.evictions_host >= 3
    assert cache.match([doc("a")], old).hits == ()


def test_a_root_of_another_size_under_the_same_key_is_refused() -> None:
    cache = make()
    key = _root("x")
    _run_under(cache, key, doc("a"), root_tokens=4)
    with pytest.raises(InputError, match="different root key"):
        cache.begin_request(5, [doc("a")], 2, root_key=key)
    cache.check_integrity()
