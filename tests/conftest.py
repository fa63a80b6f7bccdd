"""Shared fixtures: offline models (built once, cached on disk) and one shared vLLM engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real benchmark data (`$RAGCACHE_DATA_DIR`, else `../shared/data`: bench.data_dir);
    tests that need it skip when it is absent."""
    from ragcache_core.bench.data_dir import resolve_data_dir

    folder = resolve_data_dir()
    if not folder.is_dir():
        pytest.skip(f"benchmark data folder {folder} is absent (set RAGCACHE_DATA_DIR)")
    return folder


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The multi-head tiny model (KV heads == heads)."""
    from ragcache_core.testing import build_tiny_model

    return build_tiny_model(size="tiny", attention="mha")


@pytest.fixture(scope="session")
def tiny_model_gqa() -> Path:
    """The grouped-query tiny model (fewer KV heads than heads)."""
    from ragcache_core.testing import build_tiny_model

    return build_tiny_model(size="tiny", attention="gqa")


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[object]:
    """One vLLM engine alive at a time, shared by every test asking for the same settings."""
    from ragcache_core.engine.llm import Engine
    from ragcache_core.testing.engines import EnginePool

    pool: EnginePool[Engine] = EnginePool(Engine, Engine.close)
    yield pool
    pool.close()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
