"""`document_order="cache"`: the order of a request's documents that follows the cached path
(issue 40), a pure function of the document set and the tree state."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import pytest
from _tree_helpers import ROOT, doc, run
from hypothesis import given, settings
from hypothesis import strategies as st

from ragcache_core.config import CacheConfig, check_document_order
from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.runtime.speculation import _Run, served_order
from ragcache_core.tree import DocSpec, KnowledgeTree, cache_order

A, B, C, D = doc("a", 5), doc("b", 10), doc("c", 8), doc("d", 8)


def tree(max_depth: int | None = None) -> KnowledgeTree:
    return KnowledgeTree.from_tokens(ROOT, host_tokens=10_000, page_size=1, max_depth=max_depth)


def apply_order(docs: Sequence[DocSpec], order: Sequence[int]) -> list[DocSpec]:
    """`docs` in the served `order` (retrieval ranks, as `cache_order` returns them)."""
    assert sorted(order) == list(range(len(docs))), order
    return [docs[rank] for rank in order]


def served_hits(cache: KnowledgeTree, docs: list[DocSpec]) -> int:
    return cache.cached_tokens(apply_order(docs, cache.cache_order(docs)))


def test_empty_tree_keeps_retrieval_order() -> None:
    assert tree().cache_order([B, A, C]) == (0, 1, 2)


def test_reversed_retrieval_follows_the_cached_path() -> None:
    # The case: the tree holds A -> B, the request retrieves [B, A].
    cache = tree()
    run(cache, A, B)
    assert cache.cached_tokens([B, A]) == 0
    assert cache.cache_order([B, A]) == (1, 0)
    assert served_hits(cache, [B, A]) == 15


def test_uncached_rest_keeps_retrieval_order() -> None:
    cache = tree()
    run(cache, A, B)
    # C and D are not cached: after A -> B they follow in retrieval order (D before C).
    assert cache.cache_order([D, B, C, A]) == (3, 1, 0, 2)


def test_prefers_the_most_cached_tokens_and_ties_go_by_rank() -> None:
    cache = tree()
    run(cache, A)
    run(cache, C)
    run(cache, D)
    assert cache.cache_order([A, C]) == (1, 0)  # C (8 tokens) over A (5)
    assert cache.cache_order([D, C]) == (0, 1)  # 8 and 8: retrieval rank decides
    assert cache.cache_order([C, D]) == (0, 1)


def test_looks_along_the_whole_path_not_one_node() -> None:
    # root -> B(10) is bigger than root -> A(5), but A -> B holds 15 along its path.
    cache = tree()
    run(cache, A, B)
    run(cache, B)
    assert cache.cache_order([B, A]) == (1, 0)
    assert served_hits(cache, [B, A]) == 15


def test_bare_document_ids_match_any_node_of_that_id() -> None:
    # The runtime orders before it builds (node keys depend on the order), so it orders by id.
    cache = tree()
    run(cache, A, B)
    assert cache.cache_order(["b", "a", "c"]) == (1, 0, 2)
    assert cache.cache_order(["b", A]) == (1, 0)  # ids and specs mix


def test_max_depth_bounds_the_walk() -> None:
    cache = tree()
    run(cache, A, B)
    prefixes = cache._prefixes  # the pure function over the same tree, with a bound
    assert cache_order(prefixes, [C, B, A]) == (2, 1, 0)
    assert cache_order(prefixes, [C, B, A], max_depth=1) == (2, 0, 1)
    assert cache_order(prefixes, [C, B, A], max_depth=0) == (0, 1, 2)
    bounded = tree(max_depth=1)
    run(bounded, A, B)
    assert bounded.cache_order([C, B, A]) == (2, 0, 1)


def test_never_crosses_a_root() -> None:
    cache = tree()
    salted = replace(ROOT, salt="tenant")
    cache.confirm(cache.begin_request(0, [A, B], 0, root_key=salted))
    assert cache.cache_order([B, A]) == (0, 1)  # the default root holds nothing
    assert cache.cache_order([B, A], root_key=salted) == (1, 0)
    assert cache.cache_order([B, A], root_key=replace(ROOT, salt="other")) == (0, 1)


def test_in_flight_nodes_are_not_followed() -> None:
    cache = tree()
    handle = cache.begin_request(0, [A, B], 0)
    assert cache.cache_order([B, A]) == (0, 1)  # A -> B is still being written
    cache.confirm(handle)
    assert cache.cache_order([B, A]) == (1, 0)


def test_invalidated_documents_are_not_followed() -> None:
    cache = tree()
    run(cache, A, B)
    cache.invalidate("a")
    assert cache.cache_order([B, A]) == (0, 1)


def test_ordering_reads_without_changing_the_tree() -> None:
    cache = tree()
    run(cache, A, B)
    before = cache.counters, cache.stats()
    for _ in range(3):
        cache.cache_order([B, A, C])
    assert (cache.counters, cache.stats()) == before


def test_document_order_values_are_checked() -> None:
    assert check_document_order("cache") == "cache"
    assert check_document_order("retrieval") == "retrieval"
    with pytest.raises(InputError, match="unknown document_order 'random'"):
        check_document_order("random")
    with pytest.raises(ConfigError, match="unknown document_order 'Cache'"):
        CacheConfig(document_order="Cache")
    assert CacheConfig().document_order == "retrieval"


# ------------------------------------------------------------------ properties

POOL = [doc(name, tokens) for name, tokens in zip("abcdef", [3, 5, 8, 1, 13, 4], strict=True)]
paths = st.lists(st.permutations(range(len(POOL))).map(lambda p: p[:4]), max_size=8)
requests = st.permutations(range(len(POOL))).flatmap(
    lambda p: st.integers(0, 4).map(lambda k: list(p[:k]))
)


def build(stored: list[list[int]], max_depth: int | None = None) -> KnowledgeTree:
    cache = tree(max_depth)
    for path in stored:
        run(cache, *(POOL[i] for i in path))
    return cache


@settings(max_examples=150, deadline=None)
@given(paths, requests, st.sampled_from([None, 1, 2]))
def test_served_order_hits_the_most_any_order_can(
    stored: list[list[int]], picked: list[int], max_depth: int | None
) -> None:
    cache = build(stored, max_depth)
    docs = [POOL[i] for i in picked]
    order = cache.cache_order(docs)
    assert sorted(order) == list(range(len(docs)))
    served = cache.cached_tokens(apply_order(docs, order))
    best = max(
        (cache.cached_tokens(list(p)) for p in itertools.permutations(docs)),
        default=0,
    )
    assert served == best >= cache.cached_tokens(docs)
    ranks, hits = cache.ordered_hits(docs)
    assert ranks == order and hits == served  # the queue's score is the served order's hits
    assert cache.cache_order([d.key.doc_id for d in docs]) == order  # one text per id here


@settings(max_examples=150, deadline=None)
@given(paths, requests)
def test_order_depends_on_the_set_and_the_tree_only_through_ranks(
    stored: list[list[int]], picked: list[int]
) -> None:
    cache = build(stored)
    docs = [POOL[i] for i in picked]
    order = cache.cache_order(docs)
    # Deterministic for a given tree state, and the uncached tail keeps retrieval order.
    assert cache.cache_order(docs) == order
    hit_docs = len(cache.match(apply_order(docs, order)).doc_hits)
    tail = order[hit_docs:]
    assert list(tail) == sorted(tail)
    # The cached part is a function of the set: another retrieval order of the same documents
    # serves the same cached documents, so the same prompt prefix.
    shuffled = list(reversed(docs))
    again = apply_order(shuffled, cache.cache_order(shuffled))
    assert cache.cached_tokens(again) == cache.cached_tokens(apply_order(docs, order))


# ------------------------------------------------------------------ speculation's rule


def _spec(served: list[str], any_order: bool) -> _Run:
    # Only the ids it served and its mode matter to the rule (no task, no chunks).
    return _Run((), tuple(served), any_order, None, 0.0, None)  # type: ignore[arg-type]


def _docs(*ids: str) -> tuple[Document, ...]:
    return tuple(Document(i, f"text {i}") for i in ids)


def test_a_speculation_is_reused_only_for_the_same_prompt() -> None:
    # Retrieval order: the same ids one for one.
    assert served_order(_spec(["a", "b"], False), _docs("a", "b")) == (0, 1)
    assert served_order(_spec(["a", "b"], False), _docs("b", "a")) is None
    # Cache order: the final documents arranged as the speculation served its own.
    assert served_order(_spec(["a", "b"], True), _docs("b", "a")) == (1, 0)
    assert served_order(_spec(["b", "a", "c"], True), _docs("c", "a", "b")) == (2, 1, 0)
    assert served_order(_spec(["a", "b"], True), _docs("a", "c")) is None
    assert served_order(_spec(["a", "b"], True), _docs("a", "b", "c")) is None


def test_documents_found_in_a_clients_text_are_never_reordered() -> None:
    from ragcache_core.app_prompt import Framing
    from ragcache_core.serve.jobs import CachedJob

    framing = Framing(document_order="cache")
    sent = CachedJob("q", _docs("a", "b"), (1, 2), framing)
    assert sent.document_order == "cache"
    found = CachedJob("q", _docs("a", "b"), (1, 2), framing, found=True)
    assert found.document_order == "retrieval"  # that text is the client's prompt
    assert CachedJob("q", _docs("a"), (1,)).document_order is None  # the server's default
