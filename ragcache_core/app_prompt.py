"""`AppPrompt`: the application's own prompt, with the documents (and the question) left out.

RAGCache renders the prompt the way the application would without it (docs/design.md 3.3):
its messages go through the model's chat template, or its text is sent as it is, and the
documents are spliced in where the application puts its context:

    AppPrompt(messages=({"role": "system", "content": "Answer from the context."},
                        {"role": "user", "content": CONTEXT + "\\n\\nQuestion: " + QUESTION}))

- `CONTEXT` marks where the documents go: each document as the application formats it
  (`Document.prompt_text`, else `document`), joined by `separator`. Without the marker the
  documents must already be in the text (an LLM that received a rendered prompt): they are
  found there, in order.
- `QUESTION` marks where the question goes (optional: an application that formatted its
  question in already leaves it out; the question is then only what retrieval searches for).

Everything before the first document is the request's root (one cached root per distinct
text and tenant salt); everything after the last one is computed on every request. Frozen and
JSON-able (`to_json`/`from_json`), so it travels to `ragcache serve` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ragcache_core.config import PromptConfig, check_document_order
from ragcache_core.documents import DEFAULT_DOC_TEMPLATE, DocumentTemplate
from ragcache_core.errors import InputError

CONTEXT = "\u2063{ragcache:context}\u2063"
"""Put this where the documents go (once, in one message or in the text)."""
QUESTION = "\u2063{ragcache:question}\u2063"
"""Put this where the question goes (optional, any number of times)."""


@dataclass(frozen=True)
class AppPrompt:
    """The application's prompt around the documents (see the module docstring).

    Exactly one of `messages` (chat: rendered through the model's chat template with the
    generation prompt, as `vllm serve`'s chat route does) and `text` (sent as it is, as
    `vllm serve`'s completions route does) is given.

    - `messages`: OpenAI-style messages, each a mapping with a string `role` and `content`
      (other keys, such as `name`, reach the chat template as they are).
    - `text`: the prompt text; `chat` None sends it through the model's chat template as one
      user message when the model has one (what a chat model does with a string prompt), False
      never, True always. `special_tokens`: tokenize it with the tokenizer's special tokens (as
      vLLM's completions do); `bos`: put the tokenizer's BOS id in front.
    - `separator`: the text between two documents; `document`: how a document without a
      `prompt_text` is shown.
    - `chat_template_kwargs`: extra variables for the chat template (`tools`, `documents`,
      `date_string`, ...), as vLLM's `chat_template_kwargs`.

    Raises `InputError` for a prompt with both or neither form, a marker twice, or messages
    without a string role and content.
    """

    messages: tuple[Mapping[str, Any], ...] = ()
    text: str | None = None
    separator: str = ""
    document: DocumentTemplate = DEFAULT_DOC_TEMPLATE
    chat: bool | None = None
    special_tokens: bool = True
    bos: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.text is None) == (not self.messages):
            raise InputError("an AppPrompt has messages or a text, exactly one of them")
        messages = []
        for index, message in enumerate(self.messages):
            if not isinstance(message, Mapping):
                raise InputError(f"message {index} must be a mapping, got {type(message).__name__}")
            if not isinstance(message.get("role"), str):
                raise InputError(f"message {index} needs a string 'role'")
            if not isinstance(message.get("content"), str):
                raise InputError(f"message {index} needs a string 'content'")
            messages.append(MappingProxyType(dict(message)))
        object.__setattr__(self, "messages", tuple(messages))
        if self.text is not None and not isinstance(self.text, str):
            raise InputError(f"the prompt text must be a string, got {type(self.text).__name__}")
        if sum(part.count(CONTEXT) for part in self.parts) > 1:
            raise InputError("the prompt marks its context (CONTEXT) more than once")
        if not isinstance(self.separator, str):
            raise InputError("the document separator must be a string")
        kwargs = dict(self.chat_template_kwargs)
        if not all(isinstance(k, str) for k in kwargs):
            raise InputError("chat_template_kwargs keys must be strings")
        object.__setattr__(self, "chat_template_kwargs", MappingProxyType(kwargs))

    @property
    def parts(self) -> tuple[str, ...]:
        """The texts the markers may sit in (each message's content, or the text)."""
        if self.text is not None:
            return (self.text,)
        return tuple(str(m["content"]) for m in self.messages)

    @property
    def has_context(self) -> bool:
        """Whether the prompt marks where the documents go (else they are in the text)."""
        return any(CONTEXT in part for part in self.parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": [dict(m) for m in self.messages],
            "text": self.text,
            "separator": self.separator,
            "document": {"titled": self.document.titled, "untitled": self.document.untitled},
            "chat": self.chat,
            "special_tokens": self.special_tokens,
            "bos": self.bos,
            "chat_template_kwargs": dict(self.chat_template_kwargs),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AppPrompt:
        """The prompt `to_json` wrote. Raises `InputError` for anything else."""
        if not isinstance(data, Mapping):
            raise InputError("the prompt must be a JSON object")
        try:
            document = data.get("document") or {}
            return cls(
                messages=tuple(data.get("messages") or ()),
                text=data.get("text"),
                separator=data.get("separator", ""),
                document=DocumentTemplate(**document) if document else DEFAULT_DOC_TEMPLATE,
                chat=data.get("chat"),
                special_tokens=bool(data.get("special_tokens", True)),
                bos=bool(data.get("bos", False)),
                chat_template_kwargs=dict(data.get("chat_template_kwargs") or {}),
            )
        except TypeError as exc:
            raise InputError(f"the prompt has a field this version cannot read: {exc}") from None


def default_prompt(config: PromptConfig, chat: bool) -> AppPrompt:
    """RAGCache's own layout from a `PromptConfig` (the default root): the system prompt, then
    the documents through `config.document`, then `config.question` (with a chat template: a
    system message and a user message holding documents and question)."""
    question = config.question.replace("{question}", QUESTION)
    if chat:
        return AppPrompt(
            messages=(
                {"role": "system", "content": config.system_prompt},
                {"role": "user", "content": CONTEXT + question},
            ),
            document=config.document,
        )
    return AppPrompt(
        text=config.head.format(system=config.system_prompt) + CONTEXT + question,
        document=config.document,
        chat=False,
        special_tokens=False,
        bos=config.add_bos,
    )


@dataclass(frozen=True)
class Framing:
    """What frames one request's documents: the app's prompt (None: the cache's configured
    layout, its default root) and the tenant's `cache_salt` (None: unsalted). A salted
    request reaches only KV stored under the same salt. `return_prompt`: the result carries
    the rendered prompt (`QueryResult.prompt_text`). `document_order`: "retrieval" or
    "cache" for this request (None: `CacheConfig.document_order`)."""

    prompt: AppPrompt | None = None
    cache_salt: str | None = None
    return_prompt: bool = False
    document_order: str | None = None

    def __post_init__(self) -> None:
        if self.prompt is not None and not isinstance(self.prompt, AppPrompt):
            raise InputError(f"prompt must be an AppPrompt, got {type(self.prompt).__name__}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise InputError("cache_salt must be a non-empty string (or left out)")
        if self.document_order is not None:
            check_document_order(self.document_order)


NO_FRAMING = Framing()


HISTORY_ROLES = ("user", "assistant", "tool")
"""The roles an earlier turn of a conversation may have."""


def history_messages(turns: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    """Earlier turns of a conversation as `AppPrompt` messages: each a mapping with a `role`
    among `HISTORY_ROLES` and a string `content`. Raises `InputError` naming the turn that is
    not one, or a turn holding one of the markers (its text would be taken for the context)."""
    out = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise InputError(f"history turn {index} must be a mapping, got {type(turn).__name__}")
        role, content = turn.get("role"), turn.get("content")
        if role not in HISTORY_ROLES:
            raise InputError(
                f"history turn {index} has role {role!r}: earlier turns are "
                f"{', '.join(HISTORY_ROLES)} (a system prompt is given apart)"
            )
        if not isinstance(content, str):
            raise InputError(f"history turn {index} needs a string 'content'")
        if CONTEXT in content or QUESTION in content:
            raise InputError(f"history turn {index} holds a RAGCache marker")
        out.append(MappingProxyType({"role": role, "content": content}))
    return tuple(out)


def conversation_prompt(
    system_prompt: str,
    history: Sequence[Mapping[str, Any]],
    *,
    document: DocumentTemplate = DEFAULT_DOC_TEMPLATE,
    separator: str = "",
    system_role: bool = True,
) -> AppPrompt:
    """RAGCache's layout for a conversation (docs/design.md 3.3): the documents right after the
    system prompt, then the earlier turns as they were, then the question as the final user
    turn, all through the model's chat template:

        system: <system_prompt>\\n\\n<documents>  ─ root, then one cached node per document
        <turn 1> ... <turn n>                     ─ computed (the rest)
        user: <question>                          ─ computed

    The turns follow the documents so that they are never part of a cached path: the same
    documents hit whatever conversation retrieves them. `system_role` False (a chat template
    without a system role): the system prompt and the documents lead the first user turn.
    Raises `InputError` for a turn that is not a user/assistant/tool message."""
    turns = history_messages(history)
    head = system_prompt + "\n\n" + CONTEXT if system_prompt else CONTEXT
    if system_role:
        messages = (
            {"role": "system", "content": head},
            *turns,
            {"role": "user", "content": QUESTION},
        )
    elif not turns:
        messages = ({"role": "user", "content": head + "\n\n" + QUESTION},)
    elif turns[0]["role"] == "user":
        first = {"role": "user", "content": head + "\n\n" + str(turns[0]["content"])}
        messages = (first, *turns[1:], {"role": "user", "content": QUESTION})
    else:
        raise InputError(
            "the model's chat template has no system role and the history does not start "
            "with a user turn: there is no place for the documents before the turns"
        )
    return AppPrompt(messages=messages, document=document, separator=separator)
