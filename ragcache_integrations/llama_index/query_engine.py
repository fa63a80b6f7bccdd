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

LlamaIndex's own keywords mean here what they mean there (`conventions`): `text_qa_template`
(or RAGCache's `prompt=`) is the QA template, `get_prompts()` / `update_prompts()` take the
stock engine's `response_synthesizer:...` keys, `node_postprocessors` run on the final top-k
before the cache sees it (speculation is then off: `sources.RecordingSource`), `filters` go to
the store (`adapters.search_source`), and `response_mode` is "compact" (one LLM call; the
other modes are refused by name).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.indices.vector_store.base import VectorStoreIndex
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import (
    RetrievalEndEvent,
    RetrievalStartEvent,
)
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts.base import BasePromptTemplate, PromptTemplate
from llama_index.core.prompts.mixin import PromptMixinType
from llama_index.core.query_engine.custom import CustomQueryEngine
from llama_index.core.response_synthesizers.type import ResponseMode
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType, TextNode
from llama_index.core.settings import Settings
from llama_index.core.vector_stores.types import BasePydanticVectorStore, MetadataFilters
from pydantic import Field, PrivateAttr, field_validator

from ragcache_core.api import RAGCacheAPI, require_cache
from ragcache_core.app_prompt import AppPrompt
from ragcache_core.config import PromptConfig, SamplingConfig, check_document_order
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, wrong_type
from ragcache_core.query_result import QueryResult, StreamChunk
from ragcache_core.retrieval.source import CallableSource
from ragcache_core.search import SearchSource
from ragcache_integrations.llama_index.adapters import node_to_document, search_source
from ragcache_integrations.llama_index.conventions import (
    ResponsePrompts,
    check_keywords,
    check_postprocessors,
    check_response_mode,
)
from ragcache_integrations.llama_index.events import LLMCall, formatted
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
    `cache_salt` keeps a tenant's KV apart. `document_order` ("retrieval" or "cache"; None:
    the cache's `CacheConfig.document_order`) is the order the prompt shows the documents in;
    `source_nodes` follow the served order (a streamed response's, once the answer ended). An
    app's own reordering postprocessor (`LongContextReorder`) runs first and wins unless the
    engine asks for "cache". `node_postprocessors` run on the final top-k
    (speculation off, `can_speculate`); `prompt_template` is the LlamaIndex QA template the app
    gave (reported by `get_prompts()`). The engine holds no per-query state: one engine may
    serve many concurrent queries (`update_prompts` changes the prompt for the queries that
    start after it).
    """

    cache: RAGCacheAPI
    search: Any = Field(description="a ragcache_core SearchSource")
    similarity_top_k: int | None = None
    sampling: SamplingConfig | None = None
    streaming: bool = False
    app_prompt: AppPrompt | None = Field(default=None, exclude=True)
    cache_salt: str | None = None
    document_order: str | None = None
    index: VectorStoreIndex | None = Field(default=None, exclude=True)
    node_postprocessors: list[BaseNodePostprocessor] = Field(default_factory=list, exclude=True)
    response_mode: ResponseMode = ResponseMode.COMPACT
    prompt_template: BasePromptTemplate | None = Field(default=None, exclude=True)
    refine_template: BasePromptTemplate | None = Field(default=None, exclude=True)
    _warned_no_context: bool = PrivateAttr(default=False)
    _prompts: ResponsePrompts = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        check_response_mode(self.response_mode)
        self._prompts = ResponsePrompts(
            self.prompt_template, self.refine_template, self._set_text_qa_template
        )

    @property
    def can_speculate(self) -> bool:
        """Whether a query may start generating before its search ends: the store is searched
        in stages and no node postprocessor has to see the final top-k first."""
        return bool(self.search.can_speculate) and not self.node_postprocessors

    # ------------------------------------------------------------------ PromptMixin

    def _get_prompt_modules(self) -> PromptMixinType:
        """What a stock `RetrieverQueryEngine` reports: its `response_synthesizer`, so the keys
        are `response_synthesizer:text_qa_template`, `...:refine_template`, ..."""
        return {"response_synthesizer": self._prompts}

    def _set_text_qa_template(self, template: BasePromptTemplate) -> None:
        self.app_prompt = app_prompt(template, chat=bool(self.cache.config.prompt.chat_template))
        self.prompt_template = template

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
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        response_mode: ResponseMode | str = ResponseMode.COMPACT,
        filters: MetadataFilters | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        prompt: BasePromptTemplate | str | PromptConfig | None = None,
        sampling: SamplingConfig | None = None,
        cache_salt: str | None = None,
        document_order: str | None = None,
        **search_options: Any,
    ) -> RAGCacheQueryEngine:
        """An engine over `index`'s vector store. `text_qa_template` (LlamaIndex's name) or
        `prompt` is the QA template it renders: a LlamaIndex template (chat or text) with
        `{context_str}` and `{query_str}`, its text, or a `PromptConfig` (RAGCache's own
        layout); None is LlamaIndex's default QA prompt. Each prompt gets its own cached root,
        so engines with different prompts share one cache. `node_postprocessors` run on the
        final top-k (no speculation then); `filters` go to the store; `response_mode` must be
        "compact" (`conventions`); `refine_template` is reported by `get_prompts()`, never used
        (one call per query); `callback_manager` defaults to `Settings.callback_manager`, as
        LlamaIndex's own engines. `search_options` (nprobe, sizing, ef_search) go to
        `adapters.search_source`; any other keyword is a `TypeError` listing both sets. A
        retriever, a vector store or a cache that is not a `RAGCacheAPI` raises `TypeError`
        here, naming what to pass instead."""
        check_keywords("as_query_engine(index, cache=...)", search_options, ENGINE_KEYWORDS)
        mode = check_response_mode(response_mode)
        postprocessors = check_postprocessors(node_postprocessors)
        check_index(index)
        require_cache(cache, "as_query_engine(index, cache=...)")
        if similarity_top_k is not None and (
            not isinstance(similarity_top_k, int) or similarity_top_k < 1
        ):
            raise InputError(f"similarity_top_k must be a positive int, got {similarity_top_k!r}")
        template, rendered = _qa_template(cache, prompt, text_qa_template)
        return cls(
            cache=cache,
            search=search_source(index, filters=filters, **search_options),
            similarity_top_k=similarity_top_k,
            sampling=sampling,
            streaming=streaming,
            app_prompt=rendered,
            cache_salt=cache_salt,
            document_order=_checked_order(document_order),
            index=index,
            node_postprocessors=postprocessors,
            response_mode=mode,
            prompt_template=template,
            refine_template=refine_template,
            callback_manager=callback_manager or Settings.callback_manager,
        )

    @classmethod
    def from_retriever(
        cls,
        retriever: BaseRetriever,
        *,
        cache: RAGCacheAPI,
        text_qa_template: BasePromptTemplate | None = None,
        refine_template: BasePromptTemplate | None = None,
        node_postprocessors: list[BaseNodePostprocessor] | None = None,
        response_mode: ResponseMode | str = ResponseMode.COMPACT,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        prompt: BasePromptTemplate | str | PromptConfig | None = None,
        sampling: SamplingConfig | None = None,
        cache_salt: str | None = None,
        document_order: str | None = None,
    ) -> RAGCacheQueryEngine:
        """An engine over any LlamaIndex retriever (metadata filters, hybrid search, ...).
        The retriever runs as one search step (RAGCache cannot speculate) and decides k.
        The other keywords as in `from_index`."""
        if not isinstance(retriever, BaseRetriever):
            raise wrong_type(
                "RAGCacheQueryEngine.from_retriever(retriever)",
                "a LlamaIndex retriever (BaseRetriever)",
                retriever,
                "for a VectorStoreIndex use as_query_engine(index, cache=cache)"
                if isinstance(retriever, VectorStoreIndex)
                else "",
            )
        mode = check_response_mode(response_mode)
        postprocessors = check_postprocessors(node_postprocessors)
        require_cache(cache, "RAGCacheQueryEngine.from_retriever(retriever, cache=...)")

        def search(question: str, k: int) -> list[tuple[Document, float]]:
            hits = retriever.retrieve(question)
            return [(node_to_document(h.node), float(h.score or 0.0)) for h in hits]

        source = CallableSource(search, name=f"LlamaIndex {type(retriever).__name__}")
        template, rendered = _qa_template(cache, prompt, text_qa_template)
        return cls(
            cache=cache,
            search=source,
            sampling=sampling,
            streaming=streaming,
            app_prompt=rendered,
            cache_salt=cache_salt,
            document_order=_checked_order(document_order),
            node_postprocessors=postprocessors,
            response_mode=mode,
            prompt_template=template,
            refine_template=refine_template,
            callback_manager=callback_manager or Settings.callback_manager,
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
        prompt = self.app_prompt  # once: update_prompts() may run meanwhile
        if self.streaming:
            chunks = self.cache.stream(
                query_str,
                search=source,
                top_k=self.similarity_top_k,
                sampling=self.sampling,
                prompt=prompt,
                cache_salt=self.cache_salt,
                document_order=self.document_order,
            )
            first = next(chunks)  # the search is over once anything arrives: sources are known
            nodes = self._nodes_from_search(source)
            metadata: dict[str, Any] = {}
            call = self._stream_call(query_str, source, nodes, prompt)
            gen = self._sync_deltas(first, chunks, metadata, call, nodes)
            return StreamingResponse(gen, source_nodes=nodes, metadata=metadata)
        result = self.cache.query(
            query_str,
            search=source,
            top_k=self.similarity_top_k,
            sampling=self.sampling,
            prompt=prompt,
            cache_salt=self.cache_salt,
            document_order=self.document_order,
        )
        return self._response(query_str, result, source, prompt)

    async def acustom_query(self, query_str: str) -> Response | AsyncStreamingResponse:
        source = self._begin(query_str)
        prompt = self.app_prompt  # once: update_prompts() may run meanwhile
        if self.streaming:
            chunks = self.cache.astream(
                query_str,
                search=source,
                top_k=self.similarity_top_k,
                sampling=self.sampling,
                prompt=prompt,
                cache_salt=self.cache_salt,
                document_order=self.document_order,
            )
            first = await anext(chunks)
            nodes = self._nodes_from_search(source)
            metadata: dict[str, Any] = {}
            call = self._stream_call(query_str, source, nodes, prompt)
            agen = self._async_deltas(first, chunks, metadata, call, nodes)
            return AsyncStreamingResponse(agen, source_nodes=nodes, metadata=metadata)
        result = await self.cache.aquery(
            query_str,
            search=source,
            top_k=self.similarity_top_k,
            sampling=self.sampling,
            prompt=prompt,
            cache_salt=self.cache_salt,
            document_order=self.document_order,
        )
        return self._response(query_str, result, source, prompt)

    # ------------------------------------------------------------------ translation

    def _begin(self, query_str: str) -> RecordingSource:
        _check_query(query_str)
        dispatcher.event(RetrievalStartEvent(str_or_query_bundle=QueryBundle(query_str)))
        return RecordingSource(self.search, self.node_postprocessors, self._node)

    def _response(
        self,
        query_str: str,
        result: QueryResult,
        source: RecordingSource,
        prompt: AppPrompt | None,
    ) -> Response:
        nodes = self._nodes(result.sources, source, result.retrieval_ranks)
        self._retrieval_done(query_str, nodes)
        call = self._llm_call(query_str, result.sources, prompt)
        call.start()
        call.end(result)
        return Response(result.answer, source_nodes=nodes, metadata=self._metadata(result))

    def _llm_call(
        self, query_str: str, documents: Sequence[Document], prompt: AppPrompt | None
    ) -> LLMCall:
        """The LLM events of one answer (`events.LLMCall`), with the prompt as sent."""
        chat = bool(self.cache.config.prompt.chat_template)
        app = prompt or app_prompt(None, chat=chat)
        sent = formatted(app, query_str, documents, chat_model=chat)
        return LLMCall(self.callback_manager, sent, self.cache.model)

    def _nodes_from_search(self, source: RecordingSource) -> list[NodeWithScore]:
        final = source.final
        return self._nodes(final.documents if final is not None else (), source, ())

    def _sync_deltas(
        self,
        first: StreamChunk,
        chunks: Iterator[StreamChunk],
        metadata: dict[str, Any],
        call: LLMCall,
        nodes: list[NodeWithScore],
    ) -> Generator[str, None, None]:
        for chunk in _chain(first, chunks):
            if delta := self._take(chunk, metadata, call, nodes):
                yield delta

    async def _async_deltas(
        self,
        first: StreamChunk,
        chunks: AsyncIterator[StreamChunk],
        metadata: dict[str, Any],
        call: LLMCall,
        nodes: list[NodeWithScore],
    ) -> AsyncGenerator[str, None]:
        if delta := self._take(first, metadata, call, nodes):
            yield delta
        async for chunk in chunks:
            if delta := self._take(chunk, metadata, call, nodes):
                yield delta

    def _take(
        self,
        chunk: StreamChunk,
        metadata: dict[str, Any],
        call: LLMCall,
        nodes: list[NodeWithScore],
    ) -> str:
        """The chunk's text (an in-progress LLM event); the last chunk also fills the
        response's metadata in place, puts its source nodes in the served order (they are
        known before the answer, the order only once it is served) and ends the LLM event."""
        if chunk.delta:
            call.progress(chunk.delta)
        if chunk.result is not None:
            ranks = chunk.result.retrieval_ranks
            if len(ranks) == len(nodes):
                nodes[:] = [nodes[rank] for rank in ranks]
            metadata.update(self._metadata(chunk.result))
            call.end(chunk.result)
        return chunk.delta

    def _stream_call(
        self,
        query_str: str,
        source: RecordingSource,
        nodes: list[NodeWithScore],
        prompt: AppPrompt | None,
    ) -> LLMCall:
        """A stream's retrieval end and LLM start (its search is over: the final documents are
        known); the LLM event ends with the stream."""
        self._retrieval_done(query_str, nodes)
        final = source.final
        call = self._llm_call(query_str, final.documents if final is not None else (), prompt)
        call.start()
        return call

    def _retrieval_done(self, query_str: str, nodes: list[NodeWithScore]) -> None:
        dispatcher.event(RetrievalEndEvent(str_or_query_bundle=QueryBundle(query_str), nodes=nodes))
        if not nodes and not self._warned_no_context:
            self._warned_no_context = True
            logger.warning("the retriever found no documents: answering without context")

    def _nodes(
        self, documents: tuple[Document, ...], source: RecordingSource, ranks: tuple[int, ...]
    ) -> list[NodeWithScore]:
        """The response's source nodes, in the order `documents` were served (`ranks`: their
        retrieval ranks)."""
        if source.nodes is not None:  # the postprocessors' own nodes and scores
            nodes = list(source.nodes)
            if len(ranks) == len(nodes):  # as served (document_order="cache")
                nodes = [nodes[rank] for rank in ranks]
            return nodes
        scores = source.scores()
        return [NodeWithScore(node=self._node(d), score=scores.get(d.id)) for d in documents]

    def _node(self, doc: Document) -> Any:
        """The index's own node for `doc` (a `TextNode` of it when there is no index)."""
        if self.index is not None:
            node = self.index.docstore.get_node(doc.id, raise_error=False)
            if node is not None:
                return node
        return TextNode(id_=doc.id, text=doc.text, metadata=dict(doc.metadata))

    def _metadata(self, result: QueryResult) -> dict[str, Any]:
        return {**result.report(), "can_speculate": self.can_speculate, "ragcache_result": result}


ENGINE_KEYWORDS = tuple(
    name
    for name, parameter in inspect.signature(RAGCacheQueryEngine.from_index).parameters.items()
    if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "cache"
)
"""What `as_query_engine(index, cache=...)` takes besides the search adapter's keywords:
`from_index`'s own keywords, read off its signature (declared once)."""


def _checked_order(order: str | None) -> str | None:
    """The engine's `document_order`, checked at construction (`InputError` naming it)."""
    return None if order is None else check_document_order(order)


def _qa_template(
    cache: RAGCacheAPI,
    prompt: BasePromptTemplate | str | PromptConfig | None,
    text_qa_template: BasePromptTemplate | None,
) -> tuple[BasePromptTemplate | None, AppPrompt]:
    """The LlamaIndex template `get_prompts()` reports and the prompt it renders to, from
    `text_qa_template` (LlamaIndex's name) or `prompt` (RAGCache's: also text or a
    `PromptConfig`); both given is a `TypeError`."""
    if text_qa_template is not None and prompt is not None:
        raise TypeError("give the QA template once: text_qa_template= or prompt=, not both")
    given = text_qa_template if text_qa_template is not None else prompt
    rendered = app_prompt(given, chat=bool(cache.config.prompt.chat_template))
    if isinstance(given, str):
        return PromptTemplate(given), rendered
    if isinstance(given, PromptConfig):
        return _as_template(given), rendered
    return given, rendered


def _as_template(config: PromptConfig) -> PromptTemplate:
    """A `PromptConfig`'s layout as the LlamaIndex template it reads like (what
    `get_prompts()` reports for it; the documents go through its document template)."""

    def escaped(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    head = escaped(config.head.format(system=config.system_prompt))
    question = escaped(config.question).replace("{{question}}", "{query_str}")
    return PromptTemplate(head + "{context_str}" + question)


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
    **kwargs: Any,
) -> RAGCacheQueryEngine:
    """The one-line replacement for `index.as_query_engine(**kwargs)`: LlamaIndex's keywords
    (`similarity_top_k`, `text_qa_template`, `node_postprocessors`, `response_mode`,
    `filters`, `streaming`, ...), RAGCache's (`prompt`, `sampling`, `cache_salt`) and the
    search adapter's (`nprobe`, `sizing`, `ef_search`); see `from_index`. Any other keyword is
    a `TypeError` naming this call and listing both sets."""
    return RAGCacheQueryEngine.from_index(index, cache=cache, **kwargs)
