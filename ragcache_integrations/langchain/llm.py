"""`RAGCacheLLM`: for chains where only the LLM node can change (`prompt | llm`).

The LLM receives the rendered prompt text, where the retrieved documents are already pasted in.
To cache them it must find them again: `DocumentMemory` remembers the documents your retriever
returned (register it with `llm.watch(retriever)`, or pass `llm.memory` as a callback), and
`DocumentMemory.find` locates their texts in the prompt:

    "<preamble>" doc1 "<sep>" doc2 "<tail>"  ->  root "<preamble>", nodes doc1, "<sep>" doc2,
                                                 computed "<tail>"

The prompt is sent exactly as LangChain rendered it (as a completions LLM would send it to
`vllm serve`: tokenized whole, with the tokenizer's special tokens); the documents found in it
become cached nodes, the text before the first one the root. A prompt in which no remembered
document is found is answered without caching any document, and every such prompt is logged:
a warning when no retriever reports to the memory (attach one), an info line when one does
(a step without documents, such as create_history_aware_retriever's rephrase). (A chat
prompt reaches an LLM as LangChain's "System: ...\\nHuman: ..." text; a chat
app keeps its roles with `RAGCacheRunnable(prompt=...)`.)
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.callbacks.manager import (
    AsyncCallbackManagerForLLMRun,
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForLLMRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document as LCDocument
from langchain_core.language_models.llms import LLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda
from pydantic import ConfigDict, Field, model_validator

from ragcache_core.api import RAGCacheAPI, require_cache
from ragcache_core.app_prompt import AppPrompt
from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.query_result import QueryResult
from ragcache_integrations.langchain.documents import to_ragcache

logger = logging.getLogger(__name__)


FOUND_ORDER = "retrieval"
"""The chat model and the LLM find the documents in text the app already formatted: that text
is the app's prompt, so its documents are never reordered (issue 40), whatever
`CacheConfig.document_order` says. For a cache-ordered prompt, use `RAGCacheRunnable`."""


@dataclass(frozen=True)
class PromptSplit:
    """A rendered prompt taken apart: the documents found in it, in prompt order, and the
    remaining text (the question part)."""

    documents: tuple[Document, ...]
    question: str


class DocumentMemory(BaseCallbackHandler):
    """The documents retrievers returned lately, keyed by text (an LRU of `max_documents`).

    As a LangChain callback handler it records every `on_retriever_end` of the runs it is
    attached to; `remember` records documents directly. Thread-safe.
    """

    run_inline = True  # record before the next step of the chain formats the prompt

    def __init__(self, max_documents: int = 10_000, max_separator: int = 32) -> None:
        if max_documents < 1 or max_separator < 0:
            raise InputError("max_documents must be positive and max_separator not negative")
        self.max_documents = max_documents
        self.max_separator = max_separator
        self._docs: OrderedDict[str, Document] = OrderedDict()
        self._lock = threading.Lock()
        self.attached = False
        """Whether a retriever reports here (`watch`, this handler on a run, or `remember`):
        a prompt without remembered documents is then a step without documents, not a
        missing attachment."""

    def __len__(self) -> int:
        return len(self._docs)

    def remember(self, documents: Iterable[LCDocument]) -> None:
        """Record `documents` (documents without text are skipped: they cannot be cached)."""
        converted = [to_ragcache(d) for d in documents if d.page_content.strip()]
        self.attached = True
        with self._lock:
            for doc in converted:
                self._docs[doc.text] = doc
                self._docs.move_to_end(doc.text)
            while len(self._docs) > self.max_documents:
                self._docs.popitem(last=False)

    def on_retriever_start(
        self,
        serialized: dict[str, Any],
        query: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self.attached = True

    def on_retriever_end(
        self,
        documents: Sequence[LCDocument],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self.remember(documents)

    def find(self, prompt: str) -> tuple[Document, ...]:
        """The remembered documents found in `prompt`, in prompt order, each shown exactly as
        found (`prompt_text`); overlapping finds keep the earliest, longest one. Pure."""
        return tuple(replace(doc, prompt_text=doc.text) for _, _, doc in self._spans(prompt))

    def _spans(self, prompt: str) -> list[tuple[int, int, Document]]:
        """(start, end, document) of each remembered document found in `prompt`, by position;
        of overlapping finds the earliest, longest one."""
        with self._lock:
            docs = list(self._docs.values())
        found = []
        for doc in docs:
            start = prompt.find(doc.text)
            if start >= 0:
                found.append((start, -len(doc.text), doc))
        found.sort(key=lambda item: (item[0], item[1]))  # by position, longest first
        chosen: list[tuple[int, int, Document]] = []
        end = 0
        for start, neg_len, doc in found:
            if start >= end:  # skip documents overlapping one already chosen
                chosen.append((start, start - neg_len, doc))
                end = start - neg_len
        return chosen

    def split(self, prompt: str) -> PromptSplit | None:
        """Find remembered documents in `prompt` (pure; None when none are found or the text
        between two found documents is more than a short separator)."""
        chosen = self._spans(prompt)
        if not chosen:
            return None
        for (_, prev_end, _), (start, _, _) in itertools.pairwise(chosen):
            if len("".join(prompt[prev_end:start].split())) > self.max_separator:
                return None
        preamble, tail = prompt[: chosen[0][0]].strip(), prompt[chosen[-1][1] :].strip()
        question = "\n\n".join(part for part in (preamble, tail) if part)
        if not question:
            return None
        return PromptSplit(tuple(doc for _, _, doc in chosen), question)


class RAGCacheLLM(LLM):
    """A LangChain LLM answering through a `RAGCache` or a `RAGCacheClient`: `cache=`, as in
    every integration. Documents found in the prompt by `memory` are cached; see the module
    docstring. `generation_info` carries TTFT, cache hits and token ids.

    LangChain's LLMs have a `cache` field of their own (an LLM response cache): here `cache=`
    is the `RAGCacheAPI`, kept in `ragcache`; LangChain's response cache stays unset."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    ragcache: RAGCacheAPI
    """The cache this LLM answers through (given as `cache=`)."""

    @model_validator(mode="before")
    @classmethod
    def _take_cache(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = data.get("cache")
        if not isinstance(given, RAGCacheAPI):
            # No RAGCache given: a wrong object as cache= (not LangChain's own response cache
            # either), or nothing at all. Name it here rather than as pydantic's "ragcache:
            # Field required" about a keyword nobody typed.
            require_cache(
                given if not _is_langchain_cache(given) else None, "RAGCacheLLM(cache=...)"
            )
        data = dict(data)
        data["ragcache"] = data.pop("cache")
        return data

    sampling: SamplingConfig | None = None
    cache_salt: str | None = None
    memory: DocumentMemory = Field(default_factory=DocumentMemory)

    @property
    def _llm_type(self) -> str:
        return "ragcache"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.ragcache.model, "sampling": repr(self.sampling)}

    def watch(self, retriever: Runnable[Any, Any]) -> Runnable[Any, Any]:
        """`retriever` with `memory` attached, so the documents it returns are recognised. A
        `BaseRetriever` stays one (`WatchedRetriever`), so chains that treat retrievers apart
        (create_retrieval_chain gives a retriever the "input" only) keep doing so."""
        return watched(retriever, self.memory)

    @property
    def remember_documents(self) -> Runnable[list[LCDocument], list[LCDocument]]:
        """A pass-through step recording documents: `retriever | llm.remember_documents`."""

        def remember(documents: list[LCDocument]) -> list[LCDocument]:
            self.memory.remember(documents)
            return documents

        return RunnableLambda(remember, name="remember_documents")

    # ------------------------------------------------------------------ LangChain hooks

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        return self._generate([prompt], stop, run_manager).generations[0][0].text

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for prompt in prompts:
            question, documents, sampling, app = self._request(prompt, stop)
            result = self.ragcache.generate(
                question,
                documents,
                sampling=sampling,
                prompt=app,
                cache_salt=self.cache_salt,
                document_order=FOUND_ORDER,
            )
            generations.append([Generation(text=result.answer, generation_info=_info(result))])
        return LLMResult(generations=generations)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        generations = []
        for prompt in prompts:
            question, documents, sampling, app = self._request(prompt, stop)
            result = await self.ragcache.agenerate(
                question,
                documents,
                sampling=sampling,
                prompt=app,
                cache_salt=self.cache_salt,
                document_order=FOUND_ORDER,
            )
            generations.append([Generation(text=result.answer, generation_info=_info(result))])
        return LLMResult(generations=generations)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        question, documents, sampling, app = self._request(prompt, stop)
        pieces = self.ragcache.stream(
            question,
            documents=documents,
            sampling=sampling,
            prompt=app,
            cache_salt=self.cache_salt,
            document_order=FOUND_ORDER,
        )
        for piece in pieces:
            chunk = _chunk(piece.delta, piece.result)
            if run_manager is not None and piece.delta:
                run_manager.on_llm_new_token(piece.delta, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        question, documents, sampling, app = self._request(prompt, stop)
        pieces = self.ragcache.astream(
            question,
            documents=documents,
            sampling=sampling,
            prompt=app,
            cache_salt=self.cache_salt,
            document_order=FOUND_ORDER,
        )
        async for piece in pieces:
            chunk = _chunk(piece.delta, piece.result)
            if run_manager is not None and piece.delta:
                await run_manager.on_llm_new_token(piece.delta, chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ translation

    def _request(
        self, prompt: object, stop: list[str] | None
    ) -> tuple[str, tuple[Document, ...], SamplingConfig, AppPrompt]:
        """(question, documents found, sampling, the prompt exactly as LangChain rendered it)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise InputError(f"the prompt must be a non-empty string, got {prompt!r}")
        sampling = self.sampling or self.ragcache.config.sampling
        if stop:
            sampling = replace(sampling, stop=tuple(stop))
        documents = self.memory.find(prompt)
        if not documents:
            say_uncached(self.memory, "RAGCacheLLM")
        return prompt, documents, sampling, AppPrompt(text=prompt, chat=False)


def watched(retriever: Runnable[Any, Any], memory: DocumentMemory) -> Runnable[Any, Any]:
    """`retriever` reporting its documents to `memory` (`RAGCacheLLM.watch`)."""
    memory.attached = True
    if isinstance(retriever, BaseRetriever):
        return WatchedRetriever(inner=retriever, memory=memory)
    return retriever.with_config(callbacks=[memory])


def say_uncached(memory: DocumentMemory, who: str) -> None:
    """Say, on every prompt it applies to, why `who` answers a prompt without caching."""
    if not memory.attached:
        logger.warning(
            "%s found no remembered documents in the prompt and no retriever reports to its "
            "memory: answering without caching any (attach the retriever with "
            "llm.watch(retriever))",
            who,
        )
    else:
        logger.info(
            "%s: none of the %d documents the retriever returned is in this prompt (a step "
            "without documents, such as a question rephrase): answering without caching any",
            who,
            len(memory),
        )


class WatchedRetriever(BaseRetriever):
    """A retriever whose documents `memory` remembers (`RAGCacheLLM.watch`): it returns
    what `inner` returns, through LangChain's retriever callbacks."""

    inner: BaseRetriever
    memory: DocumentMemory

    model_config = ConfigDict(arbitrary_types_allowed=True)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[LCDocument]:
        documents = self.inner.invoke(query, config={"callbacks": run_manager.get_child()})
        self.memory.remember(documents)
        return documents

    async def _aget_relevant_documents(
        self, query: str, *, run_manager: AsyncCallbackManagerForRetrieverRun
    ) -> list[LCDocument]:
        documents = await self.inner.ainvoke(query, config={"callbacks": run_manager.get_child()})
        self.memory.remember(documents)
        return documents


def _info(result: QueryResult) -> dict[str, Any]:
    return {
        **result.report(),
        "finish_reason": result.finish_reason,
        "documents": [d.id for d in result.sources],
    }


def _chunk(delta: str, result: QueryResult | None) -> GenerationChunk:
    return GenerationChunk(text=delta, generation_info=_info(result) if result else None)


def _is_langchain_cache(value: object) -> bool:
    """Whether `value` fits LangChain's own `cache` field of an LLM (a response cache)."""
    from langchain_core.caches import BaseCache

    return value is None or isinstance(value, bool | BaseCache)
