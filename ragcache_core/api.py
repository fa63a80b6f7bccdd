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
from collections.abc import AsyncGenerator, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Self, TypedDict, Unpack

from ragcache_core.app_prompt import NO_FRAMING, AppPrompt, Framing, conversation_prompt
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import wrong_type
from ragcache_core.loop import Emit, LoopThread, astream_from, iterate_on
from ragcache_core.query_result import QueryResult, StreamChunk
from ragcache_core.search import SearchSource

__all__ = [
    "AnswerOptions",
    "QueryOptions",
    "RAGCacheAPI",
    "StreamOptions",
    "require_cache",
]


class AnswerOptions(TypedDict, total=False):
    """The keywords of every call that answers (`query`, `generate`, `stream` and their async
    forms), declared once here; each may be left out.

    - `sampling`: this call's decoding settings (None: `CacheConfig.sampling`);
    - `prompt`: the app's own prompt (`AppPrompt`; None: the `CacheConfig.prompt` layout);
    - `cache_salt`: a tenant's salt (the call hits only KV stored under the same salt);
    - `return_prompt`: True puts the prompt as the model saw it in `QueryResult.prompt_text`
      (default False);
    - `document_order`: "retrieval" or "cache" (None: `CacheConfig.document_order`).
    """

    sampling: SamplingConfig | None
    prompt: AppPrompt | None
    cache_salt: str | None
    return_prompt: bool
    document_order: str | None


class QueryOptions(AnswerOptions, total=False):
    """`AnswerOptions` and the retrieval's: `search` (a `SearchSource`; None: the cache's
    default source) and `top_k` (None: `CacheConfig.top_k`)."""

    search: SearchSource | None
    top_k: int | None


class StreamOptions(QueryOptions, total=False):
    """`QueryOptions` and `documents`: the caller's documents (then no retrieval runs)."""

    documents: Sequence[Document] | None


ANSWER_KEYWORDS = AnswerOptions.__optional_keys__
QUERY_KEYWORDS = QueryOptions.__optional_keys__
STREAM_KEYWORDS = StreamOptions.__optional_keys__


def _check_keywords(method: str, given: Mapping[str, object], known: frozenset[str]) -> None:
    """The `TypeError` Python raised for an unknown keyword when the signatures spelled the
    keywords out, word for word (`**options` accepts any name; a typo must still fail before
    anything runs: at the call, or where an async form is awaited or iterated)."""
    for name in given:
        if name not in known:
            raise TypeError(f"RAGCacheAPI.{method}() got an unexpected keyword argument {name!r}")


def _framing(options: AnswerOptions) -> Framing:
    return Framing(
        options.get("prompt"),
        options.get("cache_salt"),
        options.get("return_prompt", False),
        options.get("document_order"),
    )


class RAGCacheAPI(abc.ABC):
    """What `RAGCache` and `RAGCacheClient` both offer (see the module docstring).

    Every call raises `InputError` for bad input (an empty question, documents that are not
    `Document`s, a prompt longer than the context) and `RAGCacheError` when the request failed
    (timed out, lost its engine, or the server refused it); nothing already cached is harmed.

    Every call that answers takes the keywords of `AnswerOptions`, declared once above:
    `sampling=`, `prompt=` (the app's own prompt: its messages or text with the documents
    spliced in where it puts its context), `cache_salt=` (a salted request hits only KV stored
    under the same salt, docs/design.md 2.1), `return_prompt=` (the prompt as the model saw it
    in `QueryResult.prompt_text`, for traces and checks) and `document_order=` ("retrieval":
    documents as retrieved or given; "cache": the order that follows the cached path, more
    reuse with top-k > 1 but the model reads them in another order). The retrieving calls add
    `search=` and `top_k=` (`QueryOptions`), the streaming ones `documents=` (`StreamOptions`).
    `QueryResult.sources` lists the documents as served, with `retrieval_ranks`.
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

    async def aquery(self, question: str, **options: Unpack[QueryOptions]) -> QueryResult:
        """Retrieve the top-k documents for `question` and answer with them (keywords:
        `QueryOptions`)."""
        _check_keywords("aquery", options, QUERY_KEYWORDS)
        return await self._loop.arun(self._query_with(question, options, None, _framing(options)))

    def query(self, question: str, **options: Unpack[QueryOptions]) -> QueryResult:
        """Blocking `aquery` (keywords: `QueryOptions`)."""
        _check_keywords("query", options, QUERY_KEYWORDS)
        return self._loop.run(self._query_with(question, options, None, _framing(options)))

    async def agenerate(
        self, question: str, documents: Sequence[Document], **options: Unpack[AnswerOptions]
    ) -> QueryResult:
        """Answer with documents the caller already has (no retrieval; keywords:
        `AnswerOptions`)."""
        _check_keywords("agenerate", options, ANSWER_KEYWORDS)
        return await self._loop.arun(
            self._answer_with(question, documents, options, None, _framing(options))
        )

    def generate(
        self, question: str, documents: Sequence[Document], **options: Unpack[AnswerOptions]
    ) -> QueryResult:
        """Blocking `agenerate` (keywords: `AnswerOptions`)."""
        _check_keywords("generate", options, ANSWER_KEYWORDS)
        return self._loop.run(
            self._answer_with(question, documents, options, None, _framing(options))
        )

    async def astream(
        self, question: str, **options: Unpack[StreamOptions]
    ) -> AsyncGenerator[StreamChunk, None]:
        """Stream the answer as text deltas; the last chunk carries the `QueryResult` (keywords:
        `StreamOptions`). With `documents` no retrieval runs. Closing the iterator early aborts
        the request."""
        _check_keywords("astream", options, STREAM_KEYWORDS)
        framing, documents = _framing(options), options.get("documents")

        def work(emit: Emit) -> Any:
            if documents is not None:
                return self._answer_with(question, documents, options, emit, framing)
            return self._query_with(question, options, emit, framing)

        async for chunk in astream_from(self._loop, work):
            yield chunk

    def stream(self, question: str, **options: Unpack[StreamOptions]) -> Iterator[StreamChunk]:
        """Blocking `astream`: an iterator of `StreamChunk`s (keywords: `StreamOptions`)."""
        _check_keywords("stream", options, STREAM_KEYWORDS)
        return iterate_on(self._loop, self.astream(question, **options))

    def _query_with(
        self, question: str, options: QueryOptions, emit: Emit | None, framing: Framing
    ) -> Coroutine[Any, Any, QueryResult]:
        search, top_k = options.get("search"), options.get("top_k")
        return self._query(question, search, top_k, options.get("sampling"), emit, framing)

    def _answer_with(
        self,
        question: str,
        documents: Sequence[Document],
        options: AnswerOptions,
        emit: Emit | None,
        framing: Framing,
    ) -> Coroutine[Any, Any, QueryResult]:
        return self._answer(question, documents, options.get("sampling"), emit, framing)


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
