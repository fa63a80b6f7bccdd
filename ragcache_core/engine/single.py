"""Run one RAG request through vLLM with the knowledge cache (the Python API of the data plane).

    system tokens + documents (token ids each) + question tokens
        │  check: fits the context (InputError before anything is allocated)
        ▼
    KnowledgeCache.begin_request  ──► handle.plan (pins, allocations)
        ▼
    CachedEngine.run(prompt, plan) ──► tokens, TTFT, ConnectorResult
        ▼
    confirm(handle)   every copy ran (the report says so): new nodes become readable
    abort(handle)     the plan was rejected, a load failed, or the engine raised: the
                      request's copies are dropped; a node whose load failed is invalidated
                      (at this prefix only)

The prompt is exactly `system + doc_1 + ... + doc_n + question`: the same token ids go to vLLM
with or without the cache (DESIGN.md 3.3).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragcache_core.engine.cached import CachedEngine, check_fits_context
from ragcache_core.engine.connector.result import ConnectorResult
from ragcache_core.engine.llm import GreedySampling
from ragcache_core.plan import Tier
from ragcache_core.tree import DocKey, DocSpec, KnowledgeCache, RequestHandle

logger = logging.getLogger(__name__)


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
    """Apply the connector's final report on a request; returns whether its copies stand.

    An open handle (the sync path: nothing was confirmed yet) is confirmed when every copy ran
    (plan not rejected, no load failed, stores reported run), else aborted. A handle the
    controller confirmed at its first token (which proves the stores ran: they run
    synchronously in the step that completes the prompt, and the app checked the plan before
    sending it) is only re-checked: a report contradicting that is a bug, logged, and the
    request's written copies leave the tree. Either way a failed load removes the node it read,
    at this prefix only (`KnowledgeCache.invalidate_loads`)."""
    plan = handle.plan
    every_copy_ran = not result.rejected and (result.stored or not plan.store)
    if handle.is_open:
        confirmed = every_copy_ran and not result.load_failed
        if confirmed:
            cache.confirm(handle)
        else:
            cache.abort(handle)
    else:
        confirmed = every_copy_ran
        if not confirmed:
            logger.error(
                "the connector did not run a confirmed plan (rejected: %s; stores ran: %s): "
                "dropping the request's copies",
                "; ".join(result.rejected) or "no",
                result.stored,
            )
            cache.invalidate_written(handle)
    if result.load_failed:
        cache.invalidate_loads(handle, result.failed_load_spans)
    return confirmed
