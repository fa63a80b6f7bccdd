"""What an OpenAI request asks the cache to do, and the server's own view of prompts.

A `CachedJob` is a question + documents under the server's system prompt; an `UncachedJob` is
token ids, and why they cannot be cached. Chat messages map as: the system (or developer)
message is the root's system prompt, the last user message is the question. With documents,
nothing else may be in `messages` (earlier turns have no place in the cached layout: 400). A
system prompt other than the server's is served uncached (same layout, that system prompt) and
the response says so.

`PromptRenderer` gives the token ids of what the server serves uncached and the length of what
it sends to the cache (to check it against the context and size a default answer):

    /v1/completions, no documents        tokenizer(prompt) with special tokens, as vLLM does
    /v1/chat/completions, no documents   the model's chat template over every message, as vLLM
    documents + another system prompt    RAGCache's own prompt layout with that system prompt
                                         (PromptBuilder), served uncached
    documents + the server's prompt      counted with the cache's PromptBuilder layout; the
                                         cache builds (and caches) the same ids itself

It runs in the server's render lanes (`ServeState.render`), off the event loop; a prompt that
cannot fit is refused before any of it is memoized, and a text too long for the context before
any of it is tokenized.

Sampling follows `vllm serve`: fields left out take the model's generation config (else
temperature 1, top-p 1); `max_tokens` defaults to 16 for completions and to the rest of the
context for chat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from ragcache_core.config import PromptConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, PromptTooLong
from ragcache_core.runtime.prompt import PromptBuilder, check_text_fits
from ragcache_core.serve.errors import bad_request
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


_OTHER_PROMPTS = 8
"""Builders kept for system prompts other than the server's (least recently used dropped)."""


class PromptRenderer:
    """Prompt ids as the server's engine will see them (see the module docstring).

    Bad input costs nothing: with `max_model_len`, a prompt that cannot fit is refused
    (`PromptTooLong`, the message in vLLM's words) before any of it is memoized, and a text
    longer than the context could hold before any of it is tokenized. `builder`: the cache's
    own `PromptBuilder` (then the documents counted here are memoized where the cache will
    look them up, and the cache's loop never tokenizes them again). Thread-safe (the
    server's render lanes use it side by side)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt: PromptConfig,
        model: str,
        kv_dtype: str,
        *,
        max_model_len: int | None = None,
        builder: PromptBuilder | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._model = model
        self._kv_dtype = kv_dtype
        self._root = builder or PromptBuilder(tokenizer, prompt, model, kv_dtype)
        self._others: OrderedDict[str, PromptBuilder] = OrderedDict()
        self._others_lock = threading.Lock()
        self.vocab_size = len(tokenizer)
        self.max_model_len = max_model_len
        self._max_prompt = None if max_model_len is None else max_model_len - 1
        """A prompt must leave room for one token of answer."""

    @property
    def system_prompt(self) -> str:
        """The tree root's system prompt: a request with another one is served uncached."""
        return self._prompt.system_prompt

    def cached_length(self, question: str, documents: Sequence[Document]) -> int:
        """Tokens of the prompt the cache will build for `question` over `documents`."""
        with self._in_context():
            return self._root.build(question, documents, max_tokens=self._max_prompt).num_tokens

    def with_system(self, system: str, question: str, documents: Sequence[Document]) -> list[int]:
        """The cache's prompt layout with another system prompt (served uncached)."""
        with self._others_lock:
            builder = self._others.get(system)
        if builder is None:
            prompt = dataclasses.replace(self._prompt, system_prompt=system)
            builder = PromptBuilder(
                self._tokenizer,
                prompt,
                self._model,
                self._kv_dtype,
                memo=self._root.memo,
                max_token_chars=self._root.max_token_chars,
            )
        with self._others_lock:
            self._others[system] = builder
            self._others.move_to_end(system)
            if len(self._others) > _OTHER_PROMPTS:
                self._others.popitem(last=False)
        with self._in_context():
            return builder.build(question, documents, max_tokens=self._max_prompt).token_ids

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The model's chat template over `messages` with the generation prompt, tokenized
        without added special tokens (the template has them), as `vllm serve` does."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise InputError("the model has no chat template: use /v1/completions")
        self._check_chars(sum(len(m["content"]) for m in messages))
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
            self._check_chars(len(prompt))
            return list(self._tokenizer.encode(prompt, add_special_tokens=True))
        bad = [i for i in prompt if i >= self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is out of the vocabulary ({self.vocab_size})")
        return list(prompt)

    def _check_chars(self, chars: int) -> None:
        """Refuse, before tokenizing, a text too long for the context at any tokenization."""
        if self._max_prompt is not None:
            with self._in_context():
                check_text_fits(chars, self._max_prompt, self._root.max_token_chars)

    @contextlib.contextmanager
    def _in_context(self) -> Iterator[None]:
        """`PromptTooLong` in vLLM's words (the model's maximum context length first)."""
        try:
            yield
        except PromptTooLong as exc:
            raise PromptTooLong(
                f"this model's maximum context length is {self.max_model_len} tokens: {exc}",
                tokens=exc.tokens,
                limit=exc.limit,
            ) from None


def request_chars(request: ChatRequest | CompletionRequest) -> int:
    """Characters of text in a request (its documents, messages or prompt): what its
    rendering costs, which picks its render lane. Cheap: no text is scanned."""
    chars = sum(len(d.text) for d in request.documents or ())
    if isinstance(request, ChatRequest):
        for message in request.messages:
            content = message.content
            if isinstance(content, str):
                chars += len(content)
            elif content is not None:
                chars += sum(len(part.text or "") for part in content)
        return chars
    prompt = request.prompt
    if isinstance(prompt, str):
        return chars + len(prompt)
    return chars + sum(len(p) if isinstance(p, str) else 1 for p in prompt)
