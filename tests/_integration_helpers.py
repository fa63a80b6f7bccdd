"""Shared pieces of the LlamaIndex / LangChain integration tests: the shipped sample corpus, the
small cache settings, and the plain-vLLM reference the drop-ins must match token for token."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from ragcache_core.config import CacheConfig, SamplingConfig
from ragcache_core.documents import Document
from ragcache_core.retrieval.corpus import load_corpus, load_questions

REPO = Path(__file__).resolve().parents[1]
SAMPLING = SamplingConfig(max_tokens=8, ignore_eos=True)
CONFIG = CacheConfig(host_pool_tokens=4096, top_k=2, sampling=SAMPLING)
_ref_ids = itertools.count()


def sample_file(name: str) -> Path:
    return Path(str(resources.files("ragcache_core") / "data" / name))


def corpus(limit: int = 120) -> tuple[Document, ...]:
    return load_corpus([sample_file("demo_corpus.jsonl")])[:limit]


def questions(limit: int = 6) -> list[str]:
    return [q.text for q in load_questions(sample_file("demo_questions.jsonl"), limit=limit)]


def shared_cache(engine_pool: Any, model: Path) -> Any:
    """The RAGCache with `CONFIG` on `model` that both integration modules drive (an engine
    start costs ~20 s): held by `engine_pool`, and emptied for each module that asks (`clear()`:
    both tiers and the counters), so that each starts cold as with a cache of its own."""
    from ragcache_core.runtime.ragcache import RAGCache

    key = ("RAGCache", str(model), repr(CONFIG))
    cache = engine_pool.hold(key, lambda: RAGCache(model, CONFIG))
    cache.clear()
    return cache


@pytest.fixture(scope="module")
def cache(tiny_model: Path, engine_pool: Any) -> Any:
    """The integration modules' fixture (each takes it as `cache = _integration_helpers.cache`):
    the shared RAGCache, cold for each module (`shared_cache`)."""
    return shared_cache(engine_pool, tiny_model)


def plain_tokens(cache: Any, ids: Sequence[int], sampling: SamplingConfig) -> tuple[int, ...]:
    """Plain vLLM's answer ids on `ids`: the cache's engine with no plan (no cache involved)
    and its prefix cache not read."""

    async def run() -> tuple[int, ...]:
        tokens: tuple[int, ...] = ()
        async for event in cache.engine.stream(
            f"plain-{next(_ref_ids)}", list(ids), sampling, read_prefix_cache=False
        ):
            tokens = tuple(event.token_ids)
        return tokens

    result: tuple[int, ...] = cache._loop.run(run())
    return result


def reference(
    cache: Any, question: str, documents: tuple[Document, ...], prompt: Any = None
) -> Any:
    """Plain vLLM on the same prompt ids (`prompt`: the app's `AppPrompt`, None the cache's
    layout): the engine with no kv_transfer_params (no cache involved; vLLM's own prefix
    caching is off in a RAGCache). Returns the last StreamEvent."""

    async def run() -> Any:
        ids = cache.prompts.build(question, documents, prompt).token_ids  # on the cache's loop
        last = None
        async for event in cache.engine.stream(
            f"reference-{next(_ref_ids)}", ids, SAMPLING, read_prefix_cache=False
        ):
            last = event
        return last

    return cache._loop.run(run())


def import_with_version(module: str, distribution: str, version: str, tmp: Path) -> Any:
    """Import `module` in a fresh interpreter that sees `distribution` at `version` (a real
    dist-info folder placed first on the path, so importlib.metadata finds it first)."""
    name = distribution.replace("-", "_")
    info = tmp / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n", encoding="utf-8"
    )
    env = {"PYTHONPATH": f"{tmp}:{REPO}", "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
        timeout=120,
    )


def guide_blocks(guide: Path, headings: tuple[str, ...] = ("## ",)) -> list[tuple[str, str]]:
    """Every Python block of the guide `guide`, as written, with the last line before it that
    starts with one of `headings` (a section heading, or a bold lead)."""
    blocks, heading = [], ""
    lines = iter(guide.read_text(encoding="utf-8").splitlines())
    for line in lines:
        if line.startswith(headings):
            heading = line
        elif line == "```python":
            body = []
            for inner in lines:
                if inner == "```":
                    break
                body.append(inner)
            blocks.append((heading, "\n".join(body) + "\n"))
    return blocks


class GuideCache:
    """`RAGCache("/models/my-llama")` in a guide's snippet: the test module's cache, entered
    and left without closing it (monkeypatch `ragcache_core.RAGCache` with it)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __call__(self, model: str, *args: Any, **kwargs: Any) -> GuideCache:
        assert model == "/models/my-llama", model
        return self

    def __enter__(self) -> Any:
        return self.cache

    def __exit__(self, *exc: object) -> None:
        return None
