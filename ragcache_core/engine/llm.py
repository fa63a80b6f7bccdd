"""A thin synchronous wrapper over `vllm.LLM`: start with safe defaults, generate from token
ids, report vLLM's own per-request TTFT.

Used by `ragcache doctor`, the tests and the benchmarks. The runtime (`RAGCache`) uses vLLM's
async engine instead (`ragcache_core.engine.async_engine`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragcache_core.config import SamplingConfig
from ragcache_core.engine.sampling import sampling_params, token_logprobs
from ragcache_core.engine.settings import EngineSettings

__all__ = ["Completion", "Engine"]


@dataclass(frozen=True)
class Completion:
    """One finished request."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    ttft_s: float
    """vLLM's first-token latency (arrival to first token); wall time when vLLM has none."""
    logprobs: tuple[float, ...] = field(default=())
    """Log-probability of each generated token (when requested)."""


class Engine:
    """A started vLLM engine. Not thread-safe; close it (or use `with`) to free its processes."""

    def __init__(self, settings: EngineSettings) -> None:
        from ragcache_core.engine.compat import check_vllm_version

        check_vllm_version()
        settings.apply_environment()
        from vllm import LLM

        from ragcache_core.engine.logs import engine_output

        self.settings = settings
        started = time.perf_counter()
        with engine_output():  # its processes write to vLLM's log file, where one is set
            self._llm: Any = LLM(**settings.to_engine_kwargs())
        self.start_s = time.perf_counter() - started

    @property
    def llm(self) -> Any:
        """The underlying `vllm.LLM` (for tests and advanced use)."""
        return self._llm

    def tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> list[Completion]:
        """Generate for each prompt (token ids) in one batch; results in prompt order."""
        from ragcache_core.engine.compat import first_token_latency, token_prompt

        transfers = kv_transfer_params or [None] * len(prompts)
        params = [sampling_params(sampling, kv_transfer_params=t) for t in transfers]
        started = time.perf_counter()
        outputs = self._llm.generate(
            [token_prompt(list(p)) for p in prompts], params, use_tqdm=False
        )
        wall = time.perf_counter() - started
        results = []
        for prompt, output in zip(prompts, outputs, strict=True):
            completion = output.outputs[0]
            ttft = first_token_latency(output)
            results.append(
                Completion(
                    prompt_token_ids=tuple(prompt),
                    token_ids=tuple(completion.token_ids),
                    text=completion.text,
                    ttft_s=ttft if ttft is not None else wall,
                    logprobs=token_logprobs(completion),
                )
            )
        return results

    def close(self) -> None:
        """Shut the engine's processes down. Safe to call twice."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None) or getattr(
            getattr(engine, "engine_core", None), "shutdown", None
        )
        if callable(shutdown):
            from ragcache_core.engine.async_engine import ENGINE_EXIT_TIMEOUT_S

            shutdown(timeout=ENGINE_EXIT_TIMEOUT_S)  # killed mid-teardown it leaks shared memory
        del llm
        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
