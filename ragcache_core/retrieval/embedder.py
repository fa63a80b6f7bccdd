"""The offline default embedder: TF-IDF + truncated SVD (latent semantic analysis).

A real embedder that needs no download, for the demo, the benchmarks and tests: scikit-learn's
`TfidfVectorizer` (sublinear tf, English stop words) followed by `TruncatedSVD` (randomized, fixed
seed), then L2 normalization, so the inner product is the cosine similarity. Fitting is
deterministic for the same texts and config. A text with no known word embeds to the zero vector.

Saved as two plain files next to the index (no pickle): `embedder.json` (config and vocabulary)
and `embedder.npz` (idf weights and SVD components).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import ConfigError, InputError

_FORMAT = "ragcache-tfidf-svd/1"


class Embedder(Protocol):
    """Texts to unit-norm float32 vectors (inner product = cosine). Implementations: this
    module's `TfidfSvdEmbedder` (the default, fit on the corpus) and
    `retrieval.sentence.SentenceEmbedder` (all-MiniLM-L6-v2, for benchmarks)."""

    @property
    def dimension(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """[len(texts), dimension] (pure)."""
        ...

    def embed_query(self, text: str) -> npt.NDArray[np.float32]:
        """[dimension] (pure)."""
        ...


@dataclass(frozen=True)
class EmbedderConfig:
    """How the TF-IDF + SVD embedder is fit."""

    dimension: int = 256
    max_features: int = 100_000
    min_df: int = 1
    max_df: float = 0.5
    sublinear_tf: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dimension < 1 or self.max_features < 1 or self.min_df < 1:
            raise ConfigError(f"bad embedder config {self}")
        if not 0.0 < self.max_df <= 1.0:
            raise ConfigError(f"max_df must be in (0, 1], got {self.max_df}")


class TfidfSvdEmbedder:
    """Embeds texts into unit-norm float32 vectors of `dimension` (read-only after fit/load)."""

    def __init__(
        self,
        config: EmbedderConfig,
        vocabulary: dict[str, int],
        idf: npt.NDArray[np.float64],
        components: npt.NDArray[np.float64],
    ) -> None:
        from sklearn.feature_extraction.text import TfidfVectorizer

        if components.shape[1] != len(vocabulary) or idf.shape != (len(vocabulary),):
            raise InputError("embedder files are inconsistent (vocabulary, idf, components)")
        self.config = config
        # Kept transposed and contiguous: `sparse @ components.T` on the [dimension, vocabulary]
        # array copied all of it on every call (80 ms per query for 52k words, measured; the
        # product itself takes 0.5 ms). Same values, same order of sums.
        self._components_t = np.ascontiguousarray(components.T)  # [vocabulary, dimension]
        self._vectorizer = TfidfVectorizer(
            vocabulary=vocabulary,
            sublinear_tf=config.sublinear_tf,
            stop_words="english",
            dtype=np.float64,
        )
        self._vectorizer.idf_ = idf

    @property
    def dimension(self) -> int:
        return int(self._components_t.shape[1])

    @classmethod
    def fit(
        cls, texts: Sequence[str], config: EmbedderConfig = EmbedderConfig()
    ) -> TfidfSvdEmbedder:
        """Fit on `texts` (the corpus). Raises `InputError` when they hold no usable words."""
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfVectorizer
        from threadpoolctl import threadpool_limits

        if not texts:
            raise InputError("cannot fit an embedder on an empty corpus")
        # max_df is a fraction; on a tiny corpus it could drop every word, so relax it there.
        max_df = config.max_df if len(texts) >= 20 else 1.0
        vectorizer = TfidfVectorizer(
            max_features=config.max_features,
            min_df=config.min_df,
            max_df=max_df,
            sublinear_tf=config.sublinear_tf,
            stop_words="english",
            dtype=np.float64,
        )
        try:
            tfidf = vectorizer.fit_transform(texts)  # [n, vocabulary] sparse
        except ValueError as exc:  # "empty vocabulary"
            raise InputError(f"the corpus has no indexable words: {exc}") from exc
        n_terms = tfidf.shape[1]
        dimension = min(config.dimension, n_terms - 1, len(texts) - 1)
        if dimension < 1:
            raise InputError(
                f"corpus too small to embed: {len(texts)} documents, {n_terms} distinct words"
            )
        svd = TruncatedSVD(
            n_components=dimension, algorithm="randomized", n_iter=7, random_state=config.seed
        )
        # One BLAS thread: on a busy small machine multi-threaded OpenBLAS spins and runs the SVD
        # 30x slower (measured on 2 shared cores); one thread also makes the fit reproducible.
        with threadpool_limits(limits=1, user_api="blas"):
            svd.fit(tfidf)
        vocabulary = {str(term): int(i) for term, i in vectorizer.vocabulary_.items()}
        return cls(config, vocabulary, vectorizer.idf_, svd.components_)

    def embed(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        """Unit-norm embeddings of `texts`, [len(texts), dimension] (pure)."""
        if isinstance(texts, str):
            raise InputError("embed() takes a list of texts, not one string")
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        tfidf = self._vectorizer.transform(texts)  # [n, vocabulary] sparse
        dense = np.asarray(tfidf @ self._components_t)  # [n, dimension]
        norms = np.linalg.norm(dense, axis=1, keepdims=True)
        dense = np.divide(dense, norms, out=np.zeros_like(dense), where=norms > 0)
        return np.ascontiguousarray(dense, dtype=np.float32)

    def embed_query(self, text: str) -> npt.NDArray[np.float32]:
        """One text's embedding, [dimension]."""
        return self.embed([text])[0]

    def save(self, folder: Path) -> None:
        """Write `embedder.json` and `embedder.npz` into `folder` (created if needed)."""
        folder.mkdir(parents=True, exist_ok=True)
        meta: dict[str, Any] = {
            "format": _FORMAT,
            "config": asdict(self.config),
            "vocabulary": self._vectorizer.vocabulary,
        }
        (folder / "embedder.json").write_text(json.dumps(meta), encoding="utf-8")
        components = self._components_t.T  # [dimension, vocabulary], as saved before
        np.savez(folder / "embedder.npz", idf=self._vectorizer.idf_, components=components)

    @classmethod
    def load(cls, folder: Path) -> TfidfSvdEmbedder:
        """Read an embedder written by `save`. Raises `InputError` for missing or bad files."""
        try:
            meta = json.loads((folder / "embedder.json").read_text(encoding="utf-8"))
            arrays = np.load(folder / "embedder.npz")
            idf, components = arrays["idf"], arrays["components"]
        except (OSError, ValueError, KeyError) as exc:
            raise InputError(f"{folder}: cannot read the embedder: {exc}") from exc
        if meta.get("format") != _FORMAT:
            raise InputError(f"{folder}/embedder.json: unknown format {meta.get('format')!r}")
        return cls(EmbedderConfig(**meta["config"]), meta["vocabulary"], idf, components)
