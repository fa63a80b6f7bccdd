"""Run one RAG request through vLLM with the knowledge cache (the Python API of the data plane).

    system tokens + documents (token ids each) + question tokens
        │  check: fits the context (InputError before anything is allocated)
        ▼
    KnowledgeCache.begin_request  ──► handle.plan (pins, allocations)
        ▼
    CachedEngine.run(prompt, plan) ──► tokens, TTFT, ConnectorResult
        ▼
    confirm(handle)   stores ran and the first token arrived: new nodes become readable
    abort(handle)     the plan was rejected, a load failed, or the engine raised: the
                      request's copies are dropped; a node whose load failed is invalidated

The prompt is exactly `system + doc_1 + ... + doc_n + question`: the same token ids go to vLLM
with or without the cache (DESIGN.md 3.3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragcache_core.engine.cached import CachedEngine, check_fits_context
from ragcache_core.engine.connector.result import ConnectorResult
from ragcache_core.engine.llm import GreedySampling
from ragcache_core.plan import Tier
from ragcache_core.tree import DocKey, DocSpec, KnowledgeCache, RequestHandle


@dataclass(frozen=True, slots=True)
class Document:
    """One retrieved document: its key (id + content hash) and its wrapped text's token ids."""

    key: DocKey
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request produced and what the cache served."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ttft_s: float
    prompt_tokens: int
    gpu_hit_tokens: int
    """Prompt tokens loaded from the GPU pool (system prompt included)."""
    host_hit_tokens: int
    """Prompt tokens loaded from the host pool."""
    gpu_hit_docs: int
    host_hit_docs: int
    stored_docs: int
    """Documents whose KV this request stored (readable from now on, when confirmed)."""
    confirmed: bool
    """False when the request's copies were dropped (see `connector`)."""
    connector: ConnectorResult

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.gpu_hit_tokens - self.host_hit_tokens


def build_prompt(
    system: Sequence[int], documents: Sequence[Document], question: Sequence[int]
) -> list[int]:
    prompt = list(system)
    for doc in documents:
        prompt.extend(doc.token_ids)
    prompt.extend(question)
    return prompt


def run_request(
    engine: CachedEngine,
    cache: KnowledgeCache,
    *,
    system: Sequence[int],
    documents: Sequence[Document],
    question: Sequence[int],
    sampling: GreedySampling | None = None,
    final: bool = True,
    extra_transfer_params: Mapping[str, Any] | None = None,
) -> RequestResult:
    """Run one request with the cache; block until it finishes.

    Mutates `cache` (pins, allocations; then confirm or abort). Raises `InputError` if the
    prompt plus `sampling.max_tokens` exceed the engine's context (before touching the cache);
    re-raises engine errors after aborting the request's plan.
    """
    sampling = sampling or GreedySampling()
    prompt = build_prompt(system, documents, question)
    check_fits_context(len(prompt), sampling.max_tokens, engine.max_model_len)
    specs = [DocSpec(doc.key, len(doc.token_ids)) for doc in documents]
    handle = cache.begin_request(len(system), specs, len(question), final=final)
    try:
        run = engine.run(prompt, handle.plan, sampling, extra_transfer_params=extra_transfer_params)
    except BaseException:
        cache.abort(handle)
        raise
    confirmed = settle(cache, handle, run.connector)
    hits = handle.hits
    return RequestResult(
        token_ids=run.token_ids,
        logprobs=run.logprobs,
        ttft_s=run.ttft_s,
        prompt_tokens=len(prompt),
        gpu_hit_tokens=run.connector.gpu_tokens,
        host_hit_tokens=run.connector.host_tokens,
        gpu_hit_docs=hits.docs_on(Tier.GPU) if not run.connector.load_failed else 0,
        host_hit_docs=hits.docs_on(Tier.HOST) if not run.connector.load_failed else 0,
        stored_docs=handle.stored_docs if confirmed else 0,
        confirmed=confirmed,
        connector=run.connector,
    )


def settle(cache: KnowledgeCache, handle: RequestHandle, result: ConnectorResult) -> bool:
    """Confirm the request's copies, or drop them when the connector's report says they are
    not all trustworthy (plan rejected, a load failed, the store did not run); a node whose
    load failed is invalidated. Returns whether it confirmed."""
    plan = handle.plan
    stores_ok = result.stored or not plan.store
    if not result.rejected and not result.load_failed and stores_ok:
        cache.confirm(handle)
        return True
    failed_keys = _failed_nodes(handle, result)
    cache.abort(handle)
    for key in failed_keys:
        # A node whose copy failed may hold bad bytes: no later request may read it.
        if isinstance(key, DocKey):
            cache.invalidate(key.doc_id)
        else:
            cache.clear()
    return False


def _failed_nodes(handle: RequestHandle, result: ConnectorResult) -> list[object]:
    """Keys of the hit nodes whose load span failed (load spans follow the non-empty hits)."""
    loaded_hits = [hit for hit in handle.hits.hits if hit.num_tokens]
    return [loaded_hits[i].key for i in result.failed_load_spans if i < len(loaded_hits)]
