"""The LLM events of one answer, as LlamaIndex's own LLMs emit them (`llms/callbacks.py`).

Tracing tools (Arize Phoenix, Langfuse, LlamaIndex's `LlamaDebugHandler`) show a prompt from
the LLM events; RAGCache's engine has no LlamaIndex `LLM` to emit them, so `LLMCall` does:

- instrumentation: `LLMChatStartEvent` / `LLMChatInProgressEvent` (each streamed piece) /
  `LLMChatEndEvent` with the formatted messages, or the `LLMCompletion...` ones with the prompt
  text when the model has no chat template (as LlamaIndex gives a completion model a text);
- the callback manager: one `CBEventType.LLM` event, `MESSAGES` (or `PROMPT`) at its start and
  `RESPONSE` (or `COMPLETION`) at its end.

The messages are the app's prompt with the final documents and the question filled in, before
the model's chat template (what LlamaIndex's LLM receives). The response carries the usage in
the OpenAI shape: `additional_kwargs` holds `prompt_tokens`, `completion_tokens`,
`total_tokens` and `cached_tokens`; `raw` holds `{"usage": {..., "prompt_tokens_details":
{"cached_tokens": n}}, "ragcache": result.report()}`. RAGCache's search and generation overlap,
so the start event is emitted once the final documents are known (when the answer returns, or
when a stream starts), not when the engine began computing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_index.core.instrumentation as instrument
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    MessageRole,
)
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.callbacks.schema import CBEventType, EventPayload
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatInProgressEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionInProgressEvent,
    LLMCompletionStartEvent,
)

from ragcache_core.app_prompt import CONTEXT, QUESTION, AppPrompt
from ragcache_core.documents import Document, render_document
from ragcache_core.query_result import QueryResult

dispatcher = instrument.get_dispatcher(__name__)


def formatted(
    app: AppPrompt, question: str, documents: Sequence[Document], *, chat_model: bool
) -> list[ChatMessage] | str:
    """The prompt an LLM of LlamaIndex would receive: the messages with the documents and the
    question filled in (a text prompt becomes one user message for a chat model), or the text
    for a model without a chat template."""
    texts = [render_document(d, app.document, i + 1) for i, d in enumerate(documents)]
    context = app.separator.join(texts)

    def fill(content: str) -> str:
        return content.replace(QUESTION, question).replace(CONTEXT, context)

    if app.text is not None:
        chat = app.chat if app.chat is not None else chat_model
        if not chat:
            return fill(app.text)
        return [ChatMessage(role=MessageRole.USER, content=fill(app.text))]
    return [
        ChatMessage(role=MessageRole(str(m["role"])), content=fill(str(m["content"])))
        for m in app.messages
    ]


class LLMCall:
    """The events of one answer (see the module docstring): `start()`, then `progress(delta)`
    for each streamed piece, then `end(result)`. One per query; not shared between threads."""

    def __init__(
        self, callback_manager: CallbackManager, prompt: list[ChatMessage] | str, model: str
    ) -> None:
        self._callbacks = callback_manager
        self._prompt = prompt
        self._model = {"class_name": "RAGCache", "model": model}
        self._text = ""
        self._event_id = ""

    @property
    def prompt(self) -> list[ChatMessage] | str:
        return self._prompt

    def start(self) -> None:
        if isinstance(self._prompt, str):
            dispatcher.event(
                LLMCompletionStartEvent(
                    prompt=self._prompt, additional_kwargs={}, model_dict=self._model
                )
            )
            payload: dict[str, Any] = {EventPayload.PROMPT: self._prompt}
        else:
            dispatcher.event(
                LLMChatStartEvent(
                    messages=self._prompt, additional_kwargs={}, model_dict=self._model
                )
            )
            payload = {EventPayload.MESSAGES: self._prompt}
        self._event_id = self._callbacks.on_event_start(
            CBEventType.LLM,
            payload={**payload, EventPayload.ADDITIONAL_KWARGS: {}, EventPayload.SERIALIZED: {}},
        )

    def progress(self, delta: str) -> None:
        self._text += delta
        if isinstance(self._prompt, str):
            response = CompletionResponse(text=self._text, delta=delta)
            dispatcher.event(LLMCompletionInProgressEvent(prompt=self._prompt, response=response))
        else:
            dispatcher.event(
                LLMChatInProgressEvent(messages=self._prompt, response=self._chat(delta))
            )

    def end(self, result: QueryResult) -> None:
        self._text = result.answer
        counts = result.openai_usage()
        raw = {"usage": counts, "ragcache": result.report()}
        extra = {k: v for k, v in counts.items() if k != "prompt_tokens_details"}
        extra["cached_tokens"] = result.hits.cached_tokens
        if isinstance(self._prompt, str):
            completion = CompletionResponse(text=result.answer, raw=raw, additional_kwargs=extra)
            dispatcher.event(LLMCompletionEndEvent(prompt=self._prompt, response=completion))
            payload: dict[str, Any] = {
                EventPayload.PROMPT: self._prompt,
                EventPayload.COMPLETION: completion,
            }
        else:
            response = self._chat(None, raw=raw, additional_kwargs=extra)
            dispatcher.event(LLMChatEndEvent(messages=self._prompt, response=response))
            payload = {EventPayload.MESSAGES: self._prompt, EventPayload.RESPONSE: response}
        self._callbacks.on_event_end(CBEventType.LLM, payload=payload, event_id=self._event_id)

    def _chat(self, delta: str | None, **fields: Any) -> ChatResponse:
        message = ChatMessage(role=MessageRole.ASSISTANT, content=self._text)
        return ChatResponse(message=message, delta=delta, **fields)


__all__ = ["LLMCall", "formatted"]
