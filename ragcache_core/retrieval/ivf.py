"""Staged IVF search: probe the ranked inverted lists a chunk at a time.

One IVF search is "rank the lists by centroid distance, keep the nprobe best, scan them". Here the
coarse quantizer ranks the lists once; each stage then scans the next chunk of that ranking with
Faiss's `search_preassigned` and merges the chunk's best hits into the running top-k:

    ranked lists of one query:  L7 L2 L9 | L4 L1 | L8 L3 | ... | L5      (nprobe lists)
                                stage 0    stage 1  stage 2       last

No list is scanned twice, so all stages together cost one plain search plus the merges. Stage 0
is widened until every query's scanned lists hold at least k vectors, so every stage yields a full
top-k.

Exactness. The last stage equals `index.search` with the same nprobe: the same quantizer call
(sliced over threads exactly as `IndexIVF::search` slices it) and the same per-list distances.
Membership of a top-k is unique unless scores tie at the k-th place, so each chunk returns k + 1
hits and the merge keeps k + 1: the top-(k + 1) score multiset is exact whatever the tie-breaking.
When the final k + 1 scores of a query contain equal values, that query's ordering depends on
Faiss's heap tie-breaking, so its last stage is recomputed with one `search_preassigned` over all
nprobe lists (identical to what `index.search` runs). Real embeddings rarely tie; duplicates and
all-zero queries do.

GPU. `faiss-gpu`'s classic `GpuIndexIVFFlat` implements `search_preassigned`; the cuVS-backed one
does not, so clone to GPU with `GpuClonerOptions.use_cuvs = False` to stage on a GPU.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import ConfigError, InputError
from ragcache_core.retrieval.base import IdArray, Metric, ScoreArray, Stage, StagedSearch, metric_of


@dataclass(frozen=True)
class ListsPerStage:
    """Each stage scans this many more lists of every query's ranking."""

    lists: int = 4

    def __post_init__(self) -> None:
        if self.lists < 1:
            raise ConfigError(f"lists per stage must be >= 1, got {self.lists}")


@dataclass(frozen=True)
class TargetStageTime:
    """Each stage scans about `seconds` of work, sized by the scan rate measured so far.

    The first stage scans `first_lists` lists (or more, to reach k vectors) to measure the rate.
    """

    seconds: float = 0.001
    first_lists: int = 2

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.first_lists < 1:
            raise ConfigError(
                f"bad target stage time {self.seconds} / first lists {self.first_lists}"
            )


StageSizing = ListsPerStage | TargetStageTime
"""How many lists each stage scans (`sizing=`)."""


class StagedIVF(StagedSearch):
    """Staged search over any Faiss `IndexIVF` (flat, PQ, SQ codes), sharing its lists.

    `nprobe` defaults to the index's own `nprobe` at construction. The index is never mutated.
    """

    def __init__(
        self,
        index: Any,
        *,
        nprobe: int | None = None,
        sizing: StageSizing | None = None,
    ) -> None:
        """`sizing`: how many lists each stage scans (default `ListsPerStage()`)."""
        import faiss

        # downcast_index returns a second, non-owning proxy: keep the caller's object alive too.
        ivf = index if isinstance(index, faiss.IndexIVF) else faiss.downcast_index(index)
        if not isinstance(ivf, faiss.IndexIVF):
            raise ConfigError(f"StagedIVF needs a faiss IndexIVF, got {type(index).__name__}")
        if not ivf.is_trained:
            raise ConfigError("the IVF index is not trained")
        self._ivf: Any = ivf
        self._owner = index
        self.metric: Metric = metric_of(ivf)
        self.dimension: int = int(ivf.d)
        self.nprobe = min(int(ivf.nprobe if nprobe is None else nprobe), int(ivf.nlist))
        if self.nprobe < 1:
            raise ConfigError(f"nprobe must be >= 1, got {nprobe}")
        self.sizing: StageSizing = sizing or ListsPerStage()
        self._sizes: tuple[int, npt.NDArray[np.int64]] | None = None

    @property
    def ntotal(self) -> int:
        return int(self._ivf.ntotal)

    @property
    def index(self) -> object:
        """The Faiss index searched (the caller's object, not a copy)."""
        return self._owner

    def stages(self, query_vectors: npt.ArrayLike, k: int) -> Iterator[Stage]:
        x = self._check(query_vectors, k)
        start_time = time.perf_counter()
        coarse_d, coarse_i = self._rank_lists(x)  # [nq, nprobe] each
        reach = self._vectors_reached(coarse_i)  # [nq, nprobe] cumulative list sizes
        short = np.flatnonzero(reach[:, -1] < k)
        if short.size:
            q = int(short[0])
            raise InputError(
                f"query {q}: the {self.nprobe} lists probed hold only {int(reach[q, -1])} "
                f"vectors, fewer than k={k}; raise nprobe or lower k"
            )
        # Smallest prefix of the ranking that gives every query k candidates.
        min_stop = int(np.max(np.argmax(reach >= k, axis=1))) + 1
        per_rank = np.diff(reach.sum(axis=0), prepend=0)  # [nprobe] vectors per rank, batch total
        best_d = np.empty((x.shape[0], 0), dtype=np.float32)
        best_i = np.empty((x.shape[0], 0), dtype=np.int64)
        start, stage_no, scan_rate = 0, 0, 0.0
        while start < self.nprobe:
            stop = self._next_stop(start, min_stop, per_rank, scan_rate)
            t = time.perf_counter()
            d, i = self._probe(x, coarse_i[:, start:stop], coarse_d[:, start:stop], k + 1)
            scanned = float(per_rank[start:stop].sum())
            if scanned > 0:
                scan_rate = (time.perf_counter() - t) / scanned
            best_d, best_i = _merge(self.metric, best_d, best_i, d, i, k + 1)
            is_last = stop == self.nprobe
            if is_last:
                self._fix_ties(x, coarse_i, coarse_d, best_d, best_i, k)
            yield Stage(
                ids=best_i[:, :k].copy(),
                scores=best_d[:, :k].copy(),
                index=stage_no,
                is_last=is_last,
                elapsed_s=time.perf_counter() - start_time,
            )
            start, stage_no = stop, stage_no + 1

    def _next_stop(
        self, start: int, min_stop: int, per_rank: npt.NDArray[np.int64], scan_rate: float
    ) -> int:
        sizing = self.sizing
        if isinstance(sizing, ListsPerStage):
            stop = start + sizing.lists
        elif start == 0 or scan_rate <= 0:
            stop = start + sizing.first_lists
        else:
            # Enough lists that their vectors take about sizing.seconds at the measured rate.
            wanted = sizing.seconds / scan_rate
            cumulative = np.cumsum(per_rank[start:])
            stop = start + int(np.searchsorted(cumulative, wanted)) + 1
        return min(max(stop, min_stop, start + 1), self.nprobe)

    def _rank_lists(
        self, x: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """Quantizer ranking, sliced like `IndexIVF::search` so float results match it."""
        import faiss

        n = x.shape[0]
        threads = max(1, min(faiss.omp_get_max_threads(), n))
        dist = np.empty((n, self.nprobe), dtype=np.float32)
        lists = np.empty((n, self.nprobe), dtype=np.int64)
        for s in range(threads):
            i0, i1 = n * s // threads, n * (s + 1) // threads
            if i1 > i0:
                dist[i0:i1], lists[i0:i1] = self._ivf.quantizer.search(x[i0:i1], self.nprobe)
        return dist, lists

    def _vectors_reached(self, coarse_i: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        per_list = np.where(coarse_i >= 0, self._list_sizes()[np.maximum(coarse_i, 0)], 0)
        return np.cumsum(per_list, axis=1)  # [nq, nprobe]

    def _list_sizes(self) -> npt.NDArray[np.int64]:
        """Vectors per list, [nlist]; cached while ntotal is unchanged (add/remove change it)."""
        ntotal = int(self._ivf.ntotal)
        cached = self._sizes
        if cached is not None and cached[0] == ntotal:
            return cached[1]
        invlists = self._ivf.invlists
        nlist = int(self._ivf.nlist)
        sizes = np.fromiter((invlists.list_size(j) for j in range(nlist)), np.int64, count=nlist)
        self._sizes = (ntotal, sizes)  # one atomic assignment: safe with concurrent searches
        return sizes

    def _probe(
        self,
        x: npt.NDArray[np.float32],
        lists: npt.NDArray[np.int64],
        list_dist: npt.NDArray[np.float32],
        k: int,
    ) -> tuple[ScoreArray, IdArray]:
        """Scan the given lists of each query (one `search_preassigned`, GIL released)."""
        import faiss

        n, width = lists.shape
        lists = np.ascontiguousarray(lists, dtype=np.int64)
        list_dist = np.ascontiguousarray(list_dist, dtype=np.float32)
        dist = np.empty((n, k), dtype=np.float32)
        ids = np.empty((n, k), dtype=np.int64)
        params = faiss.SearchParametersIVF()
        params.nprobe = width
        # The Python wrapper insists on width == index.nprobe; the C++ call takes it from params.
        self._ivf.search_preassigned_c(
            n,
            faiss.swig_ptr(x),
            k,
            faiss.swig_ptr(lists),
            faiss.swig_ptr(list_dist),
            faiss.swig_ptr(dist),
            faiss.swig_ptr(ids),
            False,
            params,
        )
        return dist, ids

    def _fix_ties(
        self,
        x: npt.NDArray[np.float32],
        coarse_i: npt.NDArray[np.int64],
        coarse_d: npt.NDArray[np.float32],
        best_d: ScoreArray,
        best_i: IdArray,
        k: int,
    ) -> None:
        """Recompute, in place, the rows whose top-(k+1) scores tie (order is Faiss's choice)."""
        valid = best_i >= 0
        equal = (best_d[:, 1:] == best_d[:, :-1]) & valid[:, 1:]
        rows = np.flatnonzero(equal.any(axis=1))
        if rows.size == 0:
            return
        d, i = self._probe(x[rows], coarse_i[rows], coarse_d[rows], k)
        best_d[rows, :k] = d
        best_i[rows, :k] = i


def _merge(
    metric: Metric, d1: ScoreArray, i1: IdArray, d2: ScoreArray, i2: IdArray, keep: int
) -> tuple[ScoreArray, IdArray]:
    """Best `keep` of two partial results per row; absent hits (id -1) sort last (pure)."""
    d = np.concatenate([d1, d2], axis=1)
    i = np.concatenate([i1, i2], axis=1)
    key = np.where(i >= 0, metric.sort_key(d.astype(np.float64)), np.inf)
    order = np.argsort(key, axis=1, kind="stable")[:, :keep]
    return np.take_along_axis(d, order, axis=1), np.take_along_axis(i, order, axis=1)


def default_nlist(n: int) -> int:
    """About 4 x sqrt(N) lists (docs/design.md 2.8), at least 1 and at most N."""
    return max(1, min(n, round(4 * math.sqrt(n))))
