"""Sampling settings -> vLLM `SamplingParams`, and generated tokens' logprobs back: the one
place every engine (sync `Engine`, `CachedEngine`, `AsyncEngine`) builds and reads them.

    sampling_params(SamplingConfig)  every field, one to one, derived from `SamplingConfig`'s
                                     fields (`extra_args` carries RAGCache's plan only:
                                     nothing a caller sets can reach it)
    SamplingChecker                  vLLM's checks that need the model (token ids in the
                                     vocabulary, the logprobs limit, grammars, bad words), run
                                     before a request is admitted: an `InputError` naming the
                                     field instead of a failure inside the engine
    step_logprobs                    the engine's per-token logprobs as `TokenLogprobs`
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ragcache_core.config import RepetitionDetection, SamplingConfig, StructuredOutputs
from ragcache_core.errors import InputError
from ragcache_core.query_result import Candidate, TokenLogprobs


def sampling_params(
    sampling: SamplingConfig,
    *,
    kv_transfer_params: Mapping[str, Any] | None = None,
    skip_reading_prefix_cache: bool = False,
) -> Any:
    """vLLM `SamplingParams` for one request. `kv_transfer_params` (a plan, a fault hook) go to
    the connector through `extra_args`; `skip_reading_prefix_cache` keeps vLLM's prefix cache
    (and with it every connector load) out of the request. Raises vLLM's own
    `VLLMValidationError` for values it refuses (`SamplingChecker` turns it into an
    `InputError` first)."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    return SamplingParams(
        skip_reading_prefix_cache=skip_reading_prefix_cache, extra_args=extra, **_knobs(sampling)
    )


def _knobs(s: SamplingConfig) -> dict[str, Any]:
    """`SamplingConfig`'s fields as `SamplingParams` keyword arguments, derived from its
    fields (the same names): tuples as lists (an empty one whose default is empty as None),
    mappings as dicts, `StructuredOutputs` and `RepetitionDetection` as vLLM's classes."""
    knobs = {}
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        knobs[f.name] = None if value == () and f.default == () else _vllm_value(value)
    return knobs


def _vllm_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, StructuredOutputs | RepetitionDetection):
        from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

        vllm_class = (
            StructuredOutputsParams
            if isinstance(value, StructuredOutputs)
            else RepetitionDetectionParams
        )
        fields = dataclasses.fields(value)
        return vllm_class(**{f.name: _vllm_value(getattr(value, f.name)) for f in fields})
    return value


class SamplingChecker:
    """vLLM's own request checks for one engine's model (`SamplingParams.verify`, as vLLM's
    input processor runs them, and the bad-words tokenization), on a dry-run copy of the
    params, with a tokenizer of its own. Safe from any thread (a lock around the tokenizer).

    Raises `InputError` with vLLM's message and `param` the field (vLLM leaves some unnamed:
    they are named here from the message's first word when it is a field)."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.tokenizers import get_tokenizer

        self._model = vllm_config.model_config
        self._speculative = vllm_config.speculative_config
        self._structured = vllm_config.structured_outputs_config
        model = self._model
        self._tokenizer = get_tokenizer(
            model.tokenizer,
            tokenizer_mode=model.tokenizer_mode,
            revision=model.tokenizer_revision,
            trust_remote_code=model.trust_remote_code,
        )
        self._lock = threading.Lock()
        self.max_model_len = int(model.max_model_len)
        self.vocab_size = int(model.get_vocab_size())

    def check(self, sampling: SamplingConfig) -> None:
        """`InputError` (naming the field) if vLLM's engine would refuse `sampling`."""
        from vllm.exceptions import VLLMClientError

        with self._lock:
            try:
                params = sampling_params(sampling)
                params.verify(self._model, self._speculative, self._structured, self._tokenizer)
                params.update_from_tokenizer(self._tokenizer)
            except InputError:
                raise
            except (VLLMClientError, ValueError, TypeError, OverflowError) as exc:
                raise as_input_error(exc) from exc


_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingConfig) if f.type != "bool")
"""The fields vLLM's messages may start with (it checks none of the flags)."""


_GRAMMAR_WORDS = ("structured output", "grammar", "schema", "regex", "choice", "json")


def as_input_error(exc: BaseException) -> InputError:
    """A vLLM validation error as an `InputError`: vLLM's message, `param` its parameter, else
    the field its message starts with, else `structured_outputs` for a constraint's error."""
    message = str(exc.args[0]) if exc.args else str(exc)
    param = getattr(exc, "parameter", None)
    if param is None:
        first = message.split(" ", 1)[0].strip("`.:,")
        if first in _FIELDS:
            param = first
        elif first.startswith("structured_outputs") or any(
            word in message.lower() for word in _GRAMMAR_WORDS
        ):
            param = "structured_outputs"
    return InputError(message, param=param)


def step_logprobs(
    steps: Sequence[Any] | None, token_ids: Sequence[int], start: int = 0
) -> tuple[TokenLogprobs, ...]:
    """The generated tokens' logprobs from `start` on (a vLLM `CompletionOutput.logprobs`: one
    {token id: Logprob} per token, the sampled token first, then by rank). Empty when the
    request asked for none."""
    if not steps:
        return ()
    out = []
    for index in range(start, min(len(steps), len(token_ids))):
        step: Mapping[int, Any] = steps[index] or {}
        token = int(token_ids[index])
        candidates = tuple(
            Candidate(int(t), float(lp.logprob), _rank(lp), lp.decoded_token)
            for t, lp in step.items()
        )
        chosen = step.get(token)
        out.append(
            TokenLogprobs(
                token_id=token,
                logprob=None if chosen is None else float(chosen.logprob),
                text=None if chosen is None else chosen.decoded_token,
                candidates=candidates,
            )
        )
    return tuple(out)


def _rank(logprob: Any) -> int | None:
    rank = getattr(logprob, "rank", None)
    return None if rank is None else int(rank)


def token_logprobs(completion: Any) -> tuple[float, ...]:
    """The log-probability of each generated token of a vLLM `CompletionOutput` (empty when
    the request asked for none)."""
    if not completion.logprobs:
        return ()
    return tuple(
        float(step[token].logprob)
        for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
    )
