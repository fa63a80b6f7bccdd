"""`ragcache bench prefill`: TTFT of full prefill vs RAGCache hits vs vLLM's prefix-cache floor.

For each document length (default 512, 1,024, 2,048, 4,096 tokens) and one engine run:

    full_s      document + question, nothing cached (vLLM prefix cache not read)
    gpu_hit_s   a RAGCache request (plan: load the document from the host pool) whose document
                vLLM's prefix cache already holds: the GPU tier serves it, no byte moves
    host_hit_s  the same request after vLLM's prefix cache was emptied: the document is
                loaded from the host pool, the question computed
    floor_s     a plain vLLM request whose document is in vLLM's prefix cache (no plan)

RAGCache's GPU tier is vLLM's own prefix cache (docs/design.md 3.1), so a GPU hit and the
floor read the same blocks; their ratio is the connector's overhead on a hit. Values are TTFT
medians (vLLM's own arrival-to-first-token) over `--repeats` runs, each with a new question.
The paper saw up to 11.5x (GPU hit) and 3.9x (host hit) over full prefill; the goal here is a
GPU hit within 1.05x of the floor.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.config import SamplingConfig

if TYPE_CHECKING:
    from ragcache_core.engine.cached import CachedEngine, PoolSettings
    from ragcache_core.engine.settings import EngineSpec
    from ragcache_core.storage.pool_layout import PoolLayout

DOC_TOKENS = (512, 1024, 2048, 4096)
QUESTION_TOKENS = 32
PAGE = 16
SAMPLING = SamplingConfig(max_tokens=1, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    doc_tokens: int
    full_s: float
    gpu_hit_s: float
    host_hit_s: float
    floor_s: float
    alignment_recomputed_tokens: int
    """Document tokens a hit's plan asked for that vLLM computed instead (neither loaded nor in
    its prefix cache; the most over the hit runs), from the connector's report and vLLM's
    `num_cached_tokens`. A run whose plan was rejected or served nothing fails instead."""


def measure(
    model: str,
    doc_tokens: tuple[int, ...] = DOC_TOKENS,
    repeats: int = 5,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, Any]:
    """Run the benchmark in one engine; returns the `--json` document. Raises `RAGCacheError`
    when a RAGCache run was not served as planned (see `require_plan_ran`)."""
    from ragcache_core.engine.cached import CachedEngine

    spec, pools, layout = _engine_setup(model, max(doc_tokens))
    rng = random.Random(seed)
    results: list[PrefillResult] = []
    engine = CachedEngine(spec, pools)
    try:
        vocab = _vocab_size(model)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        engine.run(tokens(64), None, SAMPLING)  # warm-up
        for n in doc_tokens:
            result = _measure_length(engine, n, tokens, repeats)
            results.append(result)
            if progress:
                print(f"  {result_line(result)}", file=sys.stderr, flush=True)
        memory = {
            "token_kv_bytes": layout.token_bytes,
            "host_pool_bytes": layout.pool_bytes(engine.host_slots),
            "vllm_kv_cache_bytes": spec.kv_cache_bytes,
        }
    finally:
        engine.close(unlink_host_pool=True)
    return {
        "model": model,
        "page_size": PAGE,
        "question_tokens": QUESTION_TOKENS,
        "repeats": repeats,
        "memory": memory,
        "results": [asdict(r) for r in results],
    }


def _engine_setup(model: str, longest: int) -> tuple[EngineSpec, PoolSettings, PoolLayout]:
    """One engine for every length: a host pool that holds the longest document once."""
    from ragcache_core.engine.cached import PoolSettings
    from ragcache_core.engine.settings import EngineSpec
    from ragcache_core.storage.memory import GIB
    from ragcache_core.storage.pool_layout import layout_for_model

    layout = layout_for_model(model, dtype="float32", page_size=PAGE)
    pool_gib = (slots_for_tokens(longest, PAGE) + 1) * layout.slot_bytes / GIB
    spec = EngineSpec(
        model=model,
        dtype="float32",
        prefix_caching=True,  # the GPU tier (CachedEngine turns it on in any case)
        max_model_len=longest + QUESTION_TOKENS + 64,
        max_num_batched_tokens=longest + QUESTION_TOKENS + 64,
        kv_cache_bytes=int(max(1.0, 4 * (longest + 128) * layout.token_bytes / GIB) * GIB),
    )
    pools = PoolSettings(
        host_pool_gib=pool_gib,
        page_size=PAGE,
        host_pool_name="bench-prefill",
    )
    return spec, pools, layout


def _measure_length(
    engine: CachedEngine, n: int, tokens: Callable[[int], list[int]], repeats: int
) -> PrefillResult:
    """The four timings of one document length (module docstring), medians over `repeats`:
    uncached; store the document in the host pool, then run with vLLM's prefix cache holding
    it (GPU hit), alternating with vLLM's own prefix cache without a plan (floor); then the
    same plan with vLLM's prefix cache emptied first (host hit). Raises `RAGCacheError` when
    a GPU hit moved bytes or a host hit was served by vLLM's prefix cache."""
    from ragcache_core.engine.cached import require_plan_ran
    from ragcache_core.errors import RAGCacheError
    from ragcache_core.plan import LoadSpan, Plan, StoreSpan, Tier

    doc = tokens(n)
    slots = tuple(range(slots_for_tokens(n, PAGE)))
    recomputed = [0]
    load = Plan(PAGE, load=(LoadSpan(Tier.HOST, slots, 0, n),))

    def ttft(plan: Plan | None, *, gpu_tier: bool = True) -> float:
        if not gpu_tier:
            engine.reset_prefix_cache()
        run = engine.run(doc + tokens(QUESTION_TOKENS), plan, SAMPLING, read_prefix_cache=True)
        if plan is not None:
            recomputed.append(require_plan_ran(run, plan))
            moved = run.connector.loaded_tokens
            if gpu_tier and moved:
                raise RAGCacheError(f"a GPU hit of {n} tokens loaded {moved} from the host pool")
            if not gpu_tier and run.gpu_hit_tokens:
                raise RAGCacheError(f"a host hit was served {run.gpu_hit_tokens} tokens by vLLM")
        return float(run.ttft_s)

    engine.reset_prefix_cache()
    full = [
        float(engine.run(doc + tokens(QUESTION_TOKENS), None, SAMPLING).ttft_s)
        for _ in range(repeats)
    ]
    store = Plan(PAGE, store=(StoreSpan(Tier.HOST, slots, 0, n),))
    require_plan_ran(engine.run(doc + tokens(QUESTION_TOKENS), store, SAMPLING), store)
    # A GPU hit and the floor read the same cached blocks: measured in alternating pairs
    # (the order swapped every pair), so the machine's drift falls on both alike.
    gpu_hit: list[float] = []
    floor: list[float] = []
    for i in range(repeats):
        pair = [(gpu_hit, load), (floor, None)]
        for times, plan in pair if i % 2 == 0 else pair[::-1]:
            times.append(ttft(plan))
    host_hit = [ttft(load, gpu_tier=False) for _ in range(repeats)]
    return PrefillResult(
        doc_tokens=n,
        full_s=statistics.median(full),
        gpu_hit_s=statistics.median(gpu_hit),
        host_hit_s=statistics.median(host_hit),
        floor_s=statistics.median(floor),
        alignment_recomputed_tokens=max(recomputed),
    )


def _vocab_size(model: str) -> int:
    from pathlib import Path

    config = json.loads((Path(model) / "config.json").read_text())
    return int(config.get("text_config", config)["vocab_size"])


def result_line(r: PrefillResult) -> str:
    return (
        f"{r.doc_tokens:>5} tokens: full {r.full_s * 1e3:8.1f} ms"
        f" | GPU hit {r.gpu_hit_s * 1e3:7.1f} ms"
        f" ({r.full_s / r.gpu_hit_s:4.1f}x) | host hit {r.host_hit_s * 1e3:7.1f} ms"
        f" ({r.full_s / r.host_hit_s:4.1f}x) | floor {r.floor_s * 1e3:7.1f} ms"
        f" | GPU hit / floor {r.gpu_hit_s / r.floor_s:4.2f}"
    )
