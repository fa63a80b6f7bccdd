"""RAGCache end to end on the tiny model and the real vLLM engine: system prompts (one root
each), tenants (salted roots that never share a node) and the cache's document order (the
cached path served exactly, the benchmark's order check, speculation reused). The RAGCache and
the exactness reference are `_ragcache_shared`'s.
"""

from __future__ import annotations

import asyncio

import pytest
from _ragcache_shared import (
    DOCS,
    ScriptedSource,
    metric,
    reference,
)

from ragcache_core import QueryResult
from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.runtime.ragcache import RAGCache

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("settled_after")]


def _app(system: str) -> AppPrompt:
    return AppPrompt(
        messages=(
            {"role": "system", "content": system},
            {"role": "user", "content": "Context:\n" + CONTEXT + "Question: " + QUESTION},
        )
    )


def test_two_system_prompts_are_both_cached_each_hitting_its_own_documents(
    cache: RAGCache,
) -> None:
    cache.clear()
    brief, polite = _app("Answer in one word."), _app("Answer politely, in full sentences.")
    docs = [DOCS[2], DOCS[3]]
    for app in (brief, polite):  # each its own root: the second computes everything again
        first = cache.generate("Capital of Italy?", docs, prompt=app)
        assert first.hits.hit_docs == 0 and not first.hits.root_cached
        assert first.token_ids == reference(cache, "Capital of Italy?", docs, app)
    for app in (brief, polite):
        again = cache.generate("Capital of Spain?", docs, prompt=app)
        assert again.hits.hit_docs == 2 and again.hits.root_cached
        assert again.token_ids == reference(cache, "Capital of Spain?", docs, app)
    assert cache.stats()["tree"]["roots"] == 2 and metric(cache, "ragcache_roots") == 2
    assert len([n for n in cache.tree.iter_nodes() if getattr(n.key, "doc_id", "") == "d2"]) == 2


def test_tenants_never_hit_each_others_nodes(cache: RAGCache) -> None:
    cache.clear()
    docs = [DOCS[4]]
    first = cache.generate("Capital of Austria?", docs, cache_salt="tenant-a")
    other = cache.generate("Capital of Austria?", docs, cache_salt="tenant-b")
    assert first.hits.hit_docs == 0 and other.hits.hit_docs == 0
    assert not other.hits.root_cached  # not even the shared system prompt crosses tenants
    plain = cache.generate("Capital of Austria?", docs)  # unsalted is a tenant of its own
    assert plain.hits.hit_docs == 0
    again = cache.generate("Which river?", docs, cache_salt="tenant-a")
    assert again.hits.gpu_docs == 1 and again.hits.root_cached
    assert again.token_ids == reference(cache, "Which river?", docs)  # salts never change ids
    roots = [n for n in cache.tree.iter_nodes() if n.parent is None]
    assert len(roots) == 3 and len({r.key.salt for r in roots}) == 3  # type: ignore[union-attr]
    nodes = [n for n in cache.tree.iter_nodes() if getattr(n.key, "doc_id", "") == "d4"]
    assert len(nodes) == 3 and len({id(n.parent) for n in nodes}) == 3


def test_cache_document_order_serves_the_cached_path_exactly(cache: RAGCache) -> None:
    # Issue 40: the tree holds d0 -> d1; [d1, d0] in retrieval order hits nothing, in cache
    # order it is served as [d0, d1], hits both, and answers as plain vLLM on that prompt.
    cache.clear()
    cache.generate("Capital of France?", [DOCS[0], DOCS[1]])
    swapped = [DOCS[1], DOCS[0]]
    ordered = cache.generate("Which river?", swapped, document_order="cache")
    assert ordered.sources == (DOCS[0], DOCS[1]) and ordered.retrieval_ranks == (1, 0)
    assert ordered.hits.hit_docs == 2
    assert ordered.token_ids == reference(cache, "Which river?", [DOCS[0], DOCS[1]])
    kept = cache.generate("Which river?", swapped)  # the default keeps retrieval order
    assert kept.sources == tuple(swapped) and kept.retrieval_ranks == (0, 1)
    assert kept.hits.hit_docs == 0
    assert kept.token_ids == reference(cache, "Which river?", swapped)


def test_the_benchmarks_order_check_reads_each_served_prompt_on_plain_vllm(cache: RAGCache) -> None:
    # `bench serve` checks a reordering system's answers so (issue 40): each prompt rebuilt
    # from its documents in served order, answered by plain vLLM; a wrong answer is counted.
    from ragcache_core.bench.serve import Outcome, same_as_plain_vllm
    from ragcache_core.bench.workloads import Request

    cache.clear()
    cache.generate("Capital of France?", [DOCS[0], DOCS[1]])
    served = cache.generate("Which river?", [DOCS[1], DOCS[0]], document_order="cache")
    kept = cache.generate("Which river?", [DOCS[1], DOCS[0]])

    def outcome(result: QueryResult, tokens: tuple[int, ...] | None = None) -> Outcome:
        answer = result.token_ids if tokens is None else tokens
        return Outcome(0.0, 0.0, answer, result.prompt_tokens, 0, served=result.sources,
                       retrieval_ranks=result.retrieval_ranks)  # fmt: skip

    wrong = tuple(t + 1 for t in served.token_ids)
    outcomes = [outcome(served), outcome(kept), outcome(served, wrong)]
    assert outcomes[0].reordered and not outcomes[1].reordered
    requests = [Request("Which river?")] * 3
    assert asyncio.run(same_as_plain_vllm(cache, requests, outcomes)) == (2, 3)


def test_cache_ordered_speculation_is_reused_for_the_same_documents(cache: RAGCache) -> None:
    cache.clear()
    cache.generate("Capital of Italy?", [DOCS[2], DOCS[3]])
    # The speculation starts on [d3, d2] (served [d2, d3]); the final stage retrieves
    # [d2, d3]: ordered the same way it gives the same prompt, so it is reused.
    source = ScriptedSource([[DOCS[3], DOCS[2]], [DOCS[2], DOCS[3]]])
    result = cache.query("Capital of Spain?", search=source, document_order="cache")
    assert result.speculative
    assert result.sources == (DOCS[2], DOCS[3]) and result.retrieval_ranks == (0, 1)
    assert result.token_ids == reference(cache, "Capital of Spain?", [DOCS[2], DOCS[3]])
    # In retrieval order the same stages differ, so the speculation is not reused.
    plain = cache.query("Capital of Spain?", search=ScriptedSource(source.stages))
    assert not plain.speculative
