"""Offline model builder: a BPE tokenizer trained on shipped text and a random-weight Llama.

Tests, benchmarks and the demo need a model that vLLM can load with no download. This module
trains a byte-level BPE tokenizer with `tokenizers` on `ragcache_core/data/tokenizer_text.txt`
(Wikipedia text shipped with the package, CC BY-SA 4.0, see `data/ATTRIBUTION.md`), builds a
Llama-architecture model with `transformers` from a config with seeded random weights, and saves
both with `save_pretrained` so `vllm.LLM(model=folder)` loads the folder.

Sizes:
- `tiny`: 2 layers, hidden 128, head size 32; builds in seconds; for tests.
- `bench`: big enough that prefill dominates (a 1,024-token prefill takes >= 100 ms on 2 CPU
  cores; see docs/benchmarks.md for the measured figure).

Attention shapes (both named in the paper): `mha` (KV heads == heads) and `gqa` (grouped query).

Chat templates: by default the tokenizer is the trained BPE with a minimal chat template.
`chat_template="llama3" | "qwen2.5" | "mistral"` uses that model family's real tokenizer and
chat template instead (`chat_fixtures`: taken from PyPI packages, no model hub), so a chat app's
prompt is rendered and tokenized as the real instruct model does it; the weights stay random.
The embedding and the output layer grow with the vocabulary (128,257 / 151,669 / 131,072 ids
instead of 1,024 or 4,096), and with them the folder (docs/guide-llamaindex.md has the sizes).

The output layer is scaled up so greedy choices are decisive: a random model's near-flat logits
would flip on rounding noise and make exactness tests flaky.

Builds are deterministic (same seed, single-threaded tokenizer training) and cached: a folder
that already holds a complete build with the same recipe is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

Size = Literal["tiny", "bench"]
Attention = Literal["mha", "gqa"]
ChatTemplate = Literal["llama3", "qwen2.5", "mistral"]
CHAT_TEMPLATES: tuple[ChatTemplate, ...] = ("llama3", "qwen2.5", "mistral")
_CHAT_VOCAB = {"llama3": 128257, "qwen2.5": 151669, "mistral": 131072}
"""`len(tokenizer)` of each family's tokenizer (checked when a model is built)."""

RECIPE_FILE = "ragcache_recipe.json"
_RECIPE_VERSION = 1


@dataclass(frozen=True)
class ModelRecipe:
    """Everything that determines the built files; its hash names the cache entry."""

    size: Size
    attention: Attention
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    lm_head_logit_std: float
    seed: int = 0
    version: int = _RECIPE_VERSION
    chat_template: ChatTemplate | None = None
    """A real model family's tokenizer and chat template (None: the trained BPE)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def fields(self) -> dict[str, object]:
        """The recipe as written to the marker (no `chat_template` when there is none, so the
        folders and digests of the builds before it existed stay valid)."""
        data = asdict(self)
        if data["chat_template"] is None:
            del data["chat_template"]
        return data

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:16]


def recipe_for(
    size: Size, attention: Attention = "mha", chat_template: ChatTemplate | None = None
) -> ModelRecipe:
    """The recipe of a named size (with `chat_template`, that family's vocabulary). Head size
    stays >= 32 (vLLM's CPU attention needs it)."""
    if size == "tiny":
        heads, hidden, layers, inter, vocab = 4, 128, 2, 256, 1024
    elif size == "bench":
        heads, hidden, layers, inter, vocab = 8, 512, 6, 1536, 4096
    else:
        raise ValueError(f"unknown model size {size!r}: expected 'tiny' or 'bench'")
    if attention == "mha":
        kv_heads = heads
    elif attention == "gqa":
        kv_heads = heads // 4
    else:
        raise ValueError(f"unknown attention {attention!r}: expected 'mha' or 'gqa'")
    if chat_template is not None:
        if chat_template not in _CHAT_VOCAB:
            raise ValueError(
                f"unknown chat template {chat_template!r}: expected one of {list(CHAT_TEMPLATES)}"
            )
        vocab = _CHAT_VOCAB[chat_template]
    return ModelRecipe(
        size=size,
        attention=attention,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=8192,
        lm_head_logit_std=8.0,
        chat_template=chat_template,
    )


def default_model_dir(
    size: Size = "tiny", attention: Attention = "mha", chat_template: ChatTemplate | None = None
) -> Path:
    """Where built models are cached: `$RAGCACHE_HOME/models/<size>-<attention>` (with a chat
    template, `-<template>` after it; default home `~/.cache/ragcache`)."""
    home = Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache"))
    suffix = f"-{chat_template}" if chat_template else ""
    return home / "models" / f"{size}-{attention}{suffix}"


def is_built(path: Path, recipe: ModelRecipe) -> bool:
    marker = path / RECIPE_FILE
    if not marker.is_file():
        return False
    try:
        return bool(json.loads(marker.read_text()).get("digest") == recipe.digest())
    except (OSError, json.JSONDecodeError):
        return False


def build_tiny_model(
    path: str | Path | None = None,
    size: Size = "tiny",
    attention: Attention = "mha",
    chat_template: ChatTemplate | None = None,
) -> Path:
    """Build (or reuse) the offline model folder and return its path.

    Writes `config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
    `generation_config.json` and a recipe marker. The folder is replaced atomically, so an
    interrupted build never leaves a half-written model that looks complete. `chat_template`
    takes that family's tokenizer and template from PyPI the first time (`chat_fixtures`,
    about 80 MB, cached under `$RAGCACHE_HOME/fixtures`); `RuntimeError` when they do not
    match what this builder expects.
    """
    recipe = recipe_for(size, attention, chat_template)
    target = Path(path) if path is not None else default_model_dir(size, attention, chat_template)
    if is_built(target, recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        if recipe.chat_template is None:
            ids = _train_tokenizer(staging, recipe)
        else:
            ids = _save_chat_tokenizer(staging, recipe)
        _build_weights(staging, recipe, ids)
        (staging / RECIPE_FILE).write_text(
            json.dumps({"digest": recipe.digest(), "recipe": recipe.fields()}, indent=1)
        )
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _training_text() -> str:
    return (resources.files("ragcache_core") / "data" / "tokenizer_text.txt").read_text("utf-8")


@dataclass(frozen=True)
class _SpecialIds:
    """The tokenizer's BOS (None: it has none, as Qwen's) and EOS ids, for the model config."""

    bos: int | None
    eos: int


def _save_chat_tokenizer(folder: Path, recipe: ModelRecipe) -> _SpecialIds:
    """A real family's tokenizer and chat template (`chat_fixtures`), saved into `folder`."""
    import ragcache_core.models.chat_fixtures as chat_fixtures

    assert recipe.chat_template is not None
    tokenizer = chat_fixtures.tokenizer(recipe.chat_template)
    if len(tokenizer) != recipe.vocab_size or tokenizer.eos_token_id is None:
        raise RuntimeError(
            f"the {recipe.chat_template} tokenizer has {len(tokenizer)} ids and EOS "
            f"{tokenizer.eos_token_id!r}; this builder expects {recipe.vocab_size} and an EOS"
        )
    tokenizer.model_max_length = recipe.max_position_embeddings
    tokenizer.save_pretrained(folder)
    return _SpecialIds(bos=tokenizer.bos_token_id, eos=int(tokenizer.eos_token_id))


def _train_tokenizer(folder: Path, recipe: ModelRecipe) -> _SpecialIds:
    # Single-threaded training keeps merges identical from run to run.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_text().split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=recipe.max_position_embeddings,
    )
    # A minimal chat template, so chat-template code paths can be exercised offline.
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(folder)
    return _SpecialIds(bos=0, eos=1)


def _build_weights(folder: Path, recipe: ModelRecipe, ids: _SpecialIds) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=recipe.vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=ids.bos,
        eos_token_id=ids.eos,
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(recipe.seed)
    try:
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            # Logits = h . W with h ~ unit RMS after the final norm; a weight std of
            # c / sqrt(hidden) gives logits of std ~c: decisive greedy choices.
            std = recipe.lm_head_logit_std / recipe.hidden_size**0.5
            model.lm_head.weight.normal_(0.0, std)
            # Never let the random model pick EOS: generations keep their requested length.
            model.lm_head.weight[config.eos_token_id].zero_()
    finally:
        torch.random.set_rng_state(generator_state)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=ids.bos, eos_token_id=ids.eos).save_pretrained(folder)
