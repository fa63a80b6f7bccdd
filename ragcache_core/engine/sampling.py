"""Sampling settings -> vLLM `SamplingParams`, and generated tokens' logprobs back: the one
place every engine (sync `Engine`, `CachedEngine`, `AsyncEngine`) builds and reads them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ragcache_core.config import SamplingConfig


@dataclass(frozen=True)
class GreedySampling:
    """Sampling settings for tests and benchmarks (greedy by default; never stops at EOS, so
    every run generates exactly `max_tokens`)."""

    max_tokens: int = 16
    temperature: float = 0.0
    logprobs: bool = False


def sampling_params(
    sampling: SamplingConfig | GreedySampling,
    *,
    kv_transfer_params: Mapping[str, Any] | None = None,
    skip_reading_prefix_cache: bool = False,
) -> Any:
    """vLLM `SamplingParams` for one request. `kv_transfer_params` (a plan, a fault hook) go to
    the connector through `extra_args`; `skip_reading_prefix_cache` keeps vLLM's prefix cache
    (and with it every connector load) out of the request."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
    if isinstance(sampling, SamplingConfig):
        knobs: dict[str, Any] = {
            "top_p": sampling.top_p,
            "stop": list(sampling.stop) or None,
            "seed": sampling.seed,
            "ignore_eos": sampling.ignore_eos,
        }
    else:
        knobs = {"ignore_eos": True, "logprobs": 0 if sampling.logprobs else None}
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        skip_reading_prefix_cache=skip_reading_prefix_cache,
        extra_args=extra,
        **knobs,
    )


def token_logprobs(completion: Any) -> tuple[float, ...]:
    """The log-probability of each generated token of a vLLM `CompletionOutput` (empty when
    the request asked for none)."""
    if not completion.logprobs:
        return ()
    return tuple(
        float(step[token].logprob)
        for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
    )
