"""The request lifecycle's steps (`runtime.lifecycle.Lifecycle`) on a real tree, no engine: the
plan check before submit, the first-token confirmation, the final report's settlement, and
`served_hits` (vLLM's own prefix-cache hit is the GPU tier, the connector's loads the host
tier)."""

from __future__ import annotations

import logging

import pytest

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.plan import Tier
from ragcache_core.runtime.lifecycle import Lifecycle, served_hits
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.storage.pool_layout import PoolLayout
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RequestState, RootKey

PAGE = 4
BLOCK = 8  # vLLM's block size in these tests
ROOT = RootKey("model", "tokenizer", "template", "float32")


def _connector(host_slots: int = 64) -> ConnectorConfig:
    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=PAGE)
    return ConnectorConfig(layout=layout, host_slots=host_slots, host_pool_name="test")


def _lifecycle(host_slots: int = 64) -> Lifecycle:
    """A lifecycle over a fresh tree of 64 host slots; its connector view has `host_slots`."""
    tree = KnowledgeTree(ROOT, host_slots=64, page_size=PAGE)
    return Lifecycle(tree, _connector(host_slots))


def _prompt(*names: str) -> BuiltPrompt:
    docs = tuple((7,) * 10 for _ in names)
    return BuiltPrompt(
        root_ids=(1,) * 6,
        doc_ids=docs,
        question_ids=(2,) * 3,
        doc_specs=tuple(DocSpec(DocKey(n, f"h-{n}"), 10) for n in names),
    )


def _stored() -> ConnectorResult:
    return ConnectorResult(store_scheduled=True, stored=True)


def test_a_request_confirmed_at_its_first_token_serves_the_next() -> None:
    life = _lifecycle()
    tree = life.tree
    handle, plan = life.open(_prompt("a"), final=True)
    assert plan is handle.plan and plan.store
    # No GPU tier in the tree: the root and the document are stored on the host tier.
    assert [span.tier for span in plan.store] == [Tier.HOST, Tier.HOST]
    life.first_token(handle)
    assert handle.state is RequestState.CONFIRMED
    assert tree.stats().pinned_nodes == 0
    assert life.settle(handle, _stored())
    again, plan = life.open(_prompt("a"), final=True)
    assert plan is not None and plan.num_loaded_tokens == 16
    assert [span.tier for span in plan.load] == [Tier.HOST, Tier.HOST]
    # vLLM had nothing cached: the connector loaded all 16 tokens from the host pool.
    result = ConnectorResult(loaded_tokens=16, external_tokens=16, host_tokens=16)
    life.first_token(again)
    assert life.settle(again, result)
    hits, doc_tokens = served_hits(again, result, _prompt("a"), 16, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.computed_docs) == (0, 1, 0)
    assert (hits.cached_tokens, hits.computed_tokens, doc_tokens) == (16, 3, 10)
    assert hits.root_cached
    tree.check_integrity()


def test_a_plan_the_connector_would_refuse_is_never_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    life = _lifecycle(host_slots=2)  # the tree plans slots the connector's pool lacks
    tree = life.tree
    with caplog.at_level(logging.ERROR):
        handle, plan = life.open(_prompt("a"), final=True)
    assert plan is None and handle.state is RequestState.ABORTED
    assert "invalid plan" in caplog.text
    assert tree.stats().pinned_nodes == 0
    # Nothing went out, so an empty report settles nothing and counts nothing as read.
    assert not life.settle(handle, ConnectorResult())
    hits, _ = served_hits(handle, ConnectorResult(), _prompt("a"), 0, BLOCK)
    assert (hits.hit_docs, hits.computed_docs, hits.computed_tokens) == (0, 1, 19)
    assert not hits.root_cached
    tree.check_integrity()


def test_a_lifecycle_of_a_tree_alone_checks_plans_against_the_trees_sizes() -> None:
    """`Lifecycle.of` (the simulator's, `bench overhead`'s): no connector, so plans are
    checked against the tree's own page size and host slots, and they pass."""
    tree = KnowledgeTree(ROOT, host_slots=8, page_size=PAGE)
    life = Lifecycle.of(tree)
    handle, plan = life.open(_prompt("a"), final=True)
    assert plan is not None and plan.store and handle.is_open
    life.first_token(handle)
    handle, plan = life.open(_prompt("a"), final=True)
    assert plan is not None and plan.load
    life.first_token(handle)
    life.tree.check_integrity()


def test_an_open_handle_is_settled_by_the_report() -> None:
    life = _lifecycle()
    tree = life.tree
    handle, _ = life.open(_prompt("a"), final=True)
    assert not life.settle(handle, ConnectorResult(rejected=("bad slot",)))
    assert handle.state is RequestState.ABORTED
    assert tree.match([DocKey("a", "h-a")]).cached_tokens == 0
    handle, _ = life.open(_prompt("a"), final=True)
    assert life.settle(handle, _stored())
    assert tree.match([DocKey("a", "h-a")]).cached_tokens == 16
    tree.check_integrity()


def test_a_confirmed_request_whose_stores_did_not_run_leaves_the_tree(
    caplog: pytest.LogCaptureFixture,
) -> None:
    life = _lifecycle()
    tree = life.tree
    handle, _ = life.open(_prompt("a"), final=True)
    life.first_token(handle)
    with caplog.at_level(logging.ERROR):
        assert not life.settle(handle, ConnectorResult(store_scheduled=True, stored=False))
    assert "did not run a confirmed plan" in caplog.text
    assert tree.match([DocKey("a", "h-a")]).cached_tokens == 0
    tree.check_integrity()


def _two_docs_in_the_tree() -> tuple[Lifecycle, BuiltPrompt]:
    """A lifecycle whose tree holds root + a + b (host tier), confirmed."""
    life = _lifecycle()
    prompt = _prompt("a", "b")
    handle, plan = life.open(prompt, final=True)
    assert plan is not None
    life.first_token(handle)
    assert life.settle(handle, _stored())
    return life, prompt


def test_served_hits_counts_docs_inside_vllms_hit_as_gpu_and_the_rest_as_host() -> None:
    """Prompt: root 0..6, a 6..16, b 16..26, question 26..29. vLLM's own prefix cache held
    0..16 (two blocks of 8): a is a GPU hit; the connector loaded 16..26 from the host pool:
    b is a host hit."""
    life, prompt = _two_docs_in_the_tree()
    handle, plan = life.open(prompt, final=True)
    assert plan is not None and plan.num_loaded_tokens == 26
    result = ConnectorResult(loaded_tokens=10, external_tokens=10, gpu_tokens=16, host_tokens=10)
    life.first_token(handle)
    assert life.settle(handle, result)
    hits, doc_tokens = served_hits(handle, result, prompt, 26, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.computed_docs) == (1, 1, 0)
    assert (hits.cached_tokens, hits.computed_tokens, doc_tokens) == (26, 3, 20)
    assert hits.root_cached
    # Everything in vLLM's cache: both GPU hits, nothing loaded.
    full = ConnectorResult(gpu_tokens=26)
    hits, doc_tokens = served_hits(handle, full, prompt, 26, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.cached_tokens, doc_tokens) == (2, 0, 26, 20)
    # vLLM's hit ends inside a (block aligned at 8): a and b both came from the host pool.
    part = ConnectorResult(loaded_tokens=18, external_tokens=18, gpu_tokens=8, host_tokens=18)
    hits, doc_tokens = served_hits(handle, part, prompt, 26, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.cached_tokens, doc_tokens) == (0, 2, 26, 20)
    life.tree.check_integrity()


def test_served_hits_keeps_vllms_own_hit_when_the_tree_served_nothing() -> None:
    """vLLM's blocks are keyed by token ids: its hit counts even for a request whose plan was
    refused or whose load failed; the tree's planned documents past it do not."""
    life, prompt = _two_docs_in_the_tree()
    handle, plan = life.open(prompt, final=True)
    assert plan is not None
    refused = ConnectorResult(rejected=("bad slot",), gpu_tokens=16)
    assert not life.settle(handle, refused)
    hits, doc_tokens = served_hits(handle, refused, prompt, 16, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.computed_docs) == (1, 0, 1)
    assert (hits.cached_tokens, hits.computed_tokens, doc_tokens) == (16, 13, 10)
    # vLLM held 0..8; the connector took 8..26 and span 2 (b, from 16) failed: 8..16 came from
    # the host pool. Those tokens count as served, but no planned document counts as read.
    handle, plan = life.open(prompt, final=True)
    assert plan is not None
    failed = ConnectorResult(
        loaded_tokens=8, external_tokens=18, gpu_tokens=8, host_tokens=8, failed_load_spans=(2,)
    )
    life.settle(handle, failed)
    hits, doc_tokens = served_hits(handle, failed, prompt, 26, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.computed_docs) == (0, 0, 2)
    assert (hits.cached_tokens, hits.computed_tokens, doc_tokens) == (16, 13, 0)
    assert hits.root_cached
    life.tree.check_integrity()


def test_served_hits_counts_a_doc_vllm_holds_that_the_tree_does_not() -> None:
    """After `clear()` the tree is empty but vLLM may keep its prefix cache (requests held
    blocks): a document fully inside vLLM's hit is still a GPU hit."""
    life = _lifecycle()
    prompt = _prompt("a")
    handle, plan = life.open(prompt, final=True)  # nothing in the tree: compute and store
    assert plan is not None and plan.num_loaded_tokens == 0
    hits, doc_tokens = served_hits(handle, ConnectorResult(gpu_tokens=16), prompt, 16, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.cached_tokens, doc_tokens) == (1, 0, 16, 10)
    life.abort(handle)
    life.tree.check_integrity()


def test_served_hits_counts_a_doc_whose_tail_block_was_recomputed_as_a_gpu_hit() -> None:
    """Prompt: root 0..6, a 6..16, b 16..26, question 26..29, blocks of 8. vLLM held 0..24:
    b's last block (24..32) is shared with the question, so a new question misses it. With
    nothing on the host tier (written at eviction, b still in vLLM's blocks) b's tail, 24..26,
    is recomputed: b is a GPU hit covering 8 tokens, not a computed document."""
    life = _lifecycle()
    prompt = _prompt("a", "b")
    handle, plan = life.open(prompt, final=True)  # nothing in the tree
    assert plan is not None and plan.num_loaded_tokens == 0
    hits, doc_tokens = served_hits(handle, ConnectorResult(gpu_tokens=24), prompt, 24, BLOCK)
    assert (hits.gpu_docs, hits.host_docs, hits.computed_docs) == (2, 0, 0)
    assert (hits.cached_tokens, hits.computed_tokens, doc_tokens) == (24, 5, 18)
    # vLLM held 0..16 only: b's full block 16..24 was computed, so b is computed.
    hits, doc_tokens = served_hits(handle, ConnectorResult(gpu_tokens=16), prompt, 16, BLOCK)
    assert (hits.gpu_docs, hits.computed_docs, doc_tokens) == (1, 1, 10)
    life.abort(handle)
    life.tree.check_integrity()


def test_a_cache_ordered_request_is_scored_in_the_order_it_will_be_served() -> None:
    # Issue 40: the queue scores a document_order="cache" request by the hits of the order
    # that follows the tree now, not of the order its prompt was first built in.
    life = _lifecycle()
    handle, _ = life.open(_prompt("a", "b"), final=True)
    life.first_token(handle)
    assert life.settle(handle, _stored())
    swapped = _prompt("b", "a")
    total = swapped.num_tokens
    assert life.score(swapped) == (6, total - 6)  # the root only: b is not cached first
    assert life.score_ordered(swapped) == (26, total - 26)  # root + a + b, served [a, b]


def test_a_report_of_its_own_documents_gone_is_applied_after_the_confirmation() -> None:
    """The synchronous path confirms at the report: a span the engine could not follow, which
    the same report names gone, must not stay marked as held in vLLM's blocks."""
    tree = KnowledgeTree(
        ROOT, host_slots=64, page_size=PAGE, host_write="eviction", host_lease_slots=8
    )
    life = Lifecycle(tree, _connector())
    handle, plan = life.open(_prompt("a"), final=True)
    assert plan is not None and plan.lease is not None and len(plan.keep) == 2
    gone = tuple((span.key, plan.lease.version) for span in plan.keep)
    assert life.settle(handle, ConnectorResult(host_gone=gone, reported=True))
    assert handle.state is RequestState.CONFIRMED
    assert [node for node in tree.iter_nodes() if node.resident] == []
    tree.check_integrity()
