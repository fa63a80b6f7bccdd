"""`RAGCacheQueryEngine`: a LlamaIndex query engine whose retrieval and generation run in RAGCache.

    engine = as_query_engine(index, cache=cache, similarity_top_k=3)   # instead of
    engine = index.as_query_engine(similarity_top_k=3)                 # LlamaIndex's own

Why not `index.as_query_engine(cache=cache)`: LlamaIndex passes unknown keyword arguments on to
`as_retriever` and `RetrieverQueryEngine.from_args`, which both accept `**kwargs` and ignore what
they do not know. `cache=` would vanish and you would get the ordinary engine on `Settings.llm`.

One query: the index's store becomes a `SearchSource` (`adapters.search_source`: Faiss searched
in stages so RAGCache can speculate, other stores through their own retriever), RAGCache
retrieves, answers and caches each node's KV; the engine only translates the `QueryResult` into
a `Response` (`source_nodes` with scores, `metadata` with TTFT and cache hits). It emits the
instrumentation events of LlamaIndex's own engines (`QueryStartEvent`/`QueryEndEvent`, retrieval
start/end) inside a `dispatcher.span`. Retrieval and generation overlap in RAGCache (speculative
pipelining), so `RetrievalEndEvent` is emitted when the query returns, carrying the final nodes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.indices.vector_store.base import VectorStoreIndex
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import (
    RetrievalEndEvent,
    RetrievalStartEvent,
)
from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.query_engine.custom import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType, TextNode
from llama_index.core.vector_stores.types import BasePydanticVectorStore
from pydantic import Field, PrivateAttr, field_validator

from ragcache_core.api import RAGCacheAPI, require_cache
from ragcache_core.app_prompt import AppPrompt
from ragcache_core.config import PromptConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, wrong_type
from ragcache_core.results import QueryResult, StreamChunk
from ragcache_core.retrieval.source import CallableSource
from ragcache_core.search import SearchSource
from ragcache_integrations.llama_index.adapters import node_to_document, search_source
from ragcache_integrations.llama_index.prompt import app_prompt
from ragcache_integrations.llama_index.sources import RecordingSource

dispatcher = instrument.get_dispatcher(__name__)
logger = logging.getLogger(__name__)


class RAGCacheQueryEngine(CustomQueryEngine):
    """A query engine answering through a `RAGCache`, or a `RAGCacheClient` of a
    `ragcache serve` process (any `RAGCacheAPI`; sync, async, streaming). With a client the
    search runs here and its final documents go to the server (no speculation over HTTP).

    `search` is where documents come from (built from an index by `from_index`);
    `similarity_top_k` wins over the cache's `CacheConfig.top_k` (None uses the cache's).
    `index`, when given, is where `source_nodes` are looked up, so they are the index's own
    nodes (relationships included). `app_prompt` is the prompt it renders (`prompt.app_prompt`:
    LlamaIndex's own QA template by default, nodes with their metadata as LlamaIndex shows them);
    `cache_salt` keeps a tenant's KV apart. The engine holds no per-query state: one engine may
    serve many concurrent queries.
    """

    cache: RAGCacheAPI
    search: Any = Field(description="a ragcache_core SearchSource")
    similarity_top_k: int | None = None
    sampling: SamplingConfig | None = None
    streaming: bool = False
    app_prompt: AppPrompt | None = Field(default=None, exclude=True)
    cache_salt: str | None = None
    index: VectorStoreIndex | None = Field(default=None, exclude=True)
    _warned_no_context: bool = PrivateAttr(default=False)

    @field_validator("cache", mode="before")
    @classmethod
    def _check_cache(cls, value: Any) -> Any:
        return require_cache(value, "RAGCacheQueryEngine(cache=...)")

    @field_validator("search")
    @classmethod
    def _check_search(cls, value: Any) -> Any:
        if not isinstance(value, SearchSource):
            raise ValueError(f"search must be a SearchSource, got {type(value).__name__}")
        return value

    @classmethod
    def from_index(
        cls,
        index: VectorStoreIndex,
        *,
        cache: RAGCacheAPI,
        similarity_top_k: int | None = None,
        prompt: BasePromptTemplate | str | PromptConfig | None = None,
        sampling: SamplingConfig | None = None,
        streaming: bool = False,
        cache_salt: str | None = None,
        **search_options: Any,
    ) -> RAGCacheQueryEngine:
        """An engine over `index`'s vector store. `prompt` is the QA template it renders: a
        LlamaIndex template (chat or text) with `{context_str}` and `{query_str}`, its text,
        or a `PromptConfig` (RAGCache's own layout); None is LlamaIndex's default QA prompt.
        Each prompt gets its own cached root, so engines with different prompts share one
        cache. `search_options` (nprobe, plan, ef_search) go to `adapters.search_source`. A
        retriever, a vector store or a cache that is not a `RAGCacheAPI` raises `TypeError`
        here, naming what to pass instead."""
        check_index(index)
        require_cache(cache, "as_query_engine(index, cache=...)")
        chat = bool(cache.config.prompt.chat_template)
        rendered = app_prompt(prompt, chat=chat)
        if similarity_top_k is not None and (
            not isinstance(similarity_top_k, int) or similarity_top_k < 1
        ):
            raise InputError(f"similarity_top_k must be a positive int, got {similarity_top_k!r}")
        return cls(
            cache=cache,
            search=search_source(index, **search_options),
            similarity_top_k=similarity_top_k,
            sampling=sampling,
            streaming=streaming,
            app_prompt=rendered,
            cache_salt=cache_salt,
            index=index,
        )

    @classmethod
    def from_retriever(
        cls,
        retriever: BaseRetriever,
        *,
        cache: RAGCacheAPI,
        prompt: BasePromptTemplate | str | PromptConfig | None = None,
        sampling: SamplingConfig | None = None,
        streaming: bool = False,
        cache_salt: str | None = None,
    ) -> RAGCacheQueryEngine:
        """An engine over any LlamaIndex retriever (metadata filters, hybrid search, ...).
        The retriever runs as one search step (RAGCache cannot speculate) and decides k.
        `prompt` as in `from_index`."""
        if not isinstance(retriever, BaseRetriever):
            raise wrong_type(
                "RAGCacheQueryEngine.from_retriever(retriever)",
                "a LlamaIndex retriever (BaseRetriever)",
                retriever,
                "for a VectorStoreIndex use as_query_engine(index, cache=cache)"
                if isinstance(retriever, VectorStoreIndex)
                else "",
            )
        require_cache(cache, "RAGCacheQueryEngine.from_retriever(retriever, cache=...)")

        def search(question: str, k: int) -> list[tuple[Document, float]]:
            hits = retriever.retrieve(question)
            return [(node_to_document(h.node), float(h.score or 0.0)) for h in hits]

        source = CallableSource(search, name=f"LlamaIndex {type(retriever).__name__}")
        rendered = app_prompt(prompt, chat=bool(cache.config.prompt.chat_template))
        return cls(
            cache=cache,
            search=source,
            sampling=sampling,
            streaming=streaming,
            app_prompt=rendered,
            cache_salt=cache_salt,
        )

    # ------------------------------------------------------------------ LlamaIndex entry points

    @dispatcher.span
    def query(self, str_or_query_bundle: QueryType) -> Any:
        _check_query(str_or_query_bundle)
        dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
        response = super().query(str_or_query_bundle)
        dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=response))
        return response

    @dispatcher.span
    async def aquery(self, str_or_query_bundle: QueryType) -> Any:
        _check_query(str_or_query_bundle)
        dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
        response = await super().aquery(str_or_query_bundle)
        dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=response))
        return response

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        source = self._begin(query_str)
        if self.streaming:
            chunks = self.cache.stream(
                query_str,
                search=source,
                top_k=self.similarity_top_k,
                sampling=self.sampling,
                prompt=self.app_prompt,
                cache_salt=self.cache_salt,
            )
            first = next(chunks)  # the search is over once anything arrives: sources are known
            nodes = self._nodes_from_search(source)
            metadata: dict[str, Any] = {}
            gen = self._sync_deltas(query_str, first, chunks, nodes, metadata)
            return StreamingResponse(gen, source_nodes=nodes, metadata=metadata)
        result = self.cache.query(
            query_str,
            search=source,
            top_k=self.similarity_top_k,
            sampling=self.sampling,
            prompt=self.app_prompt,
            cache_salt=self.cache_salt,
        )
        return self._response(query_str, result, source)

    async def acustom_query(self, query_str: str) -> Response | AsyncStreamingResponse:
        source = self._begin(query_str)
        if self.streaming:
            chunks = self.cache.astream(
                query_str,
                search=source,
                top_k=self.similarity_top_k,
                sampling=self.sampling,
                prompt=self.app_prompt,
                cache_salt=self.cache_salt,
            )
            first = await anext(chunks)
            nodes = self._nodes_from_search(source)
            metadata: dict[str, Any] = {}
            agen = self._async_deltas(query_str, first, chunks, nodes, metadata)
            return AsyncStreamingResponse(agen, source_nodes=nodes, metadata=metadata)
        result = await self.cache.aquery(
            query_str,
            search=source,
            top_k=self.similarity_top_k,
            sampling=self.sampling,
            prompt=self.app_prompt,
            cache_salt=self.cache_salt,
        )
        return self._response(query_str, result, source)

    # ------------------------------------------------------------------ translation

    def _begin(self, query_str: str) -> RecordingSource:
        _check_query(query_str)
        dispatcher.event(RetrievalStartEvent(str_or_query_bundle=QueryBundle(query_str)))
        return RecordingSource(self.search)

    def _response(self, query_str: str, result: QueryResult, source: RecordingSource) -> Response:
        nodes = self._nodes(result.sources, source)
        self._retrieval_done(query_str, nodes)
        return Response(result.answer, source_nodes=nodes, metadata=self._metadata(result))

    def _nodes_from_search(self, source: RecordingSource) -> list[NodeWithScore]:
        final = source.final
        return self._nodes(final.documents if final is not None else (), source)

    def _sync_deltas(
        self,
        query_str: str,
        first: StreamChunk,
        chunks: Iterator[StreamChunk],
        nodes: list[NodeWithScore],
        metadata: dict[str, Any],
    ) -> Generator[str, None, None]:
        self._retrieval_done(query_str, nodes)
        for chunk in _chain(first, chunks):
            if delta := self._take(chunk, metadata):
                yield delta

    async def _async_deltas(
        self,
        query_str: str,
        first: StreamChunk,
        chunks: AsyncIterator[StreamChunk],
        nodes: list[NodeWithScore],
        metadata: dict[str, Any],
    ) -> AsyncGenerator[str, None]:
        self._retrieval_done(query_str, nodes)
        if delta := self._take(first, metadata):
            yield delta
        async for chunk in chunks:
            if delta := self._take(chunk, metadata):
                yield delta

    def _take(self, chunk: StreamChunk, metadata: dict[str, Any]) -> str:
        """The chunk's text; the last chunk also fills the response's metadata in place."""
        if chunk.result is not None:
            metadata.update(self._metadata(chunk.result))
        return chunk.delta

    def _retrieval_done(self, query_str: str, nodes: list[NodeWithScore]) -> None:
        dispatcher.event(RetrievalEndEvent(str_or_query_bundle=QueryBundle(query_str), nodes=nodes))
        if not nodes and not self._warned_no_context:
            self._warned_no_context = True
            logger.warning("the retriever found no documents: answering without context")

    def _nodes(
        self, documents: tuple[Document, ...], source: RecordingSource
    ) -> list[NodeWithScore]:
        scores = source.scores()
        return [NodeWithScore(node=self._node(d), score=scores.get(d.id)) for d in documents]

    def _node(self, doc: Document) -> Any:
        if self.index is not None:
            node = self.index.docstore.get_node(doc.id, raise_error=False)
            if node is not None:
                return node
        return TextNode(id_=doc.id, text=doc.text, metadata=dict(doc.metadata))

    @staticmethod
    def _metadata(result: QueryResult) -> dict[str, Any]:
        return {**result.report(), "ragcache_result": result}


def check_index(index: object) -> None:
    """`TypeError` unless `index` is a `VectorStoreIndex`, naming what to do with the
    objects people pass instead (a retriever, a bare vector store)."""
    if isinstance(index, VectorStoreIndex):
        return
    where, expected = "as_query_engine(index)", "a LlamaIndex VectorStoreIndex"
    if isinstance(index, BaseRetriever):
        fix = (
            "pass the index itself (as_query_engine(index, cache=cache)), or keep this retriever "
            "with RAGCacheQueryEngine.from_retriever(retriever, cache=cache)"
        )
    elif isinstance(index, BasePydanticVectorStore):
        fix = (
            "wrap the store in an index first: VectorStoreIndex.from_vector_store(store, "
            "embed_model=...), then as_query_engine(index, cache=cache)"
        )
    else:
        fix = ""
    raise wrong_type(where, expected, index, fix)


def _check_query(query: object) -> None:
    text = query.query_str if isinstance(query, QueryBundle) else query
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"the query must be a non-empty string, got {text!r}")


def _chain(first: StreamChunk, rest: Iterator[StreamChunk]) -> Iterator[StreamChunk]:
    yield first
    yield from rest


def as_query_engine(
    index: VectorStoreIndex,
    *,
    cache: RAGCacheAPI,
    similarity_top_k: int | None = None,
    prompt: BasePromptTemplate | str | PromptConfig | None = None,
    sampling: SamplingConfig | None = None,
    streaming: bool = False,
    cache_salt: str | None = None,
    **search_options: Any,
) -> RAGCacheQueryEngine:
    """The one-line replacement for `index.as_query_engine(...)` (see `from_index`)."""
    return RAGCacheQueryEngine.from_index(
        index,
        cache=cache,
        similarity_top_k=similarity_top_k,
        prompt=prompt,
        sampling=sampling,
        streaming=streaming,
        cache_salt=cache_salt,
        **search_options,
    )
