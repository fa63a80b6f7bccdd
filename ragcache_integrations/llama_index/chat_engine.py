"""`RAGCacheChatEngine`: LlamaIndex's context and condense-plus-context chat modes, answered by
RAGCache with the documents cached and the conversation computed.

    engine = as_chat_engine(index, cache=cache, chat_mode="condense_plus_context")
    engine.chat("Who plays the Joker?")
    engine.chat("And in which film?")        # the history travels with the question

(`index.as_chat_engine(cache=cache)` silently drops `cache=`, as `as_query_engine` does: this
function takes it, and refuses any keyword it does not use, by name.)

One turn:
- `condense_plus_context` with earlier turns: the question is first rephrased into a
  standalone one (LlamaIndex's condense prompt, answered by RAGCache's model with no documents:
  nothing cached) and only that is searched; `context` searches the message itself.
- The index's retriever returns the nodes; each becomes one document, shown as LlamaIndex shows
  it (`node.get_content(MetadataMode.LLM)`, joined by a blank line).
- The prompt is LlamaIndex's context chat layout, through the model's chat template: a system
  message with the system prompt and the context template (the documents where it puts
  `{context_str}`), then the earlier turns, then the user's message. The documents follow the
  system text only, so they are cached nodes under one root whatever the conversation; the
  turns and the message are computed on every request (docs/design.md 3.3).
- The turn is kept in the engine's memory (`chat_history`, `reset()`); `chat_history=` given to
  a call is used instead for that call.

- Each LLM call (the rephrasing and the answer) emits LlamaIndex's LLM events with the messages
  sent and the answer (`events.LLMCall`: instrumentation and the engine's `callback_manager`,
  by default `Settings.callback_manager`), as a stock chat engine's LLM does.

Streaming (`stream_chat`, `astream_chat`) is not built: it raises `NotImplementedError`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Literal

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.chat_engine.condense_plus_context import DEFAULT_CONDENSE_PROMPT_TEMPLATE
from llama_index.core.chat_engine.context import DEFAULT_CONTEXT_TEMPLATE
from llama_index.core.chat_engine.types import (
    AgentChatResponse,
    BaseChatEngine,
    StreamingAgentChatResponse,
)
from llama_index.core.indices.vector_store.base import VectorStoreIndex
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index.core.settings import Settings

from ragcache_core.api import RAGCacheAPI, require_cache
from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.config import SamplingConfig, check_document_order
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.query_result import QueryResult
from ragcache_integrations.llama_index.adapters import node_to_document
from ragcache_integrations.llama_index.events import LLMCall, formatted

ChatMode = Literal["context", "condense_plus_context"]
CHAT_MODES: tuple[str, ...] = ("context", "condense_plus_context")
SEPARATOR = "\n\n"
"""Between two documents, as LlamaIndex's context chat engines join their nodes."""
_ROLES = {MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


class RAGCacheChatEngine(BaseChatEngine):
    """A LlamaIndex chat engine over `index` answered by `cache` (see the module docstring).
    Mutates only its own history (a lock guards it: one engine may serve several threads,
    each call seeing the history as it was when it started)."""

    def __init__(
        self,
        index: VectorStoreIndex,
        *,
        cache: RAGCacheAPI,
        chat_mode: ChatMode = "condense_plus_context",
        similarity_top_k: int | None = None,
        system_prompt: str | None = None,
        context_template: str | None = None,
        condense_template: str | None = None,
        chat_history: Sequence[ChatMessage] | None = None,
        sampling: SamplingConfig | None = None,
        cache_salt: str | None = None,
        document_order: str | None = None,
        callback_manager: CallbackManager | None = None,
    ) -> None:
        self._cache = require_cache(cache, "as_chat_engine(index, cache=...)")
        self.callback_manager = callback_manager or Settings.callback_manager
        if chat_mode not in CHAT_MODES:
            raise NotImplementedError(
                f"chat_mode={chat_mode!r} is not served by RAGCache (built: "
                f"{', '.join(CHAT_MODES)}); condense_question rephrases with another LLM and "
                "answers through a query engine: wrap as_query_engine(index, cache=...) in "
                "LlamaIndex's CondenseQuestionChatEngine"
            )
        template = context_template or DEFAULT_CONTEXT_TEMPLATE
        if "{context_str}" not in template:
            raise InputError("the context template needs a {context_str} variable")
        self._mode = chat_mode
        top_k = similarity_top_k or cache.config.top_k
        self._retriever = index.as_retriever(similarity_top_k=top_k)
        self._system = system_prompt
        self._context_template = template
        self._condense = condense_template or DEFAULT_CONDENSE_PROMPT_TEMPLATE
        self._sampling = sampling
        self._salt = cache_salt
        self._order = None if document_order is None else check_document_order(document_order)
        self._history: list[ChatMessage] = list(chat_history or ())
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ BaseChatEngine

    @property
    def chat_history(self) -> list[ChatMessage]:
        with self._lock:
            return list(self._history)

    def reset(self) -> None:
        with self._lock:
            self._history.clear()

    def chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        history = self._turns(message, chat_history)
        searched = self._standalone(message, history)
        nodes = self._retriever.retrieve(searched)
        app, documents = self._prompt(history, nodes)
        result = self._cache.generate(
            message,
            documents,
            sampling=self._sampling,
            prompt=app,
            cache_salt=self._salt,
            document_order=self._order,
        )
        self._events(app, message, result.sources, result)
        return self._reply(message, result, nodes, searched, keep=chat_history is None)

    async def achat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> AgentChatResponse:
        history = self._turns(message, chat_history)
        searched = await self._astandalone(message, history)
        nodes = await self._retriever.aretrieve(searched)
        app, documents = self._prompt(history, nodes)
        result = await self._cache.agenerate(
            message,
            documents,
            sampling=self._sampling,
            prompt=app,
            cache_salt=self._salt,
            document_order=self._order,
        )
        self._events(app, message, result.sources, result)
        return self._reply(message, result, nodes, searched, keep=chat_history is None)

    def stream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        raise NotImplementedError(
            "RAGCacheChatEngine does not stream yet (issue 23 left it out): use chat()"
        )

    async def astream_chat(
        self, message: str, chat_history: list[ChatMessage] | None = None
    ) -> StreamingAgentChatResponse:
        raise NotImplementedError(
            "RAGCacheChatEngine does not stream yet (issue 23 left it out): use achat()"
        )

    # ------------------------------------------------------------------ one turn

    def _turns(self, message: str, given: list[ChatMessage] | None) -> list[dict[str, str]]:
        """The earlier turns as role/content dicts (`InputError` for a bad message)."""
        if not isinstance(message, str) or not message.strip():
            raise InputError(f"the message must be a non-empty string, got {message!r}")
        history = self.chat_history if given is None else list(given)
        turns = []
        for index, turn in enumerate(history):
            role = _ROLES.get(turn.role)
            if role is None:
                raise InputError(
                    f"chat history message {index} has role {turn.role.value!r}: earlier turns "
                    "are user or assistant messages (the system prompt is system_prompt=)"
                )
            turns.append({"role": role, "content": turn.content or ""})
        return turns

    def _condense_text(self, message: str, history: list[dict[str, str]]) -> str:
        lines = "\n".join(f"{t['role']}: {t['content']}" for t in history)
        return self._condense.format(chat_history=lines, question=message)

    def _standalone(self, message: str, history: list[dict[str, str]]) -> str:
        """What is searched: the message, or (condense_plus_context with earlier turns) the
        standalone question the model rephrases it into (no documents: nothing cached)."""
        if self._mode == "context" or not history:
            return message
        text = self._condense_text(message, history)
        prompt = _plain(text)
        result = self._cache.generate(
            text, (), sampling=self._sampling, prompt=prompt, cache_salt=self._salt
        )
        self._events(prompt, text, (), result)
        return result.answer.strip() or message

    async def _astandalone(self, message: str, history: list[dict[str, str]]) -> str:
        if self._mode == "context" or not history:
            return message
        text = self._condense_text(message, history)
        prompt = _plain(text)
        result = await self._cache.agenerate(
            text, (), sampling=self._sampling, prompt=prompt, cache_salt=self._salt
        )
        self._events(prompt, text, (), result)
        return result.answer.strip() or message

    def _events(
        self, app: AppPrompt, question: str, documents: Sequence[Document], result: QueryResult
    ) -> None:
        """The LLM events of one call, with the messages it sent (`events.LLMCall`)."""
        messages = formatted(app, question, documents, chat_model=True)
        call = LLMCall(self.callback_manager, messages, self._cache.model)
        call.start()
        call.end(result)

    def _prompt(
        self, history: list[dict[str, str]], nodes: list[NodeWithScore]
    ) -> tuple[AppPrompt, tuple[Document, ...]]:
        """LlamaIndex's context chat layout with the documents at `CONTEXT`."""
        context = self._context_template.format(context_str=CONTEXT)
        system = f"{self._system}\n{context}" if self._system else context
        messages = (
            {"role": "system", "content": system},
            *history,
            {"role": "user", "content": QUESTION},
        )
        documents = tuple(
            _shown(node_to_document(n.node), n.node.get_content(metadata_mode=MetadataMode.LLM))
            for n in nodes
        )
        return AppPrompt(messages=messages, separator=SEPARATOR), documents

    def _reply(
        self,
        message: str,
        result: QueryResult,
        nodes: list[NodeWithScore],
        searched: str,
        *,
        keep: bool,
    ) -> AgentChatResponse:
        if keep:
            with self._lock:
                self._history.append(ChatMessage(role=MessageRole.USER, content=message))
                self._history.append(ChatMessage(role=MessageRole.ASSISTANT, content=result.answer))
        metadata = {**result.report(), "searched": searched}
        if len(result.retrieval_ranks) == len(nodes):  # as served (document_order="cache")
            nodes = [nodes[rank] for rank in result.retrieval_ranks]
        return AgentChatResponse(response=result.answer, source_nodes=nodes, metadata=metadata)


def _shown(document: Document, shown: str) -> Document:
    return Document(document.id, document.text, document.metadata, prompt_text=shown)


def _plain(text: str) -> AppPrompt:
    """A prompt without documents, sent through the chat template as one user message."""
    return AppPrompt(messages=({"role": "user", "content": text},))


def as_chat_engine(
    index: VectorStoreIndex,
    *,
    cache: RAGCacheAPI,
    chat_mode: ChatMode = "condense_plus_context",
    **options: Any,
) -> RAGCacheChatEngine:
    """`index.as_chat_engine(...)` answered by RAGCache (see the module docstring). `options`:
    similarity_top_k, system_prompt, context_template, condense_template, chat_history,
    sampling, cache_salt, document_order ("retrieval" or "cache": the prompt's document order;
    source nodes follow the served order), callback_manager; any other keyword raises
    `TypeError` naming it (LlamaIndex's own would drop it silently)."""
    from ragcache_integrations.llama_index.query_engine import check_index

    check_index(index)
    known = {
        "similarity_top_k",
        "system_prompt",
        "context_template",
        "condense_template",
        "chat_history",
        "sampling",
        "cache_salt",
        "document_order",
        "callback_manager",
    }
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"as_chat_engine() got keywords RAGCache does not use: {unknown} (it takes "
            f"{sorted(known)})"
        )
    return RAGCacheChatEngine(index, cache=cache, chat_mode=chat_mode, **options)
