"""`RAGCacheChatModel`: a LangChain chat model answering through RAGCache, for the LLM node
where `ChatOpenAI` sat.

    llm = RAGCacheChatModel(cache=cache)                       # was: ChatOpenAI(...)
    retriever = llm.watch(store.as_retriever())                 # its documents get cached
    chain = create_retrieval_chain(retriever, create_stuff_documents_chain(llm, prompt))
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm

The messages keep their roles: they go through the model's chat template (what `vllm serve`
does with `ChatOpenAI`'s messages), so the prompt ids are the ones a plain chat model would
send. The documents are the retriever's (`watch`, `remember_documents` or `memory` as a
callback: the same `DocumentMemory` as `RAGCacheLLM`, the same ids as `RAGCacheRunnable`),
found where the prompt pasted them; each becomes one cached unit of KV, the text before the
first the root, everything after computed. A prompt with none of them is answered uncached
(and logged, as `RAGCacheLLM` does).

The answer is an `AIMessage` (streamed: `AIMessageChunk`s, the usage and report on the last)
with LangChain's `usage_metadata` (`input_token_details["cache_read"]`: the prompt tokens
served from the cache, where `ChatOpenAI` puts OpenAI's `cached_tokens`) and RAGCache's report
in `response_metadata["ragcache"]` (TTFT, hits per tier, token ids, document ids). LangChain's
own callbacks fire as for any chat model: `on_chat_model_start` with the messages,
`on_llm_new_token` while streaming, `on_llm_end` with the message and its usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.documents import Document as LCDocument
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from pydantic import ConfigDict, Field, model_validator

from ragcache_core.api import RAGCacheAPI, require_cache
from ragcache_core.app_prompt import AppPrompt
from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.query_result import QueryResult
from ragcache_integrations.langchain.llm import FOUND_ORDER, DocumentMemory, say_uncached, watched
from ragcache_integrations.langchain.prompts import message_dict
from ragcache_integrations.langchain.traces import ai_message, response_metadata, usage_metadata


@dataclass(frozen=True)
class ChatRequest:
    """One chat call as RAGCache takes it: the messages as the app's prompt (no markers: the
    documents are found where they were pasted), the documents found, the sampling."""

    question: str
    documents: tuple[Document, ...]
    prompt: AppPrompt
    sampling: SamplingConfig


class RAGCacheChatModel(BaseChatModel):
    """A `BaseChatModel` answering through a `RAGCache` or a `RAGCacheClient` (`cache=`); see
    the module docstring. `sampling` (None: the cache's) is used for every call, a call's
    `stop` words replacing its stop strings (as `ChatOpenAI`'s do); `cache_salt` keeps a
    tenant's KV apart. Holds no per-call state beyond `memory`'s documents (thread-safe):
    share it freely. Raises `InputError` for messages the
    model cannot take (non-text content), keyword arguments it does not support, and
    RAGCache's own bad-input errors.

    LangChain's chat models have a `cache` field of their own (a response cache): a
    `RAGCacheAPI` passed as `cache=` is taken as RAGCache's and kept in `ragcache`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    ragcache: RAGCacheAPI
    """The cache this model answers through (given as `cache=`)."""
    sampling: SamplingConfig | None = None
    cache_salt: str | None = None
    memory: DocumentMemory = Field(default_factory=DocumentMemory)

    @model_validator(mode="before")
    @classmethod
    def _take_cache(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "ragcache" in data:
            raise InputError("pass the RAGCache as cache=, as to every RAGCache integration")
        given = data.get("cache")
        require_cache(given, "RAGCacheChatModel(cache=...)")
        data = dict(data)
        data["ragcache"] = data.pop("cache")
        return data

    @property
    def _llm_type(self) -> str:
        return "ragcache-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.ragcache.model,
            "sampling": repr(self.sampling),
            "cache_salt": self.cache_salt,  # (a tenant's answers never share a response cache)
        }

    def watch(self, retriever: Runnable[Any, Any]) -> Runnable[Any, Any]:
        """`retriever` with `memory` attached, so the documents it returns are recognised in
        the prompt (a `BaseRetriever` stays one; see `RAGCacheLLM.watch`)."""
        return watched(retriever, self.memory)

    def remember(self, documents: Sequence[LCDocument]) -> None:
        """Record `documents` as retrieved (for prompts built without a watched retriever)."""
        self.memory.remember(documents)

    # ------------------------------------------------------------------ LangChain hooks

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs)
        result = self.ragcache.generate(
            request.question,
            request.documents,
            sampling=request.sampling,
            prompt=request.prompt,
            cache_salt=self.cache_salt,
            document_order=FOUND_ORDER,
        )
        return self._result(result)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs)
        result = await self.ragcache.agenerate(
            request.question,
            request.documents,
            sampling=request.sampling,
            prompt=request.prompt,
            cache_salt=self.cache_salt,
            document_order=FOUND_ORDER,
        )
        return self._result(result)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        pieces = self.ragcache.stream(
            request.question,
            documents=request.documents,
            sampling=request.sampling,
            prompt=request.prompt,
            cache_salt=self.cache_salt,
            document_order=FOUND_ORDER,
        )
        for piece in pieces:
            chunk = self._chunk(piece.delta, piece.result)
            if run_manager is not None and piece.delta:
                run_manager.on_llm_new_token(piece.delta, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs)
        pieces = self.ragcache.astream(
            request.question,
            documents=request.documents,
            sampling=request.sampling,
            prompt=request.prompt,
            cache_salt=self.cache_salt,
            document_order=FOUND_ORDER,
        )
        async for piece in pieces:
            chunk = self._chunk(piece.delta, piece.result)
            if run_manager is not None and piece.delta:
                await run_manager.on_llm_new_token(piece.delta, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ translation

    def _request(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: Mapping[str, Any]
    ) -> ChatRequest:
        unknown = sorted(k for k, v in kwargs.items() if v is not None)
        if unknown:
            raise InputError(
                f"RAGCacheChatModel does not take {', '.join(unknown)} (set sampling= on the "
                "model; stop words may be given per call)"
            )
        dicts = chat_dicts(messages)
        documents: list[Document] = []
        for message in dicts:
            documents.extend(self.memory.find(str(message["content"])))
        if not documents:
            say_uncached(self.memory, "RAGCacheChatModel")
        sampling = self.sampling or self.ragcache.config.sampling
        if stop:
            sampling = replace(sampling, stop=tuple(stop))
        return ChatRequest(
            question=question_of(dicts),
            documents=tuple(documents),
            prompt=AppPrompt(messages=tuple(dicts)),
            sampling=sampling,
        )

    def _result(self, result: QueryResult) -> ChatResult:
        message = ai_message(result, self.ragcache.model)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _chunk(self, delta: str, result: QueryResult | None) -> ChatGenerationChunk:
        if result is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=delta))
        message = AIMessageChunk(
            content=delta,
            usage_metadata=usage_metadata(result),
            response_metadata=response_metadata(result, self.ragcache.model),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message)


def chat_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as the OpenAI messages `ChatOpenAI` would send (`InputError` for an
    empty list or content the model cannot take)."""
    if not messages:
        raise InputError("the chat model received no messages")
    return [message_dict(m) for m in messages]


def question_of(messages: Sequence[Mapping[str, Any]]) -> str:
    """What the request asks: the last non-empty user message (else the last non-empty
    message). The prompt carries no question marker, so this is only the request's label."""
    texts = [(m["role"], str(m["content"])) for m in messages if str(m["content"]).strip()]
    if not texts:
        raise InputError("every message is empty: there is nothing to answer")
    users = [text for role, text in texts if role == "user"]
    return users[-1] if users else texts[-1][1]
