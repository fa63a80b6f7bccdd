"""scripts/pi_quality.py (issue 58's quality measurement, outside the engine): RoPE's
re-rotation of cached keys, the control variant that recomputes every document equal to the
exact prompt, the link's length per variant, and the report's paired figures."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers.cache_utils import DynamicCache

from ragcache_core.bench.quality_streams import QualityItem
from ragcache_core.documents import Document

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pi_quality", SCRIPTS / "pi_quality.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measure(tiny_model_gqa: Path) -> object:
    torch.manual_seed(0)
    return _script().Measure(tiny_model_gqa)


def _layer0_keys(measure: object, ids: list[int], start: int) -> torch.Tensor:
    cache = DynamicCache()
    positions = torch.arange(start, start + len(ids))[None]
    with torch.inference_mode():
        measure.model(input_ids=torch.tensor([ids]), position_ids=positions, past_key_values=cache)  # type: ignore[attr-defined]
    return cache.layers[0].keys


def test_moved_keys_equal_the_keys_computed_at_the_served_position(measure: object) -> None:
    script = sys.modules["pi_quality"]
    ids = measure.tokenizer("the quick brown fox jumps over the lazy dog").input_ids  # type: ignore[attr-defined]
    at_zero = _layer0_keys(measure, ids, 0)
    for delta in (1, 37, 500):
        direct = _layer0_keys(measure, ids, delta)
        shifted = script.moved(at_zero, delta, measure.inv_freq)  # type: ignore[attr-defined]
        assert torch.allclose(shifted, direct, atol=1e-4), delta
        assert not torch.allclose(at_zero, direct, atol=1e-2)  # the rotation did move them
    assert torch.equal(script.moved(at_zero, 0, measure.inv_freq), at_zero)  # type: ignore[attr-defined]


def _item() -> QualityItem:
    texts = (
        "Paris is the capital of France and its largest city by population.",
        "The Loire is the longest river in France, flowing to the Atlantic.",
        "Mont Blanc is the highest mountain in the Alps and in western Europe.",
    )
    documents = tuple(
        Document(f"d{i}", text, {"title": f"Doc {i}"}) for i, text in enumerate(texts)
    )
    return QualityItem("q0", "What is the capital of France?", ("Paris",), documents, 0)


def test_the_control_equals_the_exact_prompt_and_links_grow_with_k(
    measure: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = sys.modules["pi_quality"]
    monkeypatch.setattr(script, "MAX_TOKENS", 8)  # the tiny model never stops by itself
    variants = ["exact", "k=0", "k=2", "k=2b", "k=all"]
    row = {"n": 0} | measure.question(_item(), variants)  # type: ignore[attr-defined]
    assert row["reply_ids"]["k=all"] == row["reply_ids"]["exact"]
    nodes = row["node_tokens"]
    link = row["link_tokens"]
    assert link["exact"] == 0
    assert link["k=all"] == sum(nodes[1:])  # the first node is the canonical place itself
    assert 0 < link["k=0"] < link["k=2"] <= link["k=2b"] <= link["k=all"]
    assert link["k=2"] - link["k=0"] == 2 * (len(nodes) - 1)
    # k=0 reuses whole documents after their held-back heads: each was checked at layer 0
    assert measure.rotation_checks >= len(nodes) - 1  # type: ignore[attr-defined]
    assert measure.rotation_error < 1e-3  # type: ignore[attr-defined]
    summary = script.report([row], variants)["variants"]
    assert summary["k=all"]["f1_minus_exact"]["value"] == 0.0
    assert summary["k=all"]["identical_ids"] == 1
    assert summary["k=0"]["link_tokens_mean"] == link["k=0"]
