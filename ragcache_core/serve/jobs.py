"""What an OpenAI request asks the cache to do: a `CachedJob` (question + documents under the
server's system prompt) or an `UncachedJob` (token ids, and why they cannot be cached).

Chat messages map as: the system (or developer) message is the root's system prompt, the last
user message is the question. With documents, nothing else may be in `messages` (earlier turns
have no place in the cached layout: 400). A system prompt other than the server's is served
uncached (same layout, that system prompt) and the response says so.

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
from typing import Literal

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError
from ragcache_core.serve.errors import bad_request
from ragcache_core.serve.prompts import PromptRenderer
from ragcache_core.serve.schemas import ChatMessage, ChatRequest, CompletionRequest

UncachedReason = Literal["no_documents", "system_prompt_differs"]
_SYSTEM_ROLES = ("system", "developer")
COMPLETION_MAX_TOKENS = 16
"""`/v1/completions`' default `max_tokens`, as in vLLM and OpenAI."""


@dataclass(frozen=True)
class CachedJob:
    question: str
    documents: tuple[Document, ...]
    prompt_tokens: int

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


def chat_job(request: ChatRequest, renderer: PromptRenderer) -> Job:
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
    if system_prompt != renderer.system_prompt:
        build = partial(renderer.with_system, system_prompt, question, documents)
        job = _uncached(build, "system_prompt_differs", "messages")
        return dataclasses.replace(job, doc_ids=tuple(d.id for d in documents))
    return _cached(renderer, question, documents, "messages")


def completion_job(request: CompletionRequest, renderer: PromptRenderer) -> Job:
    prompt = request.single_prompt()
    documents = request.doc_list()
    if documents is None:
        return _uncached(partial(renderer.completion, prompt), "no_documents", "prompt")
    if not isinstance(prompt, str):
        raise bad_request("with documents, the prompt is the question: a string", "prompt")
    return _cached(renderer, prompt, documents, "prompt")


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
    renderer: PromptRenderer, question: str, documents: tuple[Document, ...], param: str
) -> CachedJob:
    try:
        tokens = renderer.cached_length(question, documents)
    except InputError as exc:
        raise bad_request(str(exc), param) from None
    return CachedJob(question, documents, tokens)


def _uncached(
    build: Callable[[], Sequence[int]], reason: UncachedReason, param: str
) -> UncachedJob:
    try:
        return UncachedJob(tuple(build()), reason)
    except InputError as exc:
        raise bad_request(str(exc), param) from None
