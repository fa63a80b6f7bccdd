"""The request fields of `/v1/chat/completions` and `/v1/completions`: what the server does
with each, and the checks the bodies share.

`CHAT_FIELDS` and `COMPLETION_FIELDS` cover every field of vLLM 0.32's `ChatCompletionRequest`
/ `CompletionRequest` (docs/deploy.md has them as a table; a test keeps both equal to vLLM's
models). The sampling rows are `SamplingConfig`'s fields (`_sampling_rows`), the routes' own
(`logprobs`, `top_logprobs`, `response_format`) besides:

    sampling  passed to vLLM's `SamplingParams` (through `SamplingConfig`), as vLLM passes it
    server    handled by the server itself (streaming, ids, the model name, the prompt, ...)
    ignored   accepted with no effect, because vLLM has none in this configuration either
    refused   400 naming the field when its value is not vLLM's default; the default (and
              null, where it means the default) passes, so routers that send every field pass

`refusal_message` words a refused value's 400, `FieldError` names the field of a check across
fields, and `lone_surrogate` finds text that is not valid Unicode (the tokenizer cannot take
it) anywhere in a parsed body.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from ragcache_core.config import SamplingConfig
from ragcache_core.serve.sampling_in import MAX_STOP_STRINGS, ROUTE_FIELDS

Kind = Literal["sampling", "server", "ignored", "refused"]


@dataclass(frozen=True)
class Treatment:
    """What the server does with one request field (`note` says how, or why not)."""

    kind: Kind
    note: str
    allowed: tuple[Any, ...] = ()
    """For a refused field: the values that pass (vLLM's default, null)."""


def _s(note: str) -> Treatment:
    return Treatment("sampling", note)


def _h(note: str) -> Treatment:
    return Treatment("server", note)


def _i(note: str) -> Treatment:
    return Treatment("ignored", note)


def _r(note: str, *allowed: Any) -> Treatment:
    return Treatment("refused", note, allowed)


_SAMPLING_NOTES = {
    "top_k": "0 = off",
    "min_p": "0 = off",
    "seed": "in [-2^63, 2^63 - 1]",
    "logit_bias": "token id -> bias, clamped to [-100, 100]",
    "stop": f"at most {MAX_STOP_STRINGS}; no empty string",
    "logprob_token_ids": "needs logprobs",
    "spaces_between_special_tokens": (
        "visible only with a tokenizer whose decoder spaces special tokens, in vLLM too"
    ),
    "structured_outputs": "one constraint",
    "stream_interval": "a streamed chunk per N tokens, the first at once",
}
"""What the table says of a sampling field besides its `SamplingParams` name."""


def _sampling_rows() -> dict[str, Treatment]:
    """A row per `SamplingConfig` field the routes take as is (all but `ROUTE_FIELDS`)."""
    rows = {}
    for f in dataclasses.fields(SamplingConfig):
        if f.name in ROUTE_FIELDS:
            continue
        notes = []
        if f.metadata.get("generation_config"):
            notes.append(
                f"null: generation config, else {f.metadata.get('vllm_default', f.default):g}"
            )
        if f.name in _SAMPLING_NOTES:
            notes.append(_SAMPLING_NOTES[f.name])
        said = f" ({'; '.join(notes)})" if notes else ""
        rows[f.name] = _s(f"SamplingParams.{f.name}{said}")
    return rows


_NO_TRUNCATION = "the prompt is never truncated (a cut prompt would not be the one cached)"
_COMMON: dict[str, Treatment] = {
    "model": _h("the served name or the model path (null or '' = the served model); else 404"),
    **_sampling_rows(),
    "response_format": _s(
        "SamplingParams.structured_outputs: json_object, json_schema, structural_tag "
        "(text: none), overriding structured_outputs' constraint as vLLM does"
    ),
    "max_tokens": _h(
        "clamped to the context left after the prompt, as vLLM does; over max_model_len: 400"
    ),
    "n": _h("1 (or null); more choices: 400"),
    "stream": _h("server-sent events, as vLLM's"),
    "stream_options": _h("include_usage, continuous_usage_stats; only with stream (else 400)"),
    "return_token_ids": _h("token_ids per choice (per chunk when streamed), prompt_token_ids"),
    "return_tokens_as_token_ids": _h("logprob tokens written as 'token_id:N'"),
    "request_id": _h("the response id (the X-Request-Id header wins, as in vLLM)"),
    "cache_salt": _h(
        "salts the cached prompt's root: a salted request hits only KV stored under the same "
        "salt (with --salt-per-key, within its key's tenant)"
    ),
    "user": _i("accepted and ignored, as vLLM does"),
    "watermarking": _i("no watermark config: vLLM runs such a request unwatermarked too"),
    "length_penalty": _i("beam search only (refused)"),
    "session_id": _i("scheduler affinity hint; vLLM's sampling ignores it"),
    "return_token_offsets": _i("vLLM ignores it on generation routes"),
    "mm_payload": _i("render routes only"),
    "return_mm_kwargs": _i("render routes only"),
    "truncation_side": _i("used only with truncate_prompt_tokens (refused)"),
    "use_beam_search": _r("beam search is not served", False, None),
    "truncate_prompt_tokens": _r(_NO_TRUNCATION, None),
    "prompt_logprobs": _r("a cached prompt is loaded, not computed: no prompt logprobs", None),
    "priority": _r("no priority scheduling (vllm serve also needs --scheduling-policy)", 0, None),
    "routed_experts_prompt_start": _r("no routed-experts data", 0, None),
    "kv_transfer_params": _r("it would write RAGCache's plan channel (extra_args)", None),
    "ec_transfer_params": _r("it would write RAGCache's plan channel (extra_args)", None),
    "vllm_xargs": _r("it would write RAGCache's plan channel (extra_args)", None),
    "thinking_token_budget": _r("no reasoning config (vLLM refuses it too)", None, -1),
}
CHAT_FIELDS: dict[str, Treatment] = {
    "messages": _h(
        "no documents: the model's chat template over every message (text parts joined by "
        "newlines, name/tool_calls/tool_call_id/reasoning passed), as vLLM; with documents: "
        "an optional system message and one user message, the question"
    ),
    **_COMMON,
    "logprobs": _s("with top_logprobs: SamplingParams.logprobs; choice.logprobs.content"),
    "top_logprobs": _s("SamplingParams.logprobs when logprobs is true (0-20, -1 = all)"),
    "max_completion_tokens": _h("as max_tokens, and preferred to it"),
    "documents": _h(
        "with ids: RAGCache's documents (cached); without: the chat template's documents "
        "(uncached, as vLLM)"
    ),
    "document_order": _h(
        "RAGCache's: retrieval (the documents as sent) or cache (the order that follows the "
        "cached path; null: the server's --document-order); documents found in the text: never"
    ),
    "include_reasoning": _i("no reasoning parser"),
    "parallel_tool_calls": _i("no tool parser (tools are refused)"),
    "tools": _r("no tool parser (vllm serve needs --enable-auto-tool-choice)", None),
    "tool_choice": _r("no tool parser", "none", None),
    "reasoning_effort": _r("no reasoning parser or template switch", None),
    "echo": _r("the last message is not echoed", False, None),
    "add_generation_prompt": _r("always true (the template's generation prompt)", True, None),
    "continue_final_message": _r("the final message is not continued", False, None),
    "add_special_tokens": _r("the chat template adds special tokens", False, None),
    "chat_template": _r("the model's own template only", None),
    "chat_template_kwargs": _r("the model's own template, as is", None, {}),
    "media_io_kwargs": _r("text only", None, {}),
    "mm_processor_kwargs": _r("text only", None, {}),
    "return_prompt_text": _r("not returned", None, False),
}
COMPLETION_FIELDS: dict[str, Treatment] = {
    "prompt": _h(
        "one prompt: a string (tokenized with special tokens, as vLLM), token ids, or a "
        "list of one of those; with documents, the question (a string)"
    ),
    **_COMMON,
    "logprobs": _s("SamplingParams.logprobs (0-20, -1 = all); choice.logprobs"),
    "documents": _h("RAGCache's documents (each needs an id; vLLM has no such field here)"),
    "echo": _r("the prompt is not echoed", False, None),
    "suffix": _r("suffix is only supported for models with FIM completion rendering", None),
    "prompt_embeds": _r("token ids or text only", None),
    "add_special_tokens": _r("a string prompt is tokenized with special tokens", True, None),
}
EXTENSIONS = {"completion": ("documents",), "chat": ("document_order",)}
"""RAGCache's fields that vLLM's models lack (chat's `documents` is vLLM's field too)."""
GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
)
"""vLLM's removed fields (it ignores them with a warning): refused, pointing to the new one."""


class FieldError(ValueError):
    """A check across fields, or of a refused field, that names its `field` (the 400's
    `param`; pydantic alone would name the whole body)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def is_allowed(value: Any, allowed: tuple[Any, ...]) -> bool:
    """`value` is one of `allowed` (typed: `0` is not `False`)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def refusal_message(name: str, value: Any, treatment: Treatment) -> str:
    if name == "tools" and value == []:
        return (
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely."
        )
    if name == "suffix":
        return "suffix is only supported for models with FIM completion rendering"
    passing = " or ".join("null" if a is None else repr(a) for a in treatment.allowed)
    return f"{name} is not supported by ragcache serve ({treatment.note}); send {passing}"


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "") -> tuple[str, int, int] | None:
    """(field path, character index, code point) of the first lone surrogate (U+D800-U+DFFF)
    in a parsed body's strings, keys included; None when every string is valid Unicode."""
    if isinstance(value, BaseModel):
        items: dict[str, Any] = {name: getattr(value, name) for name in type(value).model_fields}
        items.update(value.model_extra or {})
        return _first_in(items.items(), path)
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        return None if match is None else (path or "body", match.start(), ord(match.group()))
    if isinstance(value, dict):
        for key in value:
            found = lone_surrogate(str(key), path)
            if found is not None:
                return found
        return _first_in(value.items(), path)
    if isinstance(value, list | tuple):
        return _first_in(enumerate(value), path)
    return None


def _first_in(items: Any, path: str) -> tuple[str, int, int] | None:
    for key, item in items:
        name = "documents" if key == "template_documents" else str(key)
        found = lone_surrogate(item, f"{path}.{name}" if path else name)
        if found is not None:
            return found
    return None
