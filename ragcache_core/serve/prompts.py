"""The server's own view of prompts: token ids for what it serves uncached, and the length of
what it sends to the cache (to check it against the context and size a default answer).

    /v1/completions, no documents        tokenizer(prompt) with special tokens, as vLLM does
    /v1/chat/completions, no documents   the model's chat template over every message, as vLLM
    documents + another system prompt    RAGCache's own prompt layout with that system prompt
                                         (PromptBuilder), served uncached
    documents + the server's prompt      counted with the cache's PromptBuilder layout; the
                                         cache builds (and caches) the same ids itself

Runs on the server's renderer thread only (`ServeState.render`; `PromptBuilder` is not
thread-safe).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ragcache_core.config import PromptConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.pipeline.prompt import PromptBuilder

_OTHER_PROMPTS = 8
"""Builders kept for system prompts other than the server's (least recently used dropped)."""


class PromptRenderer:
    """Prompt ids as the server's engine will see them (see the module docstring)."""

    def __init__(self, tokenizer: Any, prompt: PromptConfig, model: str, kv_dtype: str) -> None:
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._model = model
        self._kv_dtype = kv_dtype
        self._root = PromptBuilder(tokenizer, prompt, model, kv_dtype)
        self._others: OrderedDict[str, PromptBuilder] = OrderedDict()
        self.vocab_size = len(tokenizer)

    @property
    def system_prompt(self) -> str:
        """The tree root's system prompt: a request with another one is served uncached."""
        return self._prompt.system_prompt

    def cached_length(self, question: str, documents: Sequence[Document]) -> int:
        """Tokens of the prompt the cache will build for `question` over `documents`."""
        return self._root.build(question, documents).num_tokens

    def with_system(self, system: str, question: str, documents: Sequence[Document]) -> list[int]:
        """The cache's prompt layout with another system prompt (served uncached)."""
        builder = self._others.get(system)
        if builder is None:
            prompt = dataclasses.replace(self._prompt, system_prompt=system)
            builder = PromptBuilder(self._tokenizer, prompt, self._model, self._kv_dtype)
            self._others[system] = builder
            if len(self._others) > _OTHER_PROMPTS:
                self._others.popitem(last=False)
        self._others.move_to_end(system)
        return builder.build(question, documents).token_ids

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The model's chat template over `messages` with the generation prompt, tokenized
        without added special tokens (the template has them), as `vllm serve` does."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise InputError("the model has no chat template: use /v1/completions")
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # the template refused the messages (e.g. jinja's raise)
            raise InputError(f"the chat template cannot render these messages: {exc}") from exc
        return list(self._tokenizer.encode(str(text), add_special_tokens=False))

    def completion(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids: a string tokenized with special tokens, ids checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise InputError("the prompt is empty")
            return list(self._tokenizer.encode(prompt, add_special_tokens=True))
        bad = [i for i in prompt if i >= self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is out of the vocabulary ({self.vocab_size})")
        return list(prompt)
