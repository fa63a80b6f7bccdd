"""No-reuse A/B: the per-request cost of RAGCache where caching can only cost.

N requests, each with two documents of the shipped demo corpus that no other request uses
(no reuse at all), bench model, one at a time (light load), sent alternately to RAGCache and to
plain vLLM (idle connector, the `vllm` baseline of `bench serve`), alternating which goes
first; prints TTFT mean/p50/p95 per system and RAGCache's mean `QueryResult.timings`.

    .venv/bin/python scripts/noreuse_ab.py 60            # speculation off, defaults
    .venv/bin/python scripts/noreuse_ab.py 60 '{"store_policy": "second"}'
"""

import asyncio
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path


def summ(v):
    v = sorted(v)
    return {
        "mean": round(statistics.fmean(v), 1),
        "p50": round(v[len(v) // 2], 1),
        "p95": round(v[int(0.95 * (len(v) - 1))], 1),
    }


def main():
    from ragcache_core.bench.serve import baseline_settings, default_sampling
    from ragcache_core.config import CacheConfig
    from ragcache_core.engine.async_engine import AsyncEngine
    from ragcache_core.models import build_tiny_model
    from ragcache_core.retrieval.corpus import load_corpus
    from ragcache_core.runtime.ragcache import RAGCache

    model = str(build_tiny_model(size="bench"))
    docs = load_corpus([Path(str(resources.files("ragcache_core") / "data" / "demo_corpus.jsonl"))])
    n = int(sys.argv[1])
    extra = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    pairs = [(docs[2 * i], docs[2 * i + 1]) for i in range(n)]
    config = CacheConfig(
        sampling=default_sampling(8),
        host_pool_tokens=65536,
        vllm_kv_cache_gib=0.25,
        speculation=False,
        **extra,
    )
    engine = AsyncEngine(baseline_settings("vllm", model, config))
    with RAGCache(model, config) as cache:
        qs = [
            f"Question {i} about {a.metadata.get('title', '')}?" for i, (a, b) in enumerate(pairs)
        ]
        prompts = [
            cache.prompts.build(q, [a, b]).token_ids for q, (a, b) in zip(qs, pairs, strict=True)
        ]
        rc, vl, tim = [], [], []

        async def v(i, p):
            t0 = time.perf_counter()
            first = 0
            async for ev in engine.stream(f"v{i}-{time.monotonic_ns()}", p, config.sampling):
                if ev.token_ids and not first:
                    first = time.perf_counter()
            return 1e3 * (first - t0)

        async def go():
            await cache.agenerate("warm up?", [docs[-1]])
            await v(0, prompts[0][:40])
            cache.clear()
            for i, (q, (a, b)) in enumerate(zip(qs, pairs, strict=True)):
                if i % 2:
                    vl.append(await v(i, prompts[i]))
                    r = await cache.agenerate(q, [a, b])
                else:
                    r = await cache.agenerate(q, [a, b])
                    vl.append(await v(i, prompts[i]))
                rc.append(1e3 * r.ttft_s)
                tim.append(r.timings)
            engine.close()

        asyncio.run(go())
    keys = ["plan", "engine_first_token", "load_copy", "store_copy", "settle"]
    print(
        json.dumps(
            {
                "extra": extra,
                "n": n,
                "prompt_tokens": statistics.fmean(map(len, prompts)),
                "ragcache": summ(rc),
                "vllm": summ(vl),
                "ragcache_timings_ms": {
                    k: round(statistics.fmean(1e3 * t.get(k, 0) for t in tim), 2) for k in keys
                },
                "ratio_of_means": round(statistics.fmean(rc) / statistics.fmean(vl), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
