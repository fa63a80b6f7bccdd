"""Request bodies the server accepts, validated by pydantic (a bad one is a 400 naming the field).

`/v1/chat/completions` and `/v1/completions` take every field of vLLM 0.32's
`ChatCompletionRequest` / `CompletionRequest`, with vLLM's types and defaults (null wherever
vLLM takes null); `serve/fields.py` says what the server does with each (`CHAT_FIELDS`,
`COMPLETION_FIELDS`: sampling, server, ignored or refused). Their sampling fields are
`SamplingConfig`'s, derived from it (`sampling_in.OpenAISamplingIn`, the base of both bodies).

Unknown fields are ignored, as vLLM ignores them, except vLLM's removed `guided_*` fields
(refused, pointing to `structured_outputs`: vLLM would silently ignore the constraint).

`documents` (the extension) comes in two shapes, told apart by `id`: every entry has an `id`:
RAGCache's documents, each one cached unit of KV (`DocumentIn`); no entry has one: vLLM's
own `documents` (string values, e.g. title/text), passed to the model's chat template as
`vllm serve` does and served uncached (`template_documents`). A mix is a 400.

RAGCache's own `/v1/rag/query` (`RagQueryRequest`, whose `sampling` is `SamplingConfig`
field for field, derived from it in `sampling_in.py`) and `/v1/cache/invalidate`.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

import ragcache_core.serve.sampling_in as sampling_in
from ragcache_core.config import StructuredOutputs
from ragcache_core.documents import Document
from ragcache_core.serve.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    GUIDED_FIELDS,
    FieldError,
    Treatment,
    is_allowed,
    refusal_message,
)
from ragcache_core.serve.sampling_in import RepetitionDetectionIn, SamplingIn, StructuredOutputsIn

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "DocumentIn",
    "InvalidateRequest",
    "JsonSchemaFormat",
    "OpenAIRequest",
    "RagQueryRequest",
    "RepetitionDetectionIn",
    "ResponseFormat",
    "SamplingIn",
    "StreamOptions",
    "StructuredOutputsIn",
]
"""The wire models: the bodies and the models inside them (tests/data/serve_schemas.json pins
their JSON schemas)."""

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
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(BaseModel):
    name: StrictStr
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (and vLLM's `structural_tag` forms)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided."
            )
        return self


class _OpenAIRequest(sampling_in.OpenAISamplingIn):
    """Fields shared by both OpenAI routes (see the module docstring and `_COMMON`)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    FIELDS: ClassVar[dict[str, Treatment]] = {}
    """The route's table (`CHAT_FIELDS`, `COMPLETION_FIELDS`)."""

    model: StrictStr | None = None
    # Passed to SamplingParams, besides `SamplingConfig`'s own (the base's).
    response_format: ResponseFormat | None = None
    # Handled by the server.
    max_tokens: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    request_id: StrictStr | None = None
    documents: list[DocumentIn] | None = None
    cache_salt: NonEmpty | None = None
    """vLLM's field: a salted request hits only KV stored under the same salt."""
    # Ignored, as vLLM ignores them here.
    user: StrictStr | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    session_id: StrictStr | None = None
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Refused unless at their default (checked in `_refused`).
    use_beam_search: Any = False
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None
    priority: Any = 0
    routed_experts_prompt_start: Any = 0
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    thinking_token_budget: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (1, None):
            raise ValueError(f"only n=1 is supported, got n={value}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise FieldError(
                "stream_options", "Stream options can only be defined when `stream=True`."
            )
        return data

    @model_validator(mode="after")
    def _refused(self) -> _OpenAIRequest:
        """Every refused field at a value that passes (vLLM's default, or null)."""
        table: dict[str, Treatment] = type(self).FIELDS
        for name, treatment in table.items():
            if treatment.kind == "refused":
                value = getattr(self, name)
                if not is_allowed(value, treatment.allowed):
                    raise FieldError(name, refusal_message(name, value, treatment))
        extra = self.model_extra or {}
        for name in GUIDED_FIELDS:
            if extra.get(name) is not None:
                raise FieldError(
                    name,
                    f"{name} was removed from vLLM (which ignores it: the output would be "
                    "unconstrained); use structured_outputs or response_format",
                )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return bool(options and options.include_usage and options.continuous_usage_stats)

    @property
    def streamed(self) -> bool:
        return bool(self.stream)

    def doc_list(self) -> tuple[Document, ...] | None:
        """RAGCache's documents, or None when the request has none (served uncached)."""
        if not self.documents:
            return None
        return tuple(d.to_document() for d in self.documents)

    def sampling_fields(self) -> dict[str, Any]:
        """The request's `SamplingConfig` fields (but `ROUTE_FIELDS`) as `SamplingConfig`
        takes them, None where null; `structured_outputs` with `response_format`'s constraint
        over it, as vLLM applies it."""
        given = self.given(skip_none=False)
        given["structured_outputs"] = _structured(given["structured_outputs"], self.response_format)
        return given


def _structured(
    base: StructuredOutputs | None, response_format: ResponseFormat | None
) -> StructuredOutputs | None:
    """`structured_outputs` with `response_format`'s constraint over it, as vLLM."""
    overrides = _response_format_constraint(response_format)
    if overrides is None:
        return base
    if base is None:
        return StructuredOutputs(**overrides)
    return dataclasses.replace(base, **overrides)


def _response_format_constraint(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """vLLM's `structured_outputs_from_response_format` overrides (None: no constraint)."""
    import json

    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type == "json_schema":
        assert response_format.json_schema is not None
        return {"json": response_format.json_schema.json_schema}
    return {"structural_tag": json.dumps(response_format.model_dump(by_alias=True))}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    """One message. Besides `role` and `content`, vLLM's template keys pass through to the
    chat template (`name`, `tool_calls`, `tool_call_id`, `reasoning`)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    TEMPLATE_KEYS: ClassVar[tuple[str, ...]] = ("name", "tool_calls", "tool_call_id", "reasoning")

    @model_validator(mode="before")
    @classmethod
    def _reasoning_alias(cls, data: Any) -> Any:
        """vLLM renames the deprecated `reasoning_content` to `reasoning`."""
        if isinstance(data, dict) and data.get("reasoning_content") is not None:
            data = {**data}
            data.setdefault("reasoning", data.pop("reasoning_content"))
        return data

    def template_extras(self) -> dict[str, Any]:
        """The keys besides role and content that vLLM gives the chat template."""
        given = {"name": self.name, **(self.model_extra or {})}
        return {k: given[k] for k in self.TEMPLATE_KEYS if given.get(k) is not None}


TemplateDocument = dict[str, StrictStr]


class ChatRequest(_OpenAIRequest):
    FIELDS: ClassVar[dict[str, Treatment]] = CHAT_FIELDS

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_completion_tokens: int | None = None
    template_documents: list[TemplateDocument] | None = None
    """vLLM-shaped `documents` (no `id`): passed to the chat template (module docstring)."""
    document_order: Literal["retrieval", "cache"] | None = None
    """RAGCache's: the order the prompt shows the sent documents in (None: the server's)."""
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    tools: Any = None
    tool_choice: Any = "none"
    reasoning_effort: Any = None
    echo: Any = False
    add_generation_prompt: Any = True
    continue_final_message: Any = False
    add_special_tokens: Any = False
    chat_template: Any = None
    chat_template_kwargs: Any = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None
    return_prompt_text: Any = None

    @model_validator(mode="before")
    @classmethod
    def _documents_by_shape(cls, data: Any) -> Any:
        """vLLM's documents (no entry has an `id`) go to `template_documents`."""
        if not isinstance(data, dict):
            return data
        docs = data.get("documents")
        if not isinstance(docs, list) or not docs:
            return data
        if all(isinstance(d, dict) and "id" not in d for d in docs):
            data = {**data, "template_documents": docs}
            data.pop("documents")
        return data

    @model_validator(mode="before")
    @classmethod
    def _logprobs_coupling(cls, data: Any) -> Any:
        """vLLM's `check_logprobs`: top_logprobs and logprob_token_ids need `logprobs`."""
        if not isinstance(data, dict):
            return data
        top = data.get("top_logprobs")
        if top is not None and not isinstance(top, bool) and isinstance(top, int | float):
            if top < 0 and top != -1:
                raise FieldError("top_logprobs", "`top_logprobs` must be a positive value or -1.")
            if (top == -1 or top > 0) and not data.get("logprobs"):
                raise FieldError(
                    "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."
                )
        if data.get("logprob_token_ids") and not data.get("logprobs"):
            raise FieldError(
                "logprob_token_ids",
                "when using `logprob_token_ids`, `logprobs` must be set to true.",
            )
        return data

    @property
    def answer_tokens(self) -> int | None:
        """The requested answer length (max_completion_tokens first, as vLLM)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def answer_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def sample_logprobs(self) -> int | None:
        """`SamplingParams.logprobs` (vLLM: top_logprobs when logprobs and no token ids)."""
        if self.logprobs and not self.value("logprob_token_ids"):
            return self.top_logprobs or 0
        return None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)


class CompletionRequest(_OpenAIRequest):
    FIELDS: ClassVar[dict[str, Treatment]] = COMPLETION_FIELDS

    prompt: (
        StrictStr
        | list[Annotated[int, Field(ge=0)]]
        | list[StrictStr]
        | list[list[Annotated[int, Field(ge=0)]]]
    )
    logprobs: int | None = None
    echo: Any = False
    suffix: Any = None
    prompt_embeds: Any = None
    add_special_tokens: Any = True

    @model_validator(mode="before")
    @classmethod
    def _logprobs_checks(cls, data: Any) -> Any:
        """vLLM's `check_logprobs` for completions: a count (or -1), needed by
        logprob_token_ids."""
        if not isinstance(data, dict):
            return data
        logprobs = data.get("logprobs")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
            raise FieldError("logprobs", "`logprobs` must be an integer.")
        if isinstance(logprobs, int) and logprobs < -1:
            raise FieldError("logprobs", "`logprobs` must be a positive value or -1.")
        if data.get("logprob_token_ids") and data.get("logprobs") is None:
            raise FieldError(
                "logprob_token_ids", "when using `logprob_token_ids`, `logprobs` must be set."
            )
        return data

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str) and not value:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        if isinstance(value, list) and not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and isinstance(value[0], str | list) and len(value) != 1:
            raise ValueError(f"one prompt per request (n=1), got {len(value)}")
        return value

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a list of one string or of one id list counts as that prompt)."""
        prompt = self.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], str):
            return str(prompt[0])
        if isinstance(prompt, list) and isinstance(prompt[0], list):
            return [int(i) for i in prompt[0]]
        if isinstance(prompt, list):
            return [int(i) for i in prompt]  # type: ignore[arg-type]
        return prompt

    @property
    def answer_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def answer_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def sample_logprobs(self) -> int | None:
        return None if self.value("logprob_token_ids") else self.logprobs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


OpenAIRequest = ChatRequest | CompletionRequest


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
    return_prompt: bool = False
    """Put the prompt as the model saw it in the result (`QueryResult.prompt_text`)."""
    document_order: Literal["retrieval", "cache"] | None = None
    """The prompt's document order (None: the server's `--document-order`)."""


class InvalidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    doc_id: NonEmpty
