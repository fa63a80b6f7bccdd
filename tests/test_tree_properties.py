"""Property tests: random request lifecycles keep every invariant of the cache."""

from __future__ import annotations

from typing import Any

from _tree_helpers import ROOT, doc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragcache_core.plan import Tier
from ragcache_core.policy import POLICIES
from ragcache_core.tree import KnowledgeTree, RequestHandle
from ragcache_core.tree.node import Node

DOCS = [doc(name, tokens) for name, tokens in zip("abcdef", [3, 5, 8, 1, 13, 4], strict=True)]

begin = st.tuples(
    st.just("begin"),
    st.lists(st.integers(0, len(DOCS) - 1), min_size=0, max_size=4),
    st.booleans(),  # final
)
finish = st.tuples(st.sampled_from(["confirm", "abort"]), st.integers(0, 7))
maintenance = st.one_of(
    st.tuples(st.just("invalidate"), st.integers(0, len(DOCS) - 1)),
    st.tuples(st.just("drop_gpu")),
    st.tuples(st.just("clear")),
    st.tuples(st.just("mark_final"), st.integers(0, 7)),
)
operation = st.one_of(begin, begin, finish, finish, maintenance)


def _held(
    handle: RequestHandle, others: list[tuple[RequestHandle, Any]]
) -> list[tuple[Node, dict[Tier, tuple[int, ...]]]]:
    """The copies `handle`'s pinned nodes have and that are complete: a copy another open
    request is still writing is not one a pin keeps (its writer's abort drops it; the tree
    found this with a root's host backup that the aborted writer was storing)."""
    writing = {(id(n), tier) for h, _ in others for n, tier in h.ledger.pending}
    return [
        (
            node,
            {tier: slots for tier, slots in node.slots.items() if (id(node), tier) not in writing},
        )
        for node in handle.ledger.pins
    ]


def _check_pins(open_handles: list[tuple[RequestHandle, Any]]) -> None:
    """Every copy a pinned node had when pinned is still there, on the same slots."""
    for _, held in open_handles:
        for node, copies in held:
            for tier, slots in copies.items():
                assert node.slots.get(tier) == slots, f"{node!r} lost its pinned {tier} copy"


def _check_no_orphans(cache: KnowledgeTree) -> None:
    for node in cache.iter_nodes():
        if node.parent is not None:
            assert node.parent.slots, f"{node!r} below a freed parent"


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    host=st.integers(0, 16),
    page=st.integers(1, 4),
    root_tokens=st.integers(0, 6),
    max_depth=st.one_of(st.none(), st.integers(0, 3)),
    ops=st.lists(operation, min_size=1, max_size=40),
)
def test_random_lifecycles_keep_invariants(
    policy: str,
    host: int,
    page: int,
    root_tokens: int,
    max_depth: int | None,
    ops: list[tuple[Any, ...]],
) -> None:
    cache = KnowledgeTree(
        ROOT,
        host_slots=host,
        page_size=page,
        policy=policy,
        max_depth=max_depth,
    )
    open_handles: list[tuple[RequestHandle, Any]] = []
    for op in ops:
        kind = op[0]
        if kind == "begin":
            handle = cache.begin_request(root_tokens, [DOCS[i] for i in op[1]], 2, final=op[2])
            plan = handle.plan
            loaded = sum(s.num_tokens for s in plan.load)
            assert loaded == handle.cached_tokens
            for span in plan.store:  # stores start where the loaded prefix ends, or later
                assert span.token_start >= loaded
            for span in (*plan.load, *plan.store):  # the host tier's slots, and only those
                assert span.tier is Tier.HOST and all(s < host for s in span.slots)
            open_handles.append((handle, _held(handle, open_handles)))
        elif kind in ("confirm", "abort") and open_handles:
            handle, _ = open_handles.pop(op[1] % len(open_handles))
            (cache.confirm if kind == "confirm" else cache.abort)(handle)
        elif kind == "mark_final" and open_handles:
            cache.mark_final(open_handles[op[1] % len(open_handles)][0])
        elif kind == "invalidate":
            cache.invalidate(DOCS[op[1]].key.doc_id)
        elif kind == "drop_gpu":
            used = cache.stats().host_used_slots
            cache.drop_tier(Tier.GPU)  # the engine died: its requests go, the host tier stays
            assert all(not h.is_open for h, _ in open_handles)
            open_handles = []
            assert cache.stats().host_used_slots <= used
        elif kind == "clear":
            cache.clear()
        cache.check_integrity()
        _check_pins(open_handles)
        _check_no_orphans(cache)
    for handle, _ in open_handles:
        cache.confirm(handle)
    cache.check_integrity()
    stats = cache.stats()
    assert stats.pinned_nodes == 0 and stats.open_requests == 0


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    stream=st.lists(st.lists(st.integers(0, len(DOCS) - 1), max_size=3), max_size=30),
    host=st.sampled_from([10, 20]),
)
def test_sequential_stream_hits_equal_match_before_begin(
    policy: str, stream: list[list[int]], host: int
) -> None:
    """With one request at a time, what `match` reports is exactly what the request loads."""
    cache = KnowledgeTree(ROOT, host_slots=host, page_size=2, policy=policy)
    for ids in stream:
        docs = [DOCS[i] for i in ids]
        predicted = cache.match(docs)
        assert cache.cached_tokens(docs) == predicted.cached_tokens
        handle = cache.begin_request(3, docs, 1)
        assert handle.hits == predicted
        cache.confirm(handle)
