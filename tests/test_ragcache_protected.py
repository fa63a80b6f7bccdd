"""The protected set on the real engine (the RAGCache of `_ragcache_shared`, shared with
test_ragcache.py)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
from _ragcache_shared import GPU_TOKENS, reference

from ragcache_core.config import SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.runtime.ragcache import RAGCache

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("settled_after")]
"""`cache` and `settled_after` (no slot, pin or inconsistency left): `_ragcache_shared`."""


# The documents the policy protects stay in vLLM's blocks under vLLM's own eviction pressure
# and are hit there without a copy; the same pressure evicts them with protection off (the
# control); `clear()` works with protected blocks present and leaves none held; an aborted
# request protects nothing. vLLM's own reset with `release_protected=False` fails while any
# block is held: that is how a test sees whether blocks are held inside the engine core.

LONG_TEXT = "Vienna is the capital of Austria, on the river Danube, with palaces and parks. "
LONG_DOCS = [Document(f"p{i}", f"Document {i}. " + LONG_TEXT * 6) for i in range(2)]


@pytest.fixture
def protecting(cache: RAGCache) -> Iterator[RAGCache]:
    """The cache with a protected set of 2,048 tokens (its default here is 0: vLLM's KV holds
    one max-length sequence and a little), emptied before and after."""
    cache.clear()
    cache.tree.protected.budget_tokens = 2048
    try:
        yield cache
    finally:
        cache.clear()
        cache.tree.protected.budget_tokens = 0


def held_in_engine(cache: RAGCache) -> bool:
    """Whether the engine core holds any block with no request running (vLLM refuses its own
    reset then); a reset that succeeds empties vLLM's prefix cache."""
    return not cache._loop.run(cache.engine.reset_prefix_cache(release_protected=False))


def pressure(cache: RAGCache, tokens: int = 2 * GPU_TOKENS) -> None:
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


@pytest.mark.parametrize("protect", [True, False])
def test_protected_documents_survive_vllm_eviction_and_hit_without_a_copy(
    protecting: RAGCache, protect: bool
) -> None:
    cache = protecting
    if not protect:
        cache.tree.protected.budget_tokens = 0  # the control: vLLM's LRU alone
    first = cache.generate("Which river runs through Vienna?", LONG_DOCS)
    assert first.hits.hit_docs == 0
    assert (len(cache.tree.protected) == 3) is protect  # the root and both documents
    pressure(cache)
    second = cache.generate("What does Vienna have?", LONG_DOCS)
    assert second.token_ids == reference(cache, "What does Vienna have?", LONG_DOCS)
    if protect:
        # The first document lies wholly in protected blocks: a GPU hit, no byte copied; the
        # second up to its last whole block, its tail (sharing a block with the question)
        # from the host tier.
        assert (second.hits.gpu_docs, second.hits.host_docs) == (1, 1)
    else:
        assert (second.hits.gpu_docs, second.hits.host_docs) == (0, 2)


def test_clear_with_protected_blocks_leaves_none_held(protecting: RAGCache) -> None:
    cache = protecting
    cache.generate("Which river runs through Vienna?", LONG_DOCS)
    assert len(cache.tree.protected) == 3
    assert held_in_engine(cache)  # protected blocks block vLLM's own reset
    cache.clear()
    assert len(cache.tree.protected) == 0 and cache.tree.protected.releasing_tokens == 0
    assert not held_in_engine(cache)


def test_an_aborted_request_protects_nothing(protecting: RAGCache) -> None:
    cache = protecting

    async def start_and_disconnect() -> None:
        stream = cache.astream(
            "Which river runs through Vienna?",
            documents=LONG_DOCS,
            sampling=SamplingConfig(max_tokens=400, ignore_eos=True),
        )
        async for _ in stream:
            break  # the client goes away after its first chunk
        await stream.aclose()
        await asyncio.sleep(1.0)  # the engine core sees the abort

    asyncio.run(start_and_disconnect())
    deadline = time.monotonic() + 30
    while cache.stats()["engine_requests"] and time.monotonic() < deadline:
        time.sleep(0.1)  # vLLM has let go of the request (and of its own blocks)
    assert cache.stats()["engine_requests"] == 0
    # No report comes for an aborted request: the tree cannot know what the engine holds, so
    # it counts nothing as held and has the next plan release the request's entries.
    assert len(cache.tree.protected) == 0 and cache.tree.protected.releasing_tokens > 0
    assert not held_in_engine(cache)  # the engine took none


def test_invalidated_documents_are_released_by_the_next_plan(protecting: RAGCache) -> None:
    cache = protecting
    cache.generate("Which river runs through Vienna?", LONG_DOCS)
    cache.invalidate(LONG_DOCS[0].id)  # the document and what was computed after it
    assert len(cache.tree.protected) == 1 and cache.tree.protected.releasing_tokens > 0
    cache.generate("Which river runs through Vienna?", [])  # carries the release
    assert cache.tree.protected.releasing_tokens == 0
    pressure(cache)
    again = cache.generate("What does Vienna have?", LONG_DOCS)
    assert again.hits.gpu_docs == 0  # released: vLLM's LRU evicted them
