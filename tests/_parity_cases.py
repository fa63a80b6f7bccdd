"""The sampling fields of issue 20's parity tests: each field passed to SamplingParams, the
request without it, and how its value is picked from the answer without it
(tests/test_serve_parity.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ragcache_core.config import RepetitionDetection, StructuredOutputs

EOS = 1  # the tiny model's </s>

GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
SAMPLED = {"temperature": 2.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}
ONLY_EOS = {"temperature": 0, "max_tokens": 6, "logit_bias": {str(EOS): 100}}
GREEDY_C = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
LONG = {**GREEDY, "max_tokens": 48}
"""The penalties' base: a greedy answer long enough to repeat a token (12 tokens of the tiny
model's answer on this prompt repeat none, so no penalty can change them)."""
LONG_C = {**GREEDY_C, "max_tokens": 48}
SAMPLED_C = {"temperature": 2.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}
ONLY_EOS_C = {"temperature": 0.0, "max_tokens": 6, "logit_bias": {EOS: 100}}


@dataclass(frozen=True)
class Answer:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] = ()


Pick = Callable[[Answer, Any], Any]
"""(the answer without the field, the tokenizer) -> the field's value."""


@dataclass(frozen=True)
class Case:
    """One field passed to SamplingParams: the request without it (`base`, and as
    SamplingConfig kwargs `base_config`), its value (chosen from the answer without it), the
    same as SamplingConfig kwargs, and what it changes."""

    name: str
    base: dict[str, Any]
    base_config: dict[str, Any]
    field: Pick
    config: Pick
    changes: str = "tokens"


def _const(value: Any) -> Pick:
    return lambda answer, tokenizer: value


def _plain_token(answer: Answer, tokenizer: Any, start: int = 0) -> tuple[int, str]:
    """A generated token whose text tokenizes back to it alone (a word bad_words can ban)."""
    for token in answer.token_ids[start:]:
        text = tokenizer.decode([token])
        if text.strip() and tokenizer.encode(text, add_special_tokens=False) == [token]:
            return token, text
    raise AssertionError(f"no plain token in {answer.token_ids}")


def _stop_text(answer: Answer, tokenizer: Any) -> str:
    return _plain_token(answer, tokenizer, start=3)[1]


CASES = [
    Case(
        "logit_bias",
        GREEDY,
        GREEDY_C,
        _const({"logit_bias": {"5": 100}}),
        _const({"logit_bias": {5: 100}}),
    ),
    Case(
        "temperature",
        GREEDY,
        GREEDY_C,
        _const({"temperature": 1.5, "seed": 3}),
        _const({"temperature": 1.5, "seed": 3}),
    ),
    Case("seed", SAMPLED, SAMPLED_C, _const({"seed": 8}), _const({"seed": 8})),
    Case("top_p", SAMPLED, SAMPLED_C, _const({"top_p": 0.05}), _const({"top_p": 0.05})),
    Case("top_k", SAMPLED, SAMPLED_C, _const({"top_k": 1}), _const({"top_k": 1})),
    Case("min_p", SAMPLED, SAMPLED_C, _const({"min_p": 0.9}), _const({"min_p": 0.9})),
    Case(
        "presence_penalty",
        LONG,
        LONG_C,
        _const({"presence_penalty": 2.0}),
        _const({"presence_penalty": 2.0}),
    ),
    Case(
        "frequency_penalty",
        LONG,
        LONG_C,
        _const({"frequency_penalty": 2.0}),
        _const({"frequency_penalty": 2.0}),
    ),
    Case(
        "repetition_penalty",
        LONG,
        LONG_C,
        _const({"repetition_penalty": 2.0}),
        _const({"repetition_penalty": 2.0}),
    ),
    Case(
        "allowed_token_ids",
        GREEDY,
        GREEDY_C,
        _const({"allowed_token_ids": [5, 6, 7]}),
        _const({"allowed_token_ids": (5, 6, 7)}),
    ),
    Case(
        "bad_words",
        GREEDY,
        GREEDY_C,
        lambda a, t: {"bad_words": [_plain_token(a, t)[1].strip()]},
        lambda a, t: {"bad_words": (_plain_token(a, t)[1].strip(),)},
    ),
    Case(
        "stop",
        GREEDY,
        GREEDY_C,
        lambda a, t: {"stop": [_stop_text(a, t)]},
        lambda a, t: {"stop": (_stop_text(a, t),)},
    ),
    Case(
        "include_stop_str_in_output",
        GREEDY,
        GREEDY_C,
        lambda a, t: {"stop": [_stop_text(a, t)], "include_stop_str_in_output": True},
        lambda a, t: {"stop": (_stop_text(a, t),), "include_stop_str_in_output": True},
        changes="text",
    ),
    Case(
        "stop_token_ids",
        GREEDY,
        GREEDY_C,
        lambda a, t: {"stop_token_ids": [a.token_ids[3]]},
        lambda a, t: {"stop_token_ids": (a.token_ids[3],)},
    ),
    Case(
        "min_tokens",  # token 9 is pushed first and stops the answer, unless min_tokens
        {**GREEDY, "max_tokens": 8, "logit_bias": {"9": 60}, "stop_token_ids": [9]},
        {**GREEDY_C, "max_tokens": 8, "logit_bias": {9: 60}, "stop_token_ids": (9,)},
        _const({"min_tokens": 6}),
        _const({"min_tokens": 6}),
    ),
    Case(
        "ignore_eos",
        ONLY_EOS,
        ONLY_EOS_C,
        _const({"ignore_eos": True}),
        _const({"ignore_eos": True}),
    ),
    Case(
        "spaces_between_special_tokens",
        {**ONLY_EOS, "ignore_eos": True, "skip_special_tokens": False},
        {**ONLY_EOS_C, "ignore_eos": True, "skip_special_tokens": False},
        _const({"spaces_between_special_tokens": False}),
        _const({"spaces_between_special_tokens": False}),
        changes="nothing here",  # the tiny model's byte-level decoder never spaces them
    ),
    Case(
        "logprob_token_ids",
        GREEDY,
        GREEDY_C,
        _const({"logprobs": True, "logprob_token_ids": [5, 6]}),
        _const({"logprob_token_ids": (5, 6)}),
        changes="logprobs",
    ),
    Case(
        "skip_special_tokens",
        {**ONLY_EOS, "ignore_eos": True},
        {**ONLY_EOS_C, "ignore_eos": True},
        _const({"skip_special_tokens": False}),
        _const({"skip_special_tokens": False}),
        changes="text",
    ),
    Case(
        "repetition_detection",
        {**GREEDY, "allowed_token_ids": [5]},
        {**GREEDY_C, "allowed_token_ids": (5,)},
        _const({"repetition_detection": {"max_pattern_size": 2, "min_count": 3}}),
        _const({"repetition_detection": RepetitionDetection(2, 0, 3)}),
    ),
    Case(
        "response_format",
        GREEDY,
        GREEDY_C,
        _const({"response_format": {"type": "json_object"}}),
        _const({"structured_outputs": StructuredOutputs(json_object=True)}),
    ),
    Case(
        "structured_outputs",
        GREEDY,
        GREEDY_C,
        _const({"structured_outputs": {"choice": ["Paris", "Rome"]}}),
        _const({"structured_outputs": StructuredOutputs(choice=("Paris", "Rome"))}),
    ),
    Case(
        "logprobs",
        GREEDY,
        GREEDY_C,
        _const({"logprobs": True, "top_logprobs": 3}),
        _const({"logprobs": 3}),
        changes="logprobs",
    ),
]
IDS = [c.name for c in CASES]

FAKE = Answer((5, 6, 7, 8, 9), "a b c d e")
