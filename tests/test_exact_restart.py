"""The host pool outlives the engine: KV written by one vLLM engine is read, exactly, by the
next one (docs/design.md 2.6: upper nodes recover from host memory after a worker restart)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ragcache_core.engine.cached import CachedEngine, PoolSettings
from ragcache_core.engine.llm import GreedySampling
from ragcache_core.engine.settings import EngineSpec
from ragcache_core.plan import LoadSpan, Plan, StoreSpan, Tier

pytestmark = pytest.mark.vllm

PAGE = 16
SAMPLING = GreedySampling(max_tokens=6, logprobs=True)


def test_host_pool_survives_engine_restart(engine_pool, tiny_model: Path) -> None:
    engine_pool.close()  # one engine alive at a time on this machine
    rng = random.Random(11)
    system, doc = (
        [rng.randrange(3, 1000) for _ in range(45)],
        [rng.randrange(3, 1000) for _ in range(83)],
    )
    question = [rng.randrange(3, 1000) for _ in range(9)]
    # RAGCache mode: vLLM's prefix cache (the GPU tier) dies with the engine, the host pool
    # does not.
    settings = EngineSpec(model=str(tiny_model), max_model_len=1024)
    pools = PoolSettings(host_pool_gib=0.002, page_size=PAGE, host_pool_name="test-restart")
    host = tuple(range(30, 38))  # 128 tokens = 8 pages
    first = CachedEngine(settings, pools)
    try:
        stored = first.run(
            system + doc + question,
            Plan(PAGE, store=(StoreSpan(Tier.HOST, host, 0, 128),)),
            SAMPLING,
        )
        assert stored.connector.stored
    finally:
        first.close()  # keeps the host pool file
    second = CachedEngine(settings, pools)  # a new engine and worker process
    try:
        reference = second.run(system + doc + question, None, SAMPLING)
        second.reset_prefix_cache()  # the reference's blocks: the hit must come from host
        hit = second.run(
            system + doc + question,
            Plan(PAGE, load=(LoadSpan(Tier.HOST, host, 0, 128),)),
            SAMPLING,
        )
        assert (hit.connector.host_tokens, hit.gpu_hit_tokens) == (128, 0)
        assert hit.token_ids == reference.token_ids == stored.token_ids
        # The loaded KV was computed by the first engine's process and the reference by the
        # second one's: two processes' float32 kernels agree to rounding, not always to the bit
        # (CI saw 5e-7 once). A wrong KV moves logprobs by far more than this bound.
        assert hit.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    finally:
        second.close(unlink_host_pool=True)
