"""`RAGCacheRunnable`: the `prompt | llm` pair of an LCEL RAG chain, answered by RAGCache.

    chain = (
        {"context": retriever, "question": RunnablePassthrough()}
        | RAGCacheRunnable(cache=cache)          # was: prompt | llm
        | StrOutputParser()
    )

Input `{"context": list[Document], "question": str}` (or create_retrieval_chain's `"input"`;
a `"chat_history"` of earlier turns goes to the prompt: the app's `MessagesPlaceholder`, or
RAGCache's conversation layout without `prompt`), output the answer text. A context that is
one pre-joined string raises `InputError` (its documents cannot be cached apart). Give it the
chain's own prompt, `RAGCacheRunnable(cache=cache, prompt=prompt)`, and RAGCache renders it as
the chain would (`prompts.app_prompt`: its messages and roles through the model's chat template,
every other input variable filled in, each document through `document_prompt`, joined by
`document_separator`); without `prompt` it uses the cache's own layout (`CacheConfig.prompt`).
Each document becomes one cached unit of KV, so the next request that retrieves it (after the
same documents, in the same prompt) skips its prefill. `cache_salt` keeps a tenant's KV apart.
`RAGCacheRunnable.from_vectorstore(store, cache=cache)` also retrieves (a community `FAISS`
store is searched in stages, letting RAGCache speculate); its input is the question alone.

Callbacks: each call is one chain run (`on_chain_start`/`on_chain_end`/`on_chain_error`, via
`Runnable._call_with_config` and friends, so tracing, `astream_events` and `batch` behave like
any LangChain runnable), holding one LLM run when a handler listens (`on_llm_start` with the
prompt as the model saw it, `on_llm_end` with the answer, its `usage_metadata` with
`cache_read`, and the report: `traces.report_llm_run`). What RAGCache measured (TTFT, cache
hits, sources, token ids) is also sent as the custom event `"ragcache"` (`on_custom_event`;
`astream_events` shows it).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, cast

from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForChainRun,
    CallbackManagerForChainRun,
    adispatch_custom_event,
    dispatch_custom_event,
)
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from langchain_core.vectorstores import VectorStore
from pydantic import ConfigDict, Field, PrivateAttr, field_validator

from ragcache_core.api import RAGCacheAPI, require_cache
from ragcache_core.app_prompt import NO_FRAMING, Framing
from ragcache_core.config import SamplingConfig, check_document_order
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, wrong_type
from ragcache_core.query_result import QueryResult
from ragcache_core.search import SearchSource
from ragcache_integrations.langchain.adapters import search_source
from ragcache_integrations.langchain.documents import to_langchain, to_ragcache_all
from ragcache_integrations.langchain.prompts import (
    DEFAULT_SEPARATOR,
    app_prompt,
    history_dicts,
    prompt_variables,
    shown_documents,
)
from ragcache_integrations.langchain.traces import areport_llm_run, report_llm_run

logger = logging.getLogger(__name__)

EVENT_NAME = "ragcache"
LLM_RUN_NAME = "RAGCacheRunnable"
"""The name its LLM runs are reported under (`traces.report_llm_run`)."""
RunnableInput = dict[str, Any] | str
QUESTION_KEYS = ("question", "input")
"""Where the question is looked for when `question_key` is not set: an LCEL chain's
"question", then create_retrieval_chain's "input"."""


class RAGCacheRunnable(RunnableSerializable[RunnableInput, str]):
    """Answers `{"context": documents, "question": question}` through a `RAGCache` or a
    `RAGCacheClient` (any `RAGCacheAPI`; with a client, `from_vectorstore`'s search runs here
    and its final documents go to the server).

    `search` (set by `from_vectorstore`) lets the input be the question alone; `k` wins over
    the cache's `CacheConfig.top_k` for that search. `prompt` (a LangChain prompt template with
    a `{context}` variable, `document_variable_name`) is rendered as the chain renders it; the
    question is the input's `question_key`, every other input fills the template's variables.
    Holds no per-call state: share it across threads and tasks freely. Raises `InputError` for
    a question that is not a non-empty string, a context that is not LangChain documents, or a
    document without text.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    cache: RAGCacheAPI
    search: Any = Field(default=None, description="a ragcache_core SearchSource, or None")
    k: int | None = None
    sampling: SamplingConfig | None = None
    prompt: Any = Field(default=None, description="the chain's LangChain prompt template")
    document_prompt: Any = Field(default=None, description="how each document is formatted")
    document_separator: str = DEFAULT_SEPARATOR
    document_variable_name: str = "context"
    question_key: str | None = None
    history_key: str = "chat_history"
    cache_salt: str | None = None
    document_order: str | None = None
    """"retrieval" or "cache" (None: the cache's `CacheConfig.document_order`): the order the
    prompt shows the documents in; the "ragcache" event's documents follow the served order.
    An app's own reordering (LangChain's `LongContextReorder`) runs before and wins unless it
    asks for "cache"."""
    _warned_no_context: bool = PrivateAttr(default=False)

    @field_validator("cache", mode="before")
    @classmethod
    def _check_cache(cls, value: Any) -> Any:
        return require_cache(value, "RAGCacheRunnable(cache=...)")

    @field_validator("document_order")
    @classmethod
    def _check_order(cls, value: str | None) -> str | None:
        return None if value is None else check_document_order(value)

    @field_validator("search")
    @classmethod
    def _check_search(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, SearchSource):
            raise ValueError(f"search must be a SearchSource, got {type(value).__name__}")
        return value

    @classmethod
    def from_vectorstore(
        cls,
        vectorstore: VectorStore,
        *,
        cache: RAGCacheAPI,
        k: int | None = None,
        sampling: SamplingConfig | None = None,
        prompt: Any = None,
        cache_salt: str | None = None,
        document_order: str | None = None,
        **search_options: Any,
    ) -> RAGCacheRunnable:
        """A runnable that retrieves from `vectorstore` itself (input: the question, or a dict
        of the prompt's inputs with the question under `question_key`). `search_options`
        (nprobe, sizing, ef_search) go to `adapters.search_source`. A retriever (or anything but
        a `VectorStore`) raises `TypeError` here, not at the first call."""
        check_vectorstore(vectorstore)
        require_cache(cache, "RAGCacheRunnable.from_vectorstore(store, cache=...)")
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise InputError(f"k must be a positive int, got {k!r}")
        return cls(
            cache=cache,
            search=search_source(vectorstore, **search_options),
            k=k,
            sampling=sampling,
            prompt=prompt,
            cache_salt=cache_salt,
            document_order=document_order,
        )

    # ------------------------------------------------------------------ Runnable interface

    def invoke(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> str:
        return self._call_with_config(self._invoke, input, config)

    async def ainvoke(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> str:
        return await self._acall_with_config(self._ainvoke, input, config)

    def transform(
        self, input: Iterator[RunnableInput], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[str]:
        yield from self._transform_stream_with_config(input, self._transform, config)

    def stream(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[str]:
        return self.transform(iter([input]), config, **kwargs)

    async def atransform(
        self,
        input: AsyncIterator[RunnableInput],
        config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[str]:
        async for chunk in self._atransform_stream_with_config(input, self._atransform, config):
            yield chunk

    async def astream(
        self, input: RunnableInput, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[str]:
        async def one() -> AsyncIterator[RunnableInput]:
            yield input

        async for chunk in self.atransform(one(), config, **kwargs):
            yield chunk

    # ------------------------------------------------------------------ bodies

    def _invoke(
        self, input: RunnableInput, run_manager: CallbackManagerForChainRun, config: RunnableConfig
    ) -> str:
        question, documents, framing = self._parse(input)
        llm_runs = run_manager.get_child()
        shown = bool(llm_runs.handlers)  # the prompt text only for someone who listens
        if documents is None:
            result = self.cache.query(
                question,
                search=self.search,
                top_k=self.k,
                sampling=self.sampling,
                prompt=framing.prompt,
                cache_salt=framing.cache_salt,
                return_prompt=shown,
                document_order=self.document_order,
            )
        else:
            result = self.cache.generate(
                question,
                documents,
                sampling=self.sampling,
                prompt=framing.prompt,
                cache_salt=framing.cache_salt,
                return_prompt=shown,
                document_order=self.document_order,
            )
        if shown:
            report_llm_run(llm_runs, LLM_RUN_NAME, self.cache.model, result)
        dispatch_custom_event(EVENT_NAME, self._report(result), config=config)
        return result.answer

    async def _ainvoke(
        self,
        input: RunnableInput,
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> str:
        question, documents, framing = self._parse(input)
        llm_runs = run_manager.get_child()
        shown = bool(llm_runs.handlers)
        if documents is None:
            result = await self.cache.aquery(
                question,
                search=self.search,
                top_k=self.k,
                sampling=self.sampling,
                prompt=framing.prompt,
                cache_salt=framing.cache_salt,
                return_prompt=shown,
                document_order=self.document_order,
            )
        else:
            result = await self.cache.agenerate(
                question,
                documents,
                sampling=self.sampling,
                prompt=framing.prompt,
                cache_salt=framing.cache_salt,
                return_prompt=shown,
                document_order=self.document_order,
            )
        if shown:
            await areport_llm_run(llm_runs, LLM_RUN_NAME, self.cache.model, result)
        await adispatch_custom_event(EVENT_NAME, self._report(result), config=config)
        return result.answer

    def _transform(
        self,
        inputs: Iterator[RunnableInput],
        run_manager: CallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> Iterator[str]:
        question, documents, framing = self._parse(_merge(inputs))
        llm_runs = run_manager.get_child()
        shown = bool(llm_runs.handlers)
        for chunk in self.cache.stream(question, **self._stream_args(documents, framing, shown)):
            if chunk.delta:
                yield chunk.delta
            if chunk.result is not None:
                if shown:
                    report_llm_run(llm_runs, LLM_RUN_NAME, self.cache.model, chunk.result)
                dispatch_custom_event(EVENT_NAME, self._report(chunk.result), config=config)

    async def _atransform(
        self,
        inputs: AsyncIterator[RunnableInput],
        run_manager: AsyncCallbackManagerForChainRun,
        config: RunnableConfig,
    ) -> AsyncIterator[str]:
        question, documents, framing = self._parse(_merge([c async for c in inputs]))
        llm_runs = run_manager.get_child()
        shown = bool(llm_runs.handlers)
        args = self._stream_args(documents, framing, shown)
        async for chunk in self.cache.astream(question, **args):
            if chunk.delta:
                yield chunk.delta
            if chunk.result is not None:
                if shown:
                    await areport_llm_run(llm_runs, LLM_RUN_NAME, self.cache.model, chunk.result)
                await adispatch_custom_event(EVENT_NAME, self._report(chunk.result), config=config)

    def _stream_args(
        self, documents: tuple[Document, ...] | None, framing: Framing, shown: bool
    ) -> dict[str, Any]:
        args = {
            "sampling": self.sampling,
            "prompt": framing.prompt,
            "cache_salt": framing.cache_salt,
            "return_prompt": shown,
            "document_order": self.document_order,
        }
        if documents is None:
            return {**args, "search": self.search, "top_k": self.k}
        return {**args, "documents": documents}

    # ------------------------------------------------------------------ translation

    def _parse(self, input: object) -> tuple[str, tuple[Document, ...] | None, Framing]:
        """(question, documents, framing); documents None means "retrieve with `search`"."""
        context: object = None
        inputs: Mapping[str, Any] = {}
        if isinstance(input, str):
            question: object = input
            inputs = {self.question_key or "question": input}
        elif isinstance(input, Mapping):
            inputs = input
            question = self._question(input)
            context = input.get(self.document_variable_name)
        else:
            raise InputError(
                'the input must be {"context": [Document, ...], "question": str} (or '
                'create_retrieval_chain\'s "input") or a question string, got '
                f"{type(input).__name__}"
            )
        framing = self._framing(inputs)
        if context is None:
            if self.search is None:
                raise InputError(
                    f'no "{self.document_variable_name}" in the input and no search: pass '
                    f'{{"{self.document_variable_name}": documents, "question": ...}}'
                    " or build the runnable with from_vectorstore"
                )
            if self.document_prompt is not None and self.prompt is not None:
                raise InputError(
                    "a document_prompt formats the chain's documents: pass them as "
                    f'"{self.document_variable_name}" (documents RAGCache retrieves itself are '
                    "shown as their page_content)"
                )
            return question, None, framing
        documents = self._documents(context)
        if not documents and not self._warned_no_context:
            self._warned_no_context = True
            logger.warning("the retriever returned no documents: answering without context")
        return question, documents, framing

    def _question(self, inputs: Mapping[str, Any]) -> str:
        """The question: `question_key`'s value, else (no key set) "question", else
        create_retrieval_chain's "input". `InputError` naming the key otherwise."""
        keys = (self.question_key,) if self.question_key else QUESTION_KEYS
        key = next((k for k in keys if k in inputs), keys[0])
        question = inputs.get(key)
        if not isinstance(question, str) or not question.strip():
            named = " or ".join(repr(k) for k in keys)
            raise InputError(
                f"the question ({named}) must be a non-empty string, got {question!r} "
                f"(the input has {sorted(map(str, inputs))}; set question_key= to the key "
                "your chain uses)"
            )
        return question

    def _framing(self, inputs: Mapping[str, Any]) -> Framing:
        history = history_dicts(inputs.get(self.history_key))
        if self.prompt is None:
            if history:
                return Framing(self.cache.conversation_prompt(history), self.cache_salt)
            return Framing(None, self.cache_salt) if self.cache_salt else NO_FRAMING
        if history and self.history_key not in prompt_variables(self.prompt):
            raise InputError(
                f"the input has a {self.history_key!r} but the prompt has no such variable: "
                f"the history would be dropped (add MessagesPlaceholder({self.history_key!r}) "
                "to the prompt, or set history_key=)"
            )
        prompt = app_prompt(
            self.prompt,
            inputs,
            context_key=self.document_variable_name,
            separator=self.document_separator,
        )
        return Framing(prompt, self.cache_salt)

    def _documents(self, context: object) -> tuple[Document, ...]:
        documents = _documents(context)
        if self.prompt is None:
            return documents
        if isinstance(context, LCDocument):
            return shown_documents([context], self.document_prompt)
        return shown_documents(list(context), self.document_prompt)  # type: ignore[call-overload]

    @staticmethod
    def _report(result: QueryResult) -> dict[str, Any]:
        return {
            **result.report(),
            "sources": [to_langchain(d) for d in result.sources],  # as served
            "retrieval_ranks": list(result.retrieval_ranks),
        }


def _documents(context: object) -> tuple[Document, ...]:
    """The context as documents: a list of LangChain documents (the retriever's output) or
    one document. A pre-joined string (`retriever | format_docs`) raises `InputError`: its
    documents can no longer be told apart, so none could be cached on its own."""
    if isinstance(context, str):
        raise InputError(
            "the context is one string (a `retriever | format_docs` step?): RAGCacheRunnable "
            "caches each document on its own, so give it the retriever's documents (drop "
            "format_docs; the prompt's document_prompt and document_separator format them), or "
            "keep format_docs and use RAGCacheLLM, which finds the documents in the prompt"
        )
    if isinstance(context, LCDocument):
        return to_ragcache_all([context])
    if isinstance(context, list | tuple):
        return to_ragcache_all(context)
    raise InputError(f"context must be a list of LangChain Documents, got {type(context).__name__}")


def check_vectorstore(store: object) -> None:
    """`TypeError` unless `store` is a LangChain `VectorStore`, naming what to do with a
    retriever (the usual mistake: it has no `similarity_search_with_score`)."""
    if isinstance(store, VectorStore):
        return
    fix = ""
    if isinstance(store, BaseRetriever):
        inner = getattr(store, "vectorstore", None)
        fix = (
            "pass its store (retriever.vectorstore"
            + (f", a {type(inner).__name__}" if isinstance(inner, VectorStore) else "")
            + "), or keep the retriever in the chain: "
            '{"context": retriever, "question": RunnablePassthrough()} '
            "| RAGCacheRunnable(cache=cache)"
        )
    raise wrong_type(
        "RAGCacheRunnable.from_vectorstore(store)", "a LangChain VectorStore", store, fix
    )


def _merge(chunks: Iterator[RunnableInput] | list[RunnableInput]) -> RunnableInput:
    """Add up streamed input chunks (a parallel step streams its keys as separate dicts)."""
    merged: Any = None
    chunk: Any
    for chunk in chunks:
        if merged is None:
            merged = chunk
            continue
        try:
            merged = merged + chunk
        except TypeError:  # plain dicts do not add: later keys win
            both = isinstance(merged, Mapping) and isinstance(chunk, Mapping)
            merged = {**merged, **chunk} if both else chunk
    if merged is None:
        raise InputError("the runnable received no input")
    return cast(RunnableInput, merged)
