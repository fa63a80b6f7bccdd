"""Run one RAG request through the synchronous engine with the knowledge cache: the exactness
tests' way (test_exact.py, test_exact_eviction.py) to drive `CachedEngine` with a tree.

    system tokens + documents (token ids each) + question tokens
        │  check: fits the context (InputError before anything is allocated)
        ▼
    Lifecycle.open  ──► handle (pins, allocations), the checked plan
        ▼
    CachedEngine.run(prompt, plan) ──► tokens, TTFT, ConnectorResult
        ▼
    Lifecycle.settle   every copy ran (the report says so): new nodes become readable;
                       else the request's copies are dropped and a node whose load failed
                       is invalidated (at this prefix only)

The steps are `Lifecycle`'s (lifecycle.py), the same the async runtime runs over vLLM's async
engine; the synchronous `vllm.LLM` returns finished requests only, so the handle is settled at
the end instead of confirmed at the first token. The prompt is exactly `system + doc_1 + ... +
doc_n + question`: the same token ids go to vLLM with or without the cache (docs/design.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ragcache_core.config import SamplingConfig
from ragcache_core.engine.cached import CachedEngine
from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.errors import check_fits_context
from ragcache_core.runtime.lifecycle import Lifecycle, served_hits
from ragcache_core.runtime.prompt import BuiltPrompt
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree


@dataclass(frozen=True, slots=True)
class TokenizedDocument:
    """One document as the data plane sees it: its key (id + content hash) and its wrapped
    text's token ids (`ragcache_core.Document` is the text the application retrieves)."""

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
    """Prompt tokens vLLM's prefix cache served (the GPU tier: no copy; system prompt
    included)."""
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
    system: Sequence[int], documents: Sequence[TokenizedDocument], question: Sequence[int]
) -> BuiltPrompt:
    """The request's prompt in the pieces that map onto tree nodes."""
    return BuiltPrompt(
        root_ids=tuple(system),
        doc_ids=tuple(doc.token_ids for doc in documents),
        question_ids=tuple(question),
        doc_specs=tuple(DocSpec(doc.key, len(doc.token_ids)) for doc in documents),
    )


def run_request(
    engine: CachedEngine,
    cache: KnowledgeTree,
    *,
    system: Sequence[int],
    documents: Sequence[TokenizedDocument],
    question: Sequence[int],
    sampling: SamplingConfig,
    final: bool = True,
    extra_transfer_params: Mapping[str, Any] | None = None,
) -> RequestResult:
    """Run one request with the cache; block until it finishes.

    Mutates `cache` (pins, allocations; then confirm or abort). Raises `InputError` if the
    prompt plus `sampling.max_tokens` exceed the engine's context (before touching the cache);
    re-raises engine errors after aborting the request's plan.
    """
    prompt = build_prompt(system, documents, question)
    check_fits_context(prompt.num_tokens, sampling.max_tokens, engine.max_model_len)
    lifecycle = Lifecycle(cache, engine.config)
    handle, plan = lifecycle.open(prompt, final=final)
    try:
        run = engine.run(
            prompt.token_ids, plan, sampling, extra_transfer_params=extra_transfer_params
        )
    except BaseException:
        lifecycle.abort(handle)
        raise
    confirmed = lifecycle.settle(handle, run.connector)
    hits, _ = served_hits(handle, run.connector, prompt, run.num_cached_tokens, cache.block_size)
    return RequestResult(
        token_ids=run.token_ids,
        logprobs=run.logprobs,
        ttft_s=run.ttft_s,
        prompt_tokens=prompt.num_tokens,
        gpu_hit_tokens=run.gpu_hit_tokens,
        host_hit_tokens=run.connector.host_tokens,
        gpu_hit_docs=hits.gpu_docs,
        host_hit_docs=hits.host_docs,
        stored_docs=handle.stored_docs if confirmed else 0,
        confirmed=confirmed,
        connector=run.connector,
    )
