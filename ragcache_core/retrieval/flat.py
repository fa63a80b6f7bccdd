"""Single-stage search over any Faiss index (flat, or a type we do not stage)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import InputError, RAGCacheError
from ragcache_core.retrieval.base import Metric, Stage, StagedSearch, metric_of

if TYPE_CHECKING:
    from ragcache_core.retrieval.ivf import StageSizing


class SingleStage(StagedSearch):
    """One stage: the plain `index.search` (exact for a flat index). Never mutates the index."""

    def __init__(self, index: Any) -> None:
        self._index: Any = index
        self.metric: Metric = metric_of(index)
        self.dimension: int = int(index.d)

    @property
    def ntotal(self) -> int:
        return int(self._index.ntotal)

    @property
    def can_speculate(self) -> bool:
        return False

    def stages(self, query_vectors: npt.ArrayLike, k: int) -> Iterator[Stage]:
        x = self._check(query_vectors, k)
        start_time = time.perf_counter()
        dist, ids = self._index.search(x, k)  # [nq, k] each
        if np.any(ids < 0):
            raise RAGCacheError(f"the index returned fewer than k={k} results")
        yield Stage(
            ids=ids, scores=dist, index=0, is_last=True, elapsed_s=time.perf_counter() - start_time
        )


class MatrixFlat(StagedSearch):
    """Exact cosine similarity over an in-memory [n, d] matrix, one stage (numpy, float64).

    For stores whose vectors are plain lists (LlamaIndex's `SimpleVectorStore`). Scores are
    `dot(q, v) / (|q| |v|)` in float64, as LlamaIndex computes them, so the ranking matches the
    store's own query. The matrix is copied once (the store keeps Python lists, not an array).
    """

    def __init__(self, vectors: npt.ArrayLike) -> None:
        matrix = np.asarray(vectors, dtype=np.float64)  # [n, d]
        if matrix.ndim != 2 or matrix.shape[0] == 0:
            raise InputError(f"expected a non-empty [n, d] matrix, got shape {matrix.shape}")
        self._matrix = matrix
        self._norms = np.linalg.norm(matrix, axis=1)  # [n]
        self.metric: Metric = Metric.INNER_PRODUCT
        self.dimension: int = int(matrix.shape[1])

    @property
    def ntotal(self) -> int:
        return int(self._matrix.shape[0])

    @property
    def can_speculate(self) -> bool:
        return False

    def stages(self, query_vectors: npt.ArrayLike, k: int) -> Iterator[Stage]:
        x = self._check(query_vectors, k).astype(np.float64)  # [nq, d]
        start_time = time.perf_counter()
        dots = x @ self._matrix.T  # [nq, n]
        with np.errstate(divide="ignore", invalid="ignore"):
            cos = dots / (np.linalg.norm(x, axis=1)[:, None] * self._norms[None, :])
        cos = np.nan_to_num(cos, nan=-np.inf)
        order = np.argsort(-cos, axis=1, kind="stable")[:, :k]  # [nq, k]
        yield Stage(
            ids=order.astype(np.int64),
            scores=np.take_along_axis(cos, order, axis=1).astype(np.float32),
            index=0,
            is_last=True,
            elapsed_s=time.perf_counter() - start_time,
        )


def staged_search_for(
    index: Any,
    *,
    nprobe: int | None = None,
    sizing: StageSizing | None = None,
    ef_search: int | None = None,
) -> StagedSearch:
    """The staged search that fits a Faiss index: IVF, HNSW, else a single stage.

    `nprobe` and `sizing` apply to IVF, `ef_search` to HNSW (None: the index's own setting).
    Wrappers such as IndexIDMap or IndexPreTransform get a single stage.
    """
    import faiss

    from ragcache_core.retrieval.hnsw import StagedHNSW
    from ragcache_core.retrieval.ivf import StagedIVF

    concrete = faiss.downcast_index(index)  # a non-owning proxy: pass the caller's object on
    if isinstance(concrete, faiss.IndexIVF):
        return StagedIVF(index, nprobe=nprobe, sizing=sizing)
    if isinstance(concrete, faiss.IndexHNSW):
        return StagedHNSW(index, ef_search=ef_search)
    return SingleStage(index)
