"""`RAGCacheAPI`: the one interface an application codes against, in process or over HTTP.

Two classes implement it:

    RAGCache          (runtime/ragcache.py)   the engine, the tree and the pools in this process
    RAGCacheClient    (client/client.py)      a `ragcache serve` process shared by many apps

The public calls are written once, here: `aquery`/`query`, `agenerate`/`generate` and
`astream`/`stream` run over two async bodies (`_query`, `_answer`) that each implementation
provides on its private loop (`ragcache_core.loop`); the sync calls block on the same bodies,
so they also work where the caller's thread runs an event loop (notebooks).

The framework integrations (`ragcache_integrations`) accept either: they call the methods
below and read `config` (the prompt the cache renders, the default sampling and top-k) and
`model`. One difference is inherent: a `SearchSource` is Python code in the caller's process,
so `RAGCacheClient` runs it locally and sends the final documents (no speculation across the
wire); without `search=` the server searches its own `--index`.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any, Self

from ragcache_core.app_prompt import NO_FRAMING, AppPrompt, Framing, conversation_prompt
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import wrong_type
from ragcache_core.loop import Emit, LoopThread, astream_from, iterate_on
from ragcache_core.query_result import QueryResult, StreamChunk
from ragcache_core.search import SearchSource

__all__ = ["RAGCacheAPI", "require_cache"]


class RAGCacheAPI(abc.ABC):
    """What `RAGCache` and `RAGCacheClient` both offer (see the module docstring).

    Every call raises `InputError` for bad input (an empty question, documents that are not
    `Document`s, a prompt longer than the context) and `RAGCacheError` when the request failed
    (timed out, lost its engine, or the server refused it); nothing already cached is harmed.

    Every call that answers takes `prompt=`, the app's own prompt (`AppPrompt`: its messages or
    text with the documents spliced in where it puts its context; None: the cache's
    `CacheConfig.prompt` layout), `cache_salt=`, a tenant's salt: a salted request hits
    only KV stored under the same salt (docs/design.md 2.1), and `return_prompt=`: True puts
    the prompt as the model saw it in `QueryResult.prompt_text` (for traces and checks), and
    `document_order=`: "retrieval" (documents as retrieved or given) or "cache" (the order that
    follows the cached path: more reuse with top-k > 1, but the model reads them in another
    order; None: `CacheConfig.document_order`). `QueryResult.sources` lists the documents as
    served, with `retrieval_ranks`.
    """

    config: CacheConfig
    """The cache's settings (the prompt it renders, default sampling and top-k)."""
    model: str
    """The model's name (a folder path in process; the served name over HTTP)."""
    _loop: LoopThread
    """The private loop the bodies run on."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters (hits per tier, tokens saved, TTFT) and tree occupancy."""

    @abc.abstractmethod
    def invalidate(self, doc_id: str) -> int:
        """Drop every cached node of `doc_id`; returns the number of nodes dropped."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine (or the connections) and the private loop. Safe to call twice."""

    def conversation_prompt(self, history: Sequence[Mapping[str, Any]]) -> AppPrompt:
        """The cache's own layout for a conversation whose earlier turns are `history`
        (role/content messages before the final user turn): the system prompt, the documents
        (cached), then the turns and the question (computed). Pure; `InputError` for a bad
        turn. Over HTTP the server's template is assumed to take a system message."""
        prompt = self.config.prompt
        return conversation_prompt(prompt.system_prompt, history, document=prompt.document)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    async def _query(
        self,
        question: str,
        search: SearchSource | None,
        top_k: int | None,
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        """Retrieve for `question` (with `search`, else the default source) and answer."""

    @abc.abstractmethod
    async def _answer(
        self,
        question: str,
        documents: Sequence[Document],
        sampling: SamplingConfig | None,
        emit: Emit | None,
        framing: Framing = NO_FRAMING,
    ) -> QueryResult:
        """Answer with the caller's `documents`."""

    async def aquery(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
        return_prompt: bool = False,
        document_order: str | None = None,
    ) -> QueryResult:
        """Retrieve the top-k documents for `question` and answer with them."""
        framing = Framing(prompt, cache_salt, return_prompt, document_order)
        return await self._loop.arun(self._query(question, search, top_k, sampling, None, framing))

    def query(
        self,
        question: str,
        *,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
        return_prompt: bool = False,
        document_order: str | None = None,
    ) -> QueryResult:
        """Blocking `aquery`."""
        framing = Framing(prompt, cache_salt, return_prompt, document_order)
        return self._loop.run(self._query(question, search, top_k, sampling, None, framing))

    async def agenerate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
        return_prompt: bool = False,
        document_order: str | None = None,
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval)."""
        framing = Framing(prompt, cache_salt, return_prompt, document_order)
        return await self._loop.arun(self._answer(question, documents, sampling, None, framing))

    def generate(
        self,
        question: str,
        documents: Sequence[Document],
        *,
        sampling: SamplingConfig | None = None,
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
        return_prompt: bool = False,
        document_order: str | None = None,
    ) -> QueryResult:
        """Blocking `agenerate`."""
        framing = Framing(prompt, cache_salt, return_prompt, document_order)
        return self._loop.run(self._answer(question, documents, sampling, None, framing))

    async def astream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
        return_prompt: bool = False,
        document_order: str | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream the answer as text deltas; the last chunk carries the `QueryResult`.
        With `documents` no retrieval runs. Closing the iterator early aborts the request."""
        framing = Framing(prompt, cache_salt, return_prompt, document_order)

        def work(emit: Emit) -> Any:
            if documents is not None:
                return self._answer(question, documents, sampling, emit, framing)
            return self._query(question, search, top_k, sampling, emit, framing)

        async for chunk in astream_from(self._loop, work):
            yield chunk

    def stream(
        self,
        question: str,
        *,
        documents: Sequence[Document] | None = None,
        search: SearchSource | None = None,
        top_k: int | None = None,
        sampling: SamplingConfig | None = None,
        prompt: AppPrompt | None = None,
        cache_salt: str | None = None,
        return_prompt: bool = False,
        document_order: str | None = None,
    ) -> Iterator[StreamChunk]:
        """Blocking `astream`: an iterator of `StreamChunk`s."""
        chunks = self.astream(
            question,
            documents=documents,
            search=search,
            top_k=top_k,
            sampling=sampling,
            prompt=prompt,
            cache_salt=cache_salt,
            return_prompt=return_prompt,
            document_order=document_order,
        )
        return iterate_on(self._loop, chunks)


def require_cache(cache: object, where: str) -> RAGCacheAPI:
    """`cache` when it is a `RAGCacheAPI`; else the `TypeError` naming what `where` (an
    integration's constructor) expects and what it got, e.g. a retriever or an index passed
    as `cache=` by mistake."""
    if isinstance(cache, RAGCacheAPI):
        return cache
    raise wrong_type(
        where,
        "a RAGCache or a RAGCacheClient (a ragcache_core.RAGCacheAPI)",
        cache,
        "build the cache first (cache = RAGCache(model_folder)) and pass it as cache=; the "
        "index, store or retriever goes in the other argument",
    )
