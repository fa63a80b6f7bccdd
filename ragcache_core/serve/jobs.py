"""What an OpenAI request asks the cache to do, and the server's own view of prompts.

A `CachedJob` is a question + documents in a prompt (its `Framing`: the server's layout with the
request's system prompt, and the tenant's salt); an `UncachedJob` is token ids, and why they
cannot be cached. Chat messages map as: the system (or developer) message is the root's system
prompt (none: the server's `--system-prompt`), the last user message is the question. With
documents, earlier turns take the conversation layout (`PromptBuilder.conversation`): system
prompt, documents, the turns as sent, the question: the documents are cached nodes and the
turns are computed with the question. Every system prompt is its own root in the knowledge
tree, so no request is served uncached because its system prompt differs from the server's.

`PromptRenderer` gives the token ids of what the server serves uncached and of what it sends
to the cache (to check them against the context and size a default answer):

    /v1/completions, no documents        tokenizer(prompt) with special tokens, as vLLM does
    /v1/chat/completions, no documents   the model's chat template over every message, as vLLM
      (or vLLM-shaped documents, no ids)   (the template's `documents` kwarg included)
    documents                            built with the cache's PromptBuilder layout (that
                                         system prompt, that salt); the cache builds (and
                                         caches) the same ids itself

It runs in the server's render lanes (`ServeState.render`), off the event loop; a prompt that
cannot fit is refused before any of it is memoized, and a text too long for the context before
any of it is tokenized.

Sampling follows vLLM's `to_sampling_params` field for field (`sampling_for`; the table is in
docs/deploy.md): the seven knobs left null take the model's generation config, else vLLM's
defaults; `max_tokens` defaults to 16 for completions and to the model's `max_new_tokens`, else
the rest of the context, for chat, and is clamped to the context left after the prompt, as
`vllm serve` clamps it (more than `max_model_len` is a 400, as in vLLM).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from ragcache_core.app_prompt import NO_FRAMING, AppPrompt, Framing, default_prompt
from ragcache_core.config import GENERATION_CONFIG_KNOBS, PromptConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.errors import InputError, PromptTooLong
from ragcache_core.runtime.prompt import PromptBuilder, check_text_fits
from ragcache_core.serve.errors import bad_request
from ragcache_core.serve.known import KnownDocuments, found_documents
from ragcache_core.serve.schemas import ChatMessage, ChatRequest, CompletionRequest, OpenAIRequest

UncachedReason = Literal["no_documents", "template_documents"]
_SYSTEM_ROLES = ("system", "developer")
_MARKER = "\u2063{ragcache:"
"""How RAGCache's prompt markers begin: a text holding one is never matched."""
COMPLETION_MAX_TOKENS = 16
"""`/v1/completions`' default `max_tokens`, as in vLLM and OpenAI."""
_CONTEXT_OVER = (
    "This model's maximum context length is {limit} tokens. However, your prompt contains "
    "{tokens} input tokens, which exceeds this limit even without any output tokens. Please "
    "reduce the length of the input prompt."
)
_CONTEXT_FULL = (
    "This model's maximum context length is {limit} tokens. However, your prompt contains "
    "{tokens} input tokens, which leaves no room for output tokens. Please reduce the length "
    "of the input prompt."
)


@dataclass(frozen=True)
class CachedJob:
    question: str
    documents: tuple[Document, ...]
    prompt_ids: tuple[int, ...]
    """The ids the cache will build (the renderer uses the cache's layout)."""
    framing: Framing = NO_FRAMING
    found: bool = False
    """The documents were found in a plain request's text (`known.KnownDocuments`), not sent."""

    @property
    def doc_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.documents)

    @property
    def document_order(self) -> str | None:
        """The order to serve the documents in: found in the client's text, that text is the
        client's prompt, so never reordered (issue 40); sent, the request's (None: the
        server's `CacheConfig.document_order`)."""
        return "retrieval" if self.found else self.framing.document_order

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


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
    """The model's `generation_config.json` sampling defaults, the keys vLLM reads
    (`ModelConfig.get_diff_sampling_param`): the seven sampling knobs and `max_new_tokens`
    (chat's default `max_tokens`)."""

    values: tuple[tuple[str, float], ...] = ()
    max_tokens: int | None = None

    @classmethod
    def of_model(cls, model: str) -> GenerationDefaults:
        path = Path(model) / "generation_config.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        if not isinstance(data, dict):
            return cls()
        values = tuple(
            (k, float(data[k]) if k != "top_k" else int(data[k]))
            for k in GENERATION_CONFIG_KNOBS
            if data.get(k) is not None
        )
        new_tokens = data.get("max_new_tokens")
        return cls(values, None if new_tokens is None else int(new_tokens))

    def pick(self, name: str, given: float | None) -> Any:
        """The request's value, else the model's default, else vLLM's."""
        if given is not None:
            return given
        return dict(self.values).get(name, GENERATION_CONFIG_KNOBS[name])


def chat_job(request: ChatRequest, renderer: PromptRenderer, salt: str | None = None) -> Job:
    """The job of a chat request; `salt` is the request's effective cache salt."""
    pairs = [(m, _text(m, i)) for i, m in enumerate(request.messages)]
    documents = request.doc_list()
    if documents is None:
        messages = [{"role": m.role, "content": t, **m.template_extras()} for m, t in pairs]
        template_docs = request.template_documents or None
        plain = not template_docs and not any(m.template_extras() for m, _ in pairs)
        found = _found_chat(renderer, messages, salt) if plain else None
        if found is not None:
            return found
        build = partial(renderer.chat, messages, template_docs)
        reason: UncachedReason = "template_documents" if template_docs else "no_documents"
        return _uncached(build, reason, "messages")
    for index, (message, _) in enumerate(pairs):
        extras = message.template_extras()
        if extras:
            raise bad_request(
                f"with documents, a message has a role and content only (got "
                f"{sorted(extras)}): the cached prompt has no place for them",
                f"messages.{index}.{sorted(extras)[0]}",
            )
    system = [t for m, t in pairs if m.role in _SYSTEM_ROLES]
    turns = [(m, t) for m, t in pairs if m.role not in _SYSTEM_ROLES]
    if not turns or turns[-1][0].role != "user":
        raise bad_request(
            "with documents, the last message (after any system message) is the user's question",
            "messages",
        )
    question = turns[-1][1]
    renderer.known.add_seen(documents, salt)
    system_prompt = "\n\n".join(system) if system else renderer.system_prompt
    history = [{"role": m.role, "content": t} for m, t in turns[:-1]]
    try:
        prompt = renderer.conversation(history, system_prompt) if history else None
    except InputError as exc:
        raise bad_request(str(exc), "messages") from None
    prompt = prompt or renderer.server_prompt(system_prompt)
    framing = Framing(prompt, salt, document_order=request.document_order)
    return _cached(renderer, question, documents, "messages", framing)


def completion_job(
    request: CompletionRequest, renderer: PromptRenderer, salt: str | None = None
) -> Job:
    """The job of a completions request; `salt` is the request's effective cache salt."""
    prompt = request.single_prompt()
    documents = request.doc_list()
    if documents is None:
        found = _found_completion(renderer, prompt, salt) if isinstance(prompt, str) else None
        if found is not None:
            return found
        return _uncached(partial(renderer.completion, prompt), "no_documents", "prompt")
    if not isinstance(prompt, str):
        raise bad_request("with documents, the prompt is the question: a string", "prompt")
    renderer.known.add_seen(documents, salt)
    return _cached(renderer, prompt, documents, "prompt", Framing(None, salt))


def _found_chat(
    renderer: PromptRenderer, messages: list[dict[str, Any]], salt: str | None
) -> CachedJob | None:
    """A plain chat request as a cached job when known documents are in its messages: the
    messages exactly as sent (the ids `vllm serve` makes of them), the documents found as
    nodes. None when nothing known is found."""
    texts = [str(m["content"]) for m in messages]
    found = tuple(f for text in texts for f in renderer.known.find(text, salt))
    if not found or any(_MARKER in text for text in texts):
        return None
    users = [t for m, t in zip(messages, texts, strict=True) if m["role"] == "user" and t.strip()]
    question = users[-1] if users else texts[-1]
    framing = Framing(AppPrompt(messages=tuple(messages)), salt)
    job = _cached(renderer, question or "?", found_documents(found), "messages", framing)
    return dataclasses.replace(job, found=True)


def _found_completion(renderer: PromptRenderer, prompt: str, salt: str | None) -> CachedJob | None:
    """A plain completion prompt as a cached job when known documents are in it (the prompt
    tokenized whole with the tokenizer's special tokens, as vLLM's completions do)."""
    found = renderer.known.find(prompt, salt)
    if not found or _MARKER in prompt or not prompt.strip():
        return None
    framing = Framing(AppPrompt(text=prompt, chat=False), salt)
    job = _cached(renderer, prompt, found_documents(found), "prompt", framing)
    return dataclasses.replace(job, found=True)


def answer_tokens(
    request: OpenAIRequest, job: Job, defaults: GenerationDefaults, limit: int
) -> int:
    """`max_tokens` as vLLM's `get_max_tokens` makes it: the request's (chat: else the
    model's default; completions: 16), clamped to the context left after the prompt. 400 when
    the request asks for more than the whole context, or the prompt leaves no room."""
    prompt_param = "messages" if isinstance(request, ChatRequest) else "prompt"
    requested = request.answer_tokens
    if isinstance(request, CompletionRequest) and requested is None:
        requested = COMPLETION_MAX_TOKENS
    if requested is not None and requested > limit:
        raise bad_request(
            f"{request.answer_tokens_param}={requested} cannot be greater than "
            f"max_model_len={limit}. Please request fewer output tokens.",
            request.answer_tokens_param,
        )
    tokens = job.prompt_tokens
    if tokens > limit:
        raise bad_request(_CONTEXT_OVER.format(limit=limit, tokens=tokens), prompt_param)
    if tokens == limit:
        raise bad_request(_CONTEXT_FULL.format(limit=limit, tokens=tokens), prompt_param)
    if requested is None:
        requested = defaults.max_tokens
    room = limit - tokens
    return room if requested is None else min(requested, room)


def sampling_for(
    request: OpenAIRequest, job: Job, defaults: GenerationDefaults, max_model_len: int
) -> SamplingConfig:
    """The request's `SamplingConfig`, as vLLM's `to_sampling_params` builds its
    `SamplingParams` (docs/deploy.md, the field table): 400 naming the field for a value vLLM
    refuses, or a request that does not fit the context."""
    max_tokens = answer_tokens(request, job, defaults, max_model_len)
    try:
        given = request.sampling_fields()  # the rest: vLLM's request field of the same name
        for name in GENERATION_CONFIG_KNOBS:
            given[name] = defaults.pick(name, given[name])
        given["max_tokens"] = max_tokens
        given["logprobs"] = request.sample_logprobs
        given["logprob_token_ids"] = given["logprob_token_ids"] or None
        return SamplingConfig(**given)
    except InputError as exc:
        raise bad_request(str(exc), request_param(request, exc.param)) from None


def request_param(request: OpenAIRequest, param: str | None) -> str | None:
    """A `SamplingConfig` field as the request names it."""
    if param == "max_tokens":
        return request.answer_tokens_param
    if param == "logprobs" and isinstance(request, ChatRequest):
        return "top_logprobs"
    return param


def _text(message: ChatMessage, index: int) -> str:
    """A message's text: string content, or its text parts joined by newlines (vLLM's
    "string" content format)."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if any(part.type != "text" or part.text is None for part in content):
        raise bad_request("only text content parts are supported", f"messages.{index}.content")
    return "\n".join(part.text or "" for part in content)


def _cached(
    renderer: PromptRenderer,
    question: str,
    documents: tuple[Document, ...],
    param: str,
    framing: Framing = NO_FRAMING,
) -> CachedJob:
    try:
        ids = renderer.cached_ids(question, documents, framing)
    except InputError as exc:
        raise bad_request(str(exc), param) from None
    return CachedJob(question, documents, ids, framing)


def _uncached(
    build: Callable[[], Sequence[int]], reason: UncachedReason, param: str
) -> UncachedJob:
    try:
        return UncachedJob(tuple(build()), reason)
    except InputError as exc:
        raise bad_request(str(exc), param) from None


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
        known: KnownDocuments | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._prompt = prompt
        self._model = model
        self._kv_dtype = kv_dtype
        self._root = builder or PromptBuilder(tokenizer, prompt, model, kv_dtype)
        self.vocab_size = len(tokenizer)
        self.known = known if known is not None else KnownDocuments()
        """The documents found in plain requests (the index's, and those requests sent)."""
        self.max_model_len = max_model_len
        self._max_prompt = None if max_model_len is None else max_model_len - 1
        """A prompt must leave room for one token of answer."""

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

    def conversation(self, history: list[dict[str, Any]], system: str) -> AppPrompt:
        """The cache's conversation layout (system prompt, documents, `history`, question)."""
        return self._root.conversation(history, system)

    def cached_length(
        self, question: str, documents: Sequence[Document], framing: Framing = NO_FRAMING
    ) -> int:
        """Tokens of the prompt the cache will build for `question` over `documents`."""
        return len(self.cached_ids(question, documents, framing))

    def cached_ids(
        self, question: str, documents: Sequence[Document], framing: Framing = NO_FRAMING
    ) -> tuple[int, ...]:
        """The ids of the prompt the cache will build for `question` over `documents`
        (`PromptTooLong` when it cannot fit, before any of it is memoized)."""
        with self._in_context():
            built = self._root.build(
                question,
                documents,
                framing.prompt,
                framing.cache_salt,
                max_tokens=self._max_prompt,
            )
        return tuple(built.token_ids)

    def chat(
        self, messages: list[dict[str, Any]], documents: list[dict[str, str]] | None = None
    ) -> list[int]:
        """The model's chat template over `messages` (and vLLM's template `documents`, when
        given) with the generation prompt, tokenized without added special tokens (the
        template has them), as `vllm serve` does."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise InputError("the model has no chat template: use /v1/completions")
        self._check_chars(sum(len(m["content"]) for m in messages))
        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, documents=documents
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
