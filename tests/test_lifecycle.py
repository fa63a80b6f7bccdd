"""The request lifecycle's steps (`runtime.lifecycle.Lifecycle`) on a real tree, no engine: the
plan check before submit, the first-token confirmation, the final report's settlement."""

from __future__ import annotations

import logging

import pytest

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.runtime.lifecycle import Lifecycle, served_hits
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.storage.pool_layout import PoolLayout
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RequestState, RootKey

PAGE = 4
ROOT = RootKey("model", "tokenizer", "template", "float32")


def _connector(gpu_slots: int = 64) -> ConnectorConfig:
    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=PAGE)
    return ConnectorConfig(layout=layout, gpu_slots=gpu_slots)


def _lifecycle(gpu_slots: int = 64) -> Lifecycle:
    """A lifecycle over a fresh tree; its connector view has `gpu_slots` (the tree 64)."""
    tree = KnowledgeTree(ROOT, gpu_slots=64, host_slots=0, page_size=PAGE)
    return Lifecycle(tree, _connector(gpu_slots))


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
    life.first_token(handle)
    assert handle.state is RequestState.CONFIRMED
    assert tree.stats().pinned_nodes == 0
    assert life.settle(handle, _stored())
    again, plan = life.open(_prompt("a"), final=True)
    assert plan is not None and plan.num_loaded_tokens == 16
    result = ConnectorResult(loaded_tokens=16, gpu_tokens=16)
    life.first_token(again)
    life.settle(again, result)
    hits, doc_tokens = served_hits(again, result, _prompt("a"))
    assert (hits.gpu_docs, hits.computed_docs, hits.cached_tokens, doc_tokens) == (1, 0, 16, 10)
    tree.check_integrity()


def test_a_plan_the_connector_would_refuse_is_never_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    life = _lifecycle(gpu_slots=2)
    tree = life.tree
    with caplog.at_level(logging.ERROR):
        handle, plan = life.open(_prompt("a"), final=True)
    assert plan is None and handle.state is RequestState.ABORTED
    assert "invalid plan" in caplog.text
    assert tree.stats().pinned_nodes == 0
    # Nothing went out, so an empty report settles nothing and counts nothing as read.
    assert not life.settle(handle, ConnectorResult())
    hits, _ = served_hits(handle, ConnectorResult(), _prompt("a"))
    assert (hits.hit_docs, hits.computed_docs, hits.computed_tokens) == (0, 1, 19)
    tree.check_integrity()


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
