"""The staged-search interface: a vector search that reports its current top-k after each stage.

Dynamic speculative pipelining (docs/design.md 2.5) needs the search to say, while it is still
running, which documents it would return if it stopped now. A `StagedSearch` does that for a batch
of query vectors: `stages(query_vectors, k)` is a generator whose every item is a `Stage`, the
top-k after one more slice of work. The last stage (`is_last=True`) is exactly what the plain
Faiss search returns with the same parameters (same ids, same order), so speculation never
changes an answer. Each stage's Faiss call releases the GIL, so stepping the generator in a worker
thread overlaps with generation.

Scores are the index's raw values: similarities (higher is better) for inner product, distances
(lower is better) otherwise; `Metric` says which.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import InputError

IdArray = npt.NDArray[np.int64]
ScoreArray = npt.NDArray[np.float32]


class Metric(enum.Enum):
    """Whether a larger or a smaller score is a better match."""

    INNER_PRODUCT = "inner_product"  # similarity: higher is better
    L2 = "l2"  # distance: lower is better

    @property
    def higher_is_better(self) -> bool:
        return self is Metric.INNER_PRODUCT

    def sort_key(self, scores: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        """A key whose ascending order is best-first (pure)."""
        return -scores if self.higher_is_better else scores

    def worst(self) -> float:
        return float("-inf") if self.higher_is_better else float("inf")


@dataclass(frozen=True)
class Stage:
    """The top-k of a batch of queries after one stage; arrays are read-only.

    Every row holds exactly k valid ids (a staged search never yields a partial top-k), best
    first. `elapsed_s` is the wall time from the start of `stages()` to the end of this stage.
    """

    ids: IdArray  # [nq, k] row ids in the index
    scores: ScoreArray  # [nq, k] raw metric values, best first
    index: int  # 0-based stage number
    is_last: bool
    elapsed_s: float

    def __post_init__(self) -> None:
        self.ids.setflags(write=False)
        self.scores.setflags(write=False)


class StagedSearch(ABC):
    """A Faiss index searched in stages. Searching never mutates the index.

    Subclasses hold a reference to the caller's index (no copy of its vectors). Adding vectors
    to the index while a `stages()` generator is open is not supported (Faiss itself does not
    allow concurrent add and search); concurrent searches from several threads are fine.
    """

    metric: Metric
    dimension: int

    @property
    @abstractmethod
    def ntotal(self) -> int:
        """Number of vectors currently in the index."""

    @property
    def can_speculate(self) -> bool:
        """True when `stages()` may yield more than one stage."""
        return True

    @abstractmethod
    def stages(self, query_vectors: npt.ArrayLike, k: int) -> Iterator[Stage]:
        """Yield the current top-k after each stage; the last has `is_last=True`.

        `query_vectors` is [nq, dimension] (or one [dimension] vector, treated as nq=1).
        Raises `InputError` for a wrong dimension, k < 1 or k larger than the index.
        """

    def search(self, query_vectors: npt.ArrayLike, k: int) -> Stage:
        """Run every stage and return the last one (equal to the plain Faiss search)."""
        for stage in self.stages(query_vectors, k):
            if stage.is_last:
                return stage
        raise AssertionError("a staged search ended without a last stage")  # pragma: no cover

    def _check(self, query_vectors: npt.ArrayLike, k: int) -> npt.NDArray[np.float32]:
        """Validate the query batch and k; return a C-contiguous float32 [nq, d] copy."""
        x = np.asarray(query_vectors, dtype=np.float32)
        if x.ndim == 1:
            x = x[np.newaxis, :]
        if x.ndim != 2 or x.shape[1] != self.dimension:
            raise InputError(
                f"query vectors have shape {tuple(np.shape(query_vectors))}; "
                f"the index expects [n, {self.dimension}] (dimension {self.dimension})"
            )
        if x.shape[0] == 0:
            raise InputError("no query vectors given")
        if not np.all(np.isfinite(x)):
            raise InputError("query vectors contain NaN or infinite values")
        if not isinstance(k, int | np.integer) or k < 1:
            raise InputError(f"k must be a positive integer, got {k!r}")
        if k > self.ntotal:
            raise InputError(
                f"k={k} is larger than the index ({self.ntotal} vectors)", param="top_k"
            )
        return np.ascontiguousarray(x)


def metric_of(index: object) -> Metric:
    """The `Metric` of a Faiss index (inner product or a distance)."""
    import faiss

    metric_type = getattr(index, "metric_type", faiss.METRIC_L2)
    return Metric.INNER_PRODUCT if metric_type == faiss.METRIC_INNER_PRODUCT else Metric.L2
