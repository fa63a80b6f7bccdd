"""What an OpenAI request asks the cache to do, and the server's own view of prompts.

A `CachedJob` is a question + documents in a prompt (its `Framing`: the server's layout with the
request's system prompt, and the tenant's salt); an `UncachedJob` is token ids, and why they
cannot be cached. Chat messages map as: the system (or developer) message is the root's system
prompt (none: the server's `--system-prompt`), the last user message is the question. With
documents, nothing else may be in `messages` (earlier turns have no place in the cached layout:
400). Every system prompt is its own root in the knowledge tree, so no request is served
uncached because its system prompt differs from the server's.

`PromptRenderer` gives the token ids of what the server serves uncached and the length of what
it sends to the cache (to check it against the context and size a default answer):

    /v1/completions, no documents        tokenizer(prompt) with special tokens, as vLLM does
    /v1/chat/completions, no documents   the model's chat template over every message, as vLLM
    documents                            counted with the cache's PromptBuilder layout (that
                                         system prompt, that salt); the cache builds (and
                                         caches) the same ids itself

It runs on the server's renderer thread only (`ServeState.render`; `PromptBuilder` is not
thread-safe).

Sampling follows `vllm serve`: fields left out take the model's generation config (else
temperature 1, top-p 1); `max_tokens` defaults to 16 for completions and to the rest of the
context for chat.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from ragcache_core.app_prompt import NO_FRAMING, AppPrompt, Framing, default_prompt
from ragcache_core.config import PromptConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.runtime.prompt import PromptBuilder
from ragcache_core.serve.errors import bad_request
from ragcache_core.serve.schemas import ChatMessage, ChatRequest, CompletionRequest

UncachedReason = Literal["no_documents"]
_SYSTEM_ROLES = ("system", "developer")
COMPLETION_MAX_TOKENS = 16
"""`/v1/completions`' default `max_tokens`, as in vLLM and OpenAI."""


@dataclass(frozen=True)
class CachedJob:
    question: str
    documents: tuple[Document, ...]
    prompt_tokens: int
    framing: Framing = NO_FRAMING

    @property
    def doc_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.documents)


@dataclass(frozen=True)
class UncachedJob:
    prompt_ids: tuple[int, ...]
    reason: UncachedReason
    doc_ids: tuple[str, ...] = ()
    """The request's documents (in the prompt, but not cached)."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


Job = CachedJob | UncachedJob


@dataclass(frozen=True)
class GenerationDefaults:
    """The model's `generation_config.json` sampling defaults, as vLLM reads them."""

    temperature: float = 1.0
    top_p: float = 1.0

    @classmethod
    def of_model(cls, model: str) -> GenerationDefaults:
        path = Path(model) / "generation_config.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        return cls(
            temperature=float(data.get("temperature", 1.0)), top_p=float(data.get("top_p", 1.0))
        )


def chat_job(request: ChatRequest, renderer: PromptRenderer, salt: str | None = None) -> Job:
    """The job of a chat request; `salt` is the request's effective cache salt."""
    pairs = [(m, _text(m, i)) for i, m in enumerate(request.messages)]
    documents = request.doc_list()
    if documents is None:
        messages = [{"role": m.role, "content": t} for m, t in pairs]
        return _uncached(partial(renderer.chat, messages), "no_documents", "messages")
    system = [t for m, t in pairs if m.role in _SYSTEM_ROLES]
    turns = [(m, t) for m, t in pairs if m.role not in _SYSTEM_ROLES]
    if len(turns) != 1 or turns[0][0].role != "user":
        raise bad_request(
            "with documents, messages must be an optional system message and one user message "
            "(the question): earlier turns have no place in the cached prompt",
            "messages",
        )
    question = turns[0][1]
    system_prompt = "\n\n".join(system) if system else renderer.system_prompt
    framing = Framing(renderer.server_prompt(system_prompt), salt)
    return _cached(renderer, question, documents, "messages", framing)


def completion_job(
    request: CompletionRequest, renderer: PromptRenderer, salt: str | None = None
) -> Job:
    """The job of a completions request; `salt` is the request's effective cache salt."""
    prompt = request.single_prompt()
    documents = request.doc_list()
    if documents is None:
        return _uncached(partial(renderer.completion, prompt), "no_documents", "prompt")
    if not isinstance(prompt, str):
        raise bad_request("with documents, the prompt is the question: a string", "prompt")
    return _cached(renderer, prompt, documents, "prompt", Framing(None, salt))


def sampling_for(
    request: ChatRequest | CompletionRequest,
    job: Job,
    defaults: GenerationDefaults,
    max_model_len: int,
) -> SamplingConfig:
    """The request's sampling, checked against the context (400 naming the prompt field)."""
    param = "messages" if isinstance(request, ChatRequest) else "prompt"
    room = max_model_len - job.prompt_tokens
    if isinstance(request, ChatRequest):
        max_tokens = request.answer_tokens or room
    else:
        max_tokens = request.max_tokens or COMPLETION_MAX_TOKENS
    if max_tokens < 1 or job.prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{job.prompt_tokens} in the {param} and asks for {max(max_tokens, 0)} in the "
            f"completion: shorten the {param} or lower max_tokens",
            param,
        )
    return SamplingConfig(
        max_tokens=max_tokens,
        temperature=defaults.temperature if request.temperature is None else request.temperature,
        top_p=defaults.top_p if request.top_p is None else request.top_p,
        stop=request.stop_strings(),
        seed=request.seed,
        ignore_eos=request.ignore_eos,
    )


def _text(message: ChatMessage, index: int) -> str:
    """A message's text (string content or its text parts)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if any(part.type != "text" or part.text is None for part in content):
        raise bad_request("only text content parts are supported", f"messages.{index}.content")
    return "".join(part.text or "" for part in content)


def _cached(
    renderer: PromptRenderer,
    question: str,
    documents: tuple[Document, ...],
    param: str,
    framing: Framing = NO_FRAMING,
) -> CachedJob:
    try:
        tokens = renderer.cached_length(question, documents, framing)
    except InputError as exc:
        raise bad_request(str(exc), param) from None
    return CachedJob(question, documents, tokens, framing)


def _uncached(
    build: Callable[[], Sequence[int]], reason: UncachedReason, param: str
) -> UncachedJob:
    try:
        return UncachedJob(tuple(build()), reason)
    except InputError as exc:
        raise bad_request(str(exc), param) from None


class PromptRenderer:
    """Prompt ids as the server's engine will see them (see the module docstring)."""

    def __init__(self, tokenizer: Any, prompt: PromptConfig, model: str, kv_dtype: str) -> None:
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._model = model
        self._kv_dtype = kv_dtype
        self._root = PromptBuilder(tokenizer, prompt, model, kv_dtype)
        self.vocab_size = len(tokenizer)

    @property
    def system_prompt(self) -> str:
        """The server's system prompt (`--system-prompt`): the default root."""
        return self._prompt.system_prompt

    def server_prompt(self, system: str) -> AppPrompt | None:
        """The server's layout with system prompt `system` (None: the server's own, the
        default root); every system prompt is its own root in the tree."""
        if system == self._prompt.system_prompt:
            return None
        chat = self._root.uses_chat_template
        prompt = default_prompt(dataclasses.replace(self._prompt, system_prompt=system), chat)
        if chat and self._root.default_prompt.messages[0]["role"] != "system":
            # The template has no system role: the system prompt leads the user turn.
            user = system + "\n\n" + str(prompt.messages[1]["content"])
            prompt = dataclasses.replace(prompt, messages=({"role": "user", "content": user},))
        return prompt

    def cached_length(
        self, question: str, documents: Sequence[Document], framing: Framing = NO_FRAMING
    ) -> int:
        """Tokens of the prompt the cache will build for `question` over `documents`."""
        return self._root.build(question, documents, framing.prompt, framing.cache_salt).num_tokens

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
