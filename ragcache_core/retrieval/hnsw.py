"""Staged HNSW search: the same graph search with a growing candidate budget (efSearch).

Stage i runs Faiss's HNSW search with `efSearch = schedule[i]`; the schedule grows geometrically
and ends at the index's efSearch, so the last stage *is* the plain search with the same
parameters (exact by construction: same call, same parameters).

Reuse of earlier work: none, on purpose. Faiss's HNSW search cannot resume a beam search with a
larger beam, and seeding stage i+1 from stage i's results (`search_level_0` with those entry
points) would make the last stage differ from the plain search. With a doubling schedule the
earlier stages together cost at most about what the last one costs (sum of ef over the stages
< 2 x the final ef), which is the price of speculation on HNSW.

Monotonicity: a larger beam explores at least as much of the graph in practice but HNSW does not
guarantee it, so a later stage's k-th score is usually, not provably, no worse; the tests and
`ragcache search-stats` measure it.

GPU: Faiss has no GPU HNSW; an HNSW index stays on the CPU (the search releases the GIL).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import ConfigError, RAGCacheError
from ragcache_core.retrieval.base import Metric, Stage, StagedSearch, metric_of


def ef_schedule(
    final_ef: int, k: int, *, first_ef: int = 16, growth: float = 2.0
) -> tuple[int, ...]:
    """Geometric efSearch values from max(first_ef, k) up to and ending at final_ef (pure)."""
    if final_ef < 1 or growth <= 1.0:
        raise ConfigError(f"bad HNSW schedule: final ef {final_ef}, growth {growth}")
    efs: list[int] = []
    ef = float(max(first_ef, k))
    while ef < final_ef:
        efs.append(int(ef))
        ef *= growth
    efs.append(final_ef)
    return tuple(efs)


class StagedHNSW(StagedSearch):
    """Staged search over a Faiss `IndexHNSW*` (never mutated; parameters go per call)."""

    def __init__(
        self,
        index: Any,
        *,
        ef_search: int | None = None,
        schedule: Sequence[int] | None = None,
        first_ef: int = 16,
        growth: float = 2.0,
    ) -> None:
        import faiss

        # downcast_index returns a second, non-owning proxy: keep the caller's object alive too.
        hnsw = index if isinstance(index, faiss.IndexHNSW) else faiss.downcast_index(index)
        if not isinstance(hnsw, faiss.IndexHNSW):
            raise ConfigError(f"StagedHNSW needs a faiss IndexHNSW, got {type(index).__name__}")
        self._index: Any = hnsw
        self._owner = index
        self.metric: Metric = metric_of(hnsw)
        self.dimension: int = int(hnsw.d)
        self.ef_search = int(hnsw.hnsw.efSearch if ef_search is None else ef_search)
        if schedule is not None and (
            not schedule or list(schedule) != sorted(schedule) or schedule[-1] != self.ef_search
        ):
            raise ConfigError(f"an ef schedule must increase and end at {self.ef_search}")
        self._schedule = tuple(schedule) if schedule is not None else None
        self._first_ef, self._growth = first_ef, growth

    @property
    def ntotal(self) -> int:
        return int(self._index.ntotal)

    def schedule_for(self, k: int) -> tuple[int, ...]:
        """The efSearch of each stage for top-k."""
        if self._schedule is not None:
            return self._schedule
        return ef_schedule(self.ef_search, k, first_ef=self._first_ef, growth=self._growth)

    def stages(self, query_vectors: npt.ArrayLike, k: int) -> Iterator[Stage]:
        import faiss

        x = self._check(query_vectors, k)
        start_time = time.perf_counter()
        efs = self.schedule_for(k)
        for stage_no, ef in enumerate(efs):
            params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]
            params.efSearch = ef
            dist, ids = self._index.search(x, k, params=params)  # [nq, k] each
            is_last = stage_no == len(efs) - 1
            if np.any(ids < 0):
                if not is_last:
                    continue  # a partial top-k is no use to speculate on
                raise RAGCacheError(
                    f"HNSW search with efSearch={ef} found fewer than k={k} neighbours "
                    "(a disconnected graph?); raise efSearch"
                )
            yield Stage(
                ids=ids,
                scores=dist,
                index=stage_no,
                is_last=is_last,
                elapsed_s=time.perf_counter() - start_time,
            )
