"""Shared fixtures: offline models (built once, cached on disk) and one shared vLLM engine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """`../shared/data` (real benchmark data); tests that need it skip when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"benchmark data folder {SHARED_DATA} is absent")
    return SHARED_DATA


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
