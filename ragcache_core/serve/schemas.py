"""Request bodies the server accepts, validated by pydantic (a bad one is a 400 naming the field).

OpenAI's `/v1/chat/completions` and `/v1/completions` (the fields RAGCache can honour; other
OpenAI fields are ignored as `vllm serve` ignores unknown ones, and a few it cannot honour are
refused by name: `n` > 1, `logprobs`, `echo`, `tools`), plus two extensions:

    "documents": [{"id": "d1", "text": "...", "title": "..."?, "metadata": {...}?}, ...]
        the retrieved documents, in order: each becomes one cached unit of KV
    "ignore_eos", "return_token_ids": as in vLLM

RAGCache's own `/v1/rag/query` (`RagQueryRequest`) and `/v1/cache/invalidate`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document

NonEmpty = Annotated[StrictStr, Field(min_length=1)]


class DocumentIn(BaseModel):
    """One retrieved document: `id` (what the cache keys on, with the text's hash) and `text`;
    `title` (or `metadata["title"]`) appears in the prompt."""

    model_config = ConfigDict(extra="forbid")

    id: NonEmpty
    text: StrictStr
    title: StrictStr | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    prompt_text: StrictStr | None = None
    """Exactly how the prompt shows the document (None: the server's document template)."""

    def to_document(self) -> Document:
        metadata = dict(self.metadata)
        if self.title is not None:
            metadata["title"] = self.title
        return Document(self.id, self.text, metadata, prompt_text=self.prompt_text)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    """Fields shared by both OpenAI routes."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    logprobs: bool | int | None = None
    documents: list[DocumentIn] | None = None
    cache_salt: NonEmpty | None = None
    """vLLM's field: a salted request hits only KV stored under the same salt."""

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | int | None) -> bool | int | None:
        if value:
            raise ValueError("logprobs are not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def doc_list(self) -> tuple[Document, ...] | None:
        """The documents, or None when the request has none (served uncached)."""
        if not self.documents:
            return None
        return tuple(d.to_document() for d in self.documents)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None


class ChatRequest(_OpenAIRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("tools are not supported")
        return value

    @property
    def answer_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_OpenAIRequest):
    prompt: StrictStr | list[Annotated[int, Field(ge=0)]] | list[StrictStr]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], str) and len(value) != 1:
            raise ValueError("one prompt per request")
        return value

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one string counts as that string)."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            return str(prompt[0])
        if isinstance(prompt, list):
            return [int(i) for i in prompt]
        return prompt


class SamplingIn(BaseModel):
    """`SamplingConfig`'s fields; those left out take the server's `CacheConfig.sampling`."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: list[StrictStr] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None

    def over(self, default: SamplingConfig) -> SamplingConfig:
        given = self.model_dump(exclude_none=True)
        if "stop" in given:
            given["stop"] = tuple(given["stop"])
        return SamplingConfig(**{**_fields(default), **given})


class RagQueryRequest(BaseModel):
    """`/v1/rag/query`: with `documents` no search runs (`agenerate`), without them the
    server searches its `--index` (`aquery`)."""

    model_config = ConfigDict(extra="forbid")

    question: StrictStr
    documents: list[DocumentIn] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    sampling: SamplingIn | None = None
    stream: bool = False
    prompt: dict[str, Any] | None = None
    """The app's own prompt (`AppPrompt.to_json`); None: the server's layout."""
    cache_salt: NonEmpty | None = None


class InvalidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    doc_id: NonEmpty


def _fields(sampling: SamplingConfig) -> dict[str, Any]:
    return {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stop": sampling.stop,
        "seed": sampling.seed,
        "ignore_eos": sampling.ignore_eos,
    }
