"""`CachedEngine`: a vLLM engine started with the RAGCache connector and its host pool.

App side of the data plane. It creates the host pool (shared memory that outlives the engine),
checks that it fits before anything starts, starts vLLM with the connector and its prefix caching on
(vLLM's cached blocks are the GPU tier), and runs requests with a given `Plan`, returning the
connector's report. It decides no plan: its callers bring one (`bench prefill` and `profile`
build theirs; the exactness tests' `run_request`, tests/_sync_run.py, asks the `KnowledgeTree`
through the request lifecycle of `ragcache_core.runtime.lifecycle`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ragcache_core.config import SamplingConfig
from ragcache_core.engine.connector.config import ConnectorConfig
from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.engine.llm import Engine
from ragcache_core.engine.sampling import sampling_params, token_logprobs
from ragcache_core.engine.settings import (
    DeviceInfo,
    EngineSettings,
    EngineSpec,
    build_settings,
    default_dtype,
    detect_device,
)
from ragcache_core.errors import ConfigError, RAGCacheError, check_fits_context
from ragcache_core.plan import PLAN_KEY, Plan
from ragcache_core.storage.host_pool import HostPool
from ragcache_core.storage.memory import GIB, available_host_bytes, check_fits
from ragcache_core.storage.pool_layout import PoolLayout, layout_for_model

DEFAULT_PAGE_SIZE = 16
"""Tokens per pool slot; see docs/data-plane.md ("Page size") for the measurement."""


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The host pool's size. `host_pool_name` names the shared-memory file, so a restarted
    engine with the same name finds the same host pool (and its contents). The GPU tier is
    vLLM's own KV cache (`EngineSpec.kv_cache_bytes`). `host_write`, `window_blocks`,
    `back_to_head` and `handout` are the connector's (`ConnectorConfig`)."""

    host_pool_gib: float = 0.5
    page_size: int = DEFAULT_PAGE_SIZE
    host_pool_name: str = "default"
    host_write: str = "compute"
    window_blocks: int = 0
    back_to_head: bool = False
    handout: bool = True

    def __post_init__(self) -> None:
        if self.host_pool_gib < 0:
            raise ConfigError(f"host_pool_gib cannot be negative, got {self.host_pool_gib}")
        if self.page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")

    def slots(self, layout: PoolLayout) -> int:
        """Host slots for a layout."""
        return int(self.host_pool_gib * GIB) // layout.slot_bytes


@dataclass(frozen=True, slots=True)
class PlannedRun:
    """One finished request run with a plan."""

    prompt_len: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ttft_s: float
    connector: ConnectorResult
    num_cached_tokens: int = 0
    """vLLM's count: its prefix-cache hit plus the tokens the connector loaded."""

    @property
    def gpu_hit_tokens(self) -> int:
        """Prompt tokens vLLM's own prefix cache (the GPU tier) served: no byte moved."""
        return max(0, self.num_cached_tokens - self.connector.external_tokens)


class CachedEngine:
    """vLLM (prefix caching on) + the RAGCache connector + the host pool. Not thread-safe;
    `close()` when done.

    Raises `ConfigError` before starting vLLM when the pool does not fit in memory (with the
    numbers). The host pool file is kept on `close()` unless `unlink_host_pool=True`.
    """

    def __init__(
        self,
        spec: EngineSpec,
        pools: PoolSettings | None = None,
        device: DeviceInfo | None = None,
    ) -> None:
        pools = pools or PoolSettings()
        device = device or detect_device()
        self.pools = pools
        self.layout = layout_for_model(
            spec.model, dtype=spec.dtype or default_dtype(device), page_size=pools.page_size
        )
        host_slots = pools.slots(self.layout)
        self.config = ConnectorConfig(
            layout=self.layout,
            host_slots=host_slots,
            host_pool_name=pools.host_pool_name if host_slots else "",
            host_write=pools.host_write,
            window_blocks=pools.window_blocks,
            back_to_head=pools.back_to_head,
            handout=pools.handout,
        )
        self.settings = build_settings(
            replace(spec, connector=self.config.kv_transfer_config(), prefix_caching=True),
            device,
        )
        self._check_device_pool(self.settings)
        self.host_pool: HostPool | None = None
        if host_slots:
            self.host_pool = HostPool.create(pools.host_pool_name, self.layout, host_slots)
        try:
            self.engine = Engine(self.settings)
        except BaseException:
            if self.host_pool is not None:
                self.host_pool.close()
            raise

    @property
    def host_slots(self) -> int:
        return self.config.host_slots

    @property
    def max_model_len(self) -> int:
        return self.settings.max_model_len

    def run(
        self,
        prompt: Sequence[int],
        plan: Plan | None,
        sampling: SamplingConfig,
        *,
        read_prefix_cache: bool = False,
        extra_transfer_params: Mapping[str, Any] | None = None,
    ) -> PlannedRun:
        """Run one request (token ids) with `plan` (None: uncached). Blocks until it finishes.

        `read_prefix_cache=True` lets vLLM's own prefix cache serve a request without a plan
        (benchmarks use that for the floor). A request with a plan always reads it: vLLM's prefix
        cache is the GPU tier, and vLLM would skip the connector's loads otherwise;
        `reset_prefix_cache()` first to have it served by the host pool alone. Raises `InputError`
        when the prompt does not fit in the context.
        """
        return self.run_batch(
            [prompt],
            [plan],
            sampling,
            read_prefix_cache=read_prefix_cache,
            extra_transfer_params=extra_transfer_params,
        )[0]

    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        plans: Sequence[Plan | None],
        sampling: SamplingConfig,
        *,
        read_prefix_cache: bool = False,
        extra_transfer_params: Mapping[str, Any] | None = None,
    ) -> list[PlannedRun]:
        """Run requests in one vLLM batch (scheduled in order). See `run`.
        `extra_transfer_params` are merged into every planned request's `kv_transfer_params`
        (tests use it for the connector's fault hook, `FAULT_KEY`)."""
        from ragcache_core.engine.compat import first_token_latency, token_prompt

        for prompt in prompts:
            check_fits_context(len(prompt), sampling.max_tokens, self.max_model_len)
        params = [
            sampling_params(
                sampling,
                kv_transfer_params=(
                    None
                    if plan is None
                    else {PLAN_KEY: plan.to_json(), **(extra_transfer_params or {})}
                ),
                # vLLM skips connector loads too when a request skips its prefix cache.
                skip_reading_prefix_cache=not read_prefix_cache and plan is None,
            )
            for plan in plans
        ]
        started = time.perf_counter()
        outputs = self.engine.llm.generate(
            [token_prompt(list(p)) for p in prompts], params, use_tqdm=False
        )
        wall = time.perf_counter() - started
        return [
            _planned_run(p, out, first_token_latency(out), wall)
            for p, out in zip(prompts, outputs, strict=True)
        ]

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (when on), so the next run cannot hit it; the
        connector's eviction window lets go of its blocks first
        (`AsyncEngine.reset_prefix_cache` says why twice)."""
        llm = self.engine.llm
        if not llm.reset_prefix_cache(reset_connector=True):
            llm.reset_prefix_cache()

    def close(self, *, unlink_host_pool: bool = False) -> None:
        """Stop vLLM. The host pool file stays (for a restart) unless `unlink_host_pool`."""
        self.engine.close()
        if self.host_pool is not None:
            if unlink_host_pool:
                self.host_pool.unlink()
            else:
                self.host_pool.close()

    def __enter__(self) -> CachedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_device_pool(self, settings: EngineSettings) -> None:
        """Refuse a host pool that cannot fit (on CPU: beside vLLM's own KV cache)."""
        host = self.layout.pool_bytes(self.config.host_slots)
        if host and HostPool.exists(self.pools.host_pool_name, self.layout, self.config.host_slots):
            host = 0  # reused: its memory is taken already
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:  # pragma: no cover
            cuda = False
        if cuda:
            check_fits("the host KV pool", host, available_host_bytes(), "lower host_pool_gib")
        else:
            # On CPU the host pool and vLLM's own KV cache share the RAM.
            vllm_kv = int((settings.kv_cache_space_gib or 0) * GIB)
            check_fits(
                f"the KV memory ({host} bytes host pool + {vllm_kv} bytes of vLLM's own KV cache)",
                host + vllm_kv,
                available_host_bytes(),
                "lower host_pool_gib / kv_cache_space_gib",
            )


def require_plan_ran(run: PlannedRun, plan: Plan) -> int:
    """Check from the connector's report that `plan` ran; returns how many of the tokens it
    asked to load vLLM computed instead (0 when every one was served: loaded from the host
    pool, or already in vLLM's prefix cache, the GPU tier).

    Raises `RAGCacheError` when the connector rejected the plan, a store did not run, a load
    failed or nothing was served: a measurement would otherwise record an uncached run (or one
    reading KV that was never written) as a hit."""
    result = run.connector
    problems = []
    if result.rejected:
        problems.append(f"the connector rejected it ({'; '.join(result.rejected)})")
    if plan.store and not result.stored:
        problems.append("its stores did not run")
    if plan.load:
        if result.load_failed:
            problems.append(f"load spans {list(result.failed_load_spans)} failed")
        elif not (result.loaded_tokens or run.gpu_hit_tokens or result.overwritten_tokens):
            problems.append(f"none of its {plan.num_loaded_tokens} tokens to load were served")
    if problems:
        raise RAGCacheError(f"a planned run did not run as planned: {', '.join(problems)}")
    served = max(result.loaded_tokens + run.gpu_hit_tokens, 0)
    return max(0, plan.num_loaded_tokens - served)


def _planned_run(prompt: Sequence[int], output: Any, ttft: float | None, wall: float) -> PlannedRun:
    completion = output.outputs[0]
    return PlannedRun(
        prompt_len=len(prompt),
        token_ids=tuple(completion.token_ids),
        logprobs=token_logprobs(completion),
        ttft_s=ttft if ttft is not None else wall,
        connector=ConnectorResult.from_transfer_params(output.kv_transfer_params),
        num_cached_tokens=int(getattr(output, "num_cached_tokens", 0) or 0),
    )
