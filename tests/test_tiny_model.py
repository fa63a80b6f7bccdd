"""The offline model builder: deterministic, cached, loadable, both attention shapes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ragcache_core.testing.tiny_model import build_tiny_model, recipe_for


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", size="tiny", attention="mha")
    b = build_tiny_model(tmp_path / "b", size="tiny", attention="mha")
    assert _digest(a) == _digest(b)


def test_build_is_cached(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", size="tiny")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path / "m", size="tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_stale_folder_is_rebuilt(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m", size="tiny", attention="mha")
    # A folder built with another recipe (here: the GQA variant) must not be reused.
    gqa = build_tiny_model(tmp_path / "m", size="tiny", attention="gqa")
    config = json.loads((gqa / "config.json").read_text())
    assert path == gqa
    assert config["num_key_value_heads"] < config["num_attention_heads"]


@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_shapes_and_tokenizer(tmp_path: Path, attention: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    path = build_tiny_model(tmp_path / attention, size="tiny", attention=attention)  # type: ignore[arg-type]
    recipe = recipe_for("tiny", attention)  # type: ignore[arg-type]
    config = AutoConfig.from_pretrained(path)
    assert config.num_attention_heads == recipe.num_heads
    assert config.num_key_value_heads == recipe.num_kv_heads
    assert config.head_dim >= 32  # vLLM's CPU attention needs head size >= 32
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode("The Eiffel Tower is in Paris.", add_special_tokens=False)
    assert 3 < len(ids) < 30
    assert tokenizer.decode(ids) == "The Eiffel Tower is in Paris."


def test_unknown_size_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model size"):
        recipe_for("huge")  # type: ignore[arg-type]


def test_model_build_command_writes_the_model_it_describes(
    tmp_path: Path, tiny_model: Path
) -> None:
    """`ragcache model build --size tiny --out DIR`: the same files as the builder the suite's
    engines load, and one line naming the folder and the shapes written to its config."""
    import subprocess
    import sys

    out = tmp_path / "model"
    command = [sys.executable, "-m", "ragcache_core", "model", "build", "--size", "tiny"]
    result = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _digest(out) == _digest(tiny_model)
    config = json.loads((out / "config.json").read_text())
    assert result.stdout.strip() == (
        f"{out}  (tiny, mha: {config['num_hidden_layers']} layers, hidden "
        f"{config['hidden_size']}, {config['num_attention_heads']} heads / "
        f"{config['num_key_value_heads']} KV heads, vocab {config['vocab_size']})"
    )
