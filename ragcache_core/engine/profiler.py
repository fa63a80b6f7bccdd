"""Measure the engine's prefill time T(alpha cached, beta new) for the cost model.

For each alpha on the grid, alpha tokens of KV are computed and stored once (host pool, and vLLM's
prefix cache keeps the blocks: the GPU tier); then for each beta a request of alpha + beta tokens,
with a plan through the RAGCache connector, is served the alpha tokens by the GPU tier (no copy) and
computes the beta new ones. T is vLLM's TTFT (arrival to first token, one output token), the median
over `repeats` runs with fresh new tokens. alpha = 0 is a full prefill. The result is a
`CostProfile` (ragcache_core.cost.profile), the format PGDSF and the simulator read.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.config import SamplingConfig
from ragcache_core.cost.profile import CostProfile
from ragcache_core.engine.cached import CachedEngine, PoolSettings, require_plan_ran
from ragcache_core.engine.settings import EngineSpec
from ragcache_core.errors import ConfigError
from ragcache_core.plan import LoadSpan, Plan, StoreSpan, Tier
from ragcache_core.storage.memory import GIB
from ragcache_core.storage.pool_layout import layout_for_model

DEFAULT_CACHED = (0, 256, 1024, 2048)
DEFAULT_NEW = (16, 128, 512, 1024)
PAGE = 16
SAMPLING = SamplingConfig(max_tokens=1, ignore_eos=True)


def hardware_name() -> str:
    """A short description of where the profile was measured."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        pass
    return f"CPU {platform.machine()} x{os.cpu_count()} ({platform.processor() or 'unknown'})"


def profile_prefill(
    model: str,
    cached_tokens: Sequence[int] = DEFAULT_CACHED,
    new_tokens: Sequence[int] = DEFAULT_NEW,
    repeats: int = 3,
    seed: int = 0,
    on_point: Callable[[int, int, float], None] | None = None,
) -> CostProfile:
    """Measure the grid in one engine run. `on_point(alpha, beta, seconds)` is called after
    each grid point (progress bars). Raises `ConfigError` for a bad grid, `RAGCacheError` when
    a run was not served as planned (its time would not be T(alpha, beta))."""
    alphas, betas = tuple(sorted(set(cached_tokens))), tuple(sorted(set(new_tokens)))
    if len(alphas) < 2 or len(betas) < 2 or alphas[0] < 0 or betas[0] < 1 or repeats < 1:
        raise ConfigError(
            "the profile grid needs >= 2 cached values >= 0, >= 2 new values >= 1, repeats >= 1"
        )
    spec, pools = _engine_setup(model, alphas[-1], betas[-1])
    rng = random.Random(seed)
    vocab = int(_config(model).get("vocab_size", 1000))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    grid: list[list[float]] = []
    with CachedEngine(spec, pools) as engine:
        engine.run(tokens(64), None, SAMPLING)  # warm-up
        for alpha in alphas:
            grid.append(_measure_row(engine, alpha, betas, tokens, repeats, on_point))
    return CostProfile(
        model=str(_config(model).get("_name_or_path") or Path(model).name),
        hardware=hardware_name(),
        cached_tokens=alphas,
        new_tokens=betas,
        prefill_s=tuple(tuple(row) for row in grid),
    )


def _engine_setup(model: str, cached: int, new: int) -> tuple[EngineSpec, PoolSettings]:
    """One engine for the whole grid: a host pool that holds the largest cached prefix."""
    layout = layout_for_model(model, dtype="float32", page_size=PAGE)
    pool_gib = (slots_for_tokens(cached, PAGE) + 1) * layout.slot_bytes / GIB
    longest = cached + new
    spec = EngineSpec(
        model=model,
        dtype="float32",
        max_model_len=longest + 16,
        max_num_batched_tokens=longest + 16,
        kv_cache_bytes=int(max(1.0, 3 * (longest + 64) * layout.token_bytes / GIB) * GIB),
    )
    return spec, PoolSettings(host_pool_gib=pool_gib, page_size=PAGE)


def _measure_row(
    engine: CachedEngine,
    alpha: int,
    betas: Sequence[int],
    tokens: Callable[[int], list[int]],
    repeats: int,
    on_point: Callable[[int, int, float], None] | None,
) -> list[float]:
    """T(alpha, beta) for every beta: alpha tokens stored once, then served to each run by
    vLLM's prefix cache (the GPU tier: the plan's host loads are past nothing, no copy).
    Raises `RAGCacheError` when a run was not served as planned (`require_plan_ran`)."""
    prefix = tokens(alpha)
    slots = tuple(range(slots_for_tokens(alpha, PAGE)))
    plan: Plan | None = None
    if alpha:
        store = Plan(PAGE, store=(StoreSpan(Tier.HOST, slots, 0, alpha),))
        require_plan_ran(engine.run(prefix + tokens(1), store, SAMPLING), store)
        plan = Plan(PAGE, load=(LoadSpan(Tier.HOST, slots, 0, alpha),))
    row = []
    for beta in betas:
        times = []
        for _ in range(repeats):
            run = engine.run(prefix + tokens(beta), plan, SAMPLING)
            if plan is not None:
                require_plan_ran(run, plan)
            times.append(run.ttft_s)
        row.append(statistics.median(times))
        if on_point is not None:
            on_point(alpha, beta, row[-1])
    return row


def _config(model: str) -> dict[str, Any]:
    data = json.loads((Path(model) / "config.json").read_text(encoding="utf-8"))
    return dict(data.get("text_config", data))
