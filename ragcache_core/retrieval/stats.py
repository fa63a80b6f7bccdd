"""Search statistics: what speculation can gain from a staged search on a request stream.

For each query (searched alone, as the runtime searches): the duration of every stage, the
top-k after every stage, and from those
- recall of stage i's top-k against the final top-k (a query with fewer stages counts as final),
- the first stage whose top-k already equals the final one (in order, as the prompt uses it; and
  as a set), i.e. the speculation chance: a speculative prefill started there is the one kept,
- the share of the search time spent before that stage completes (the search time it can hide),
- monotonicity violations (a later stage's k-th score worse than an earlier one's),
and over all queries the popularity skew: the share of retrievals that go to the most retrieved
1%, 5% and 10% of the corpus.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ragcache_core.errors import InputError
from ragcache_core.retrieval.base import StagedSearch

SKEW_FRACTIONS = (0.01, 0.05, 0.10)


@dataclass(frozen=True)
class QueryStages:
    """One query's staged search: per-stage durations, top-k ids and k-th scores."""

    stage_times_s: tuple[float, ...]
    stage_ids: tuple[tuple[int, ...], ...]
    kth_scores: tuple[float, ...]

    @property
    def final(self) -> tuple[int, ...]:
        return self.stage_ids[-1]

    def first_final_stage(self, *, as_set: bool = False) -> int:
        """First stage index whose top-k equals the final one (in order, or as a set)."""
        final = self.final
        for i, ids in enumerate(self.stage_ids):
            if (set(ids) == set(final)) if as_set else ids == final:
                return i
        raise AssertionError("the last stage always equals the final")  # pragma: no cover


def record_queries(
    staged: StagedSearch, vectors: npt.NDArray[np.float32], k: int
) -> list[QueryStages]:
    """Search each query vector alone, in stages, and record what each stage returned."""
    out: list[QueryStages] = []
    for row in range(vectors.shape[0]):
        times: list[float] = []
        ids: list[tuple[int, ...]] = []
        kth: list[float] = []
        previous = 0.0
        for stage in staged.stages(vectors[row : row + 1], k):
            times.append(stage.elapsed_s - previous)
            previous = stage.elapsed_s
            ids.append(tuple(int(i) for i in stage.ids[0]))
            kth.append(float(stage.scores[0, -1]))
        out.append(QueryStages(tuple(times), tuple(ids), tuple(kth)))
    return out


@dataclass(frozen=True)
class SearchStats:
    """Summary of `QueryStages` over a request stream (see the module docstring)."""

    queries: int
    k: int
    stages_max: int
    stage_time_mean_s: tuple[float, ...]  # stage i, over the queries that ran a stage i
    total_time_mean_s: float
    total_time_p50_s: float
    total_time_p99_s: float
    recall_at_stage: tuple[float, ...]
    first_final_stage: tuple[int, ...]  # number of queries per first stage equal to final (order)
    first_final_set_stage: tuple[int, ...]  # the same, compared as sets
    final_before_last_share: float  # queries whose final top-k appeared before the last stage
    hideable_time_share: float  # mean share of search time after the final top-k appeared
    monotone_violations: int
    skew: dict[str, float]  # "top_1%" -> share of retrievals, ...
    distinct_docs: int
    corpus_size: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def popularity_skew(
    retrieved: Iterable[Sequence[int | str]],
    corpus_size: int,
    fractions: Sequence[float] = SKEW_FRACTIONS,
) -> dict[str, float]:
    """Share of all retrievals that go to the most retrieved `f * corpus_size` documents (pure)."""
    counts = Counter(doc for ids in retrieved for doc in ids)
    total = sum(counts.values())
    if total == 0 or corpus_size < 1:
        raise InputError("no retrievals to measure skew on")
    ranked = sorted(counts.values(), reverse=True)
    return {
        f"top_{f * 100:g}%": sum(ranked[: max(1, math.ceil(f * corpus_size))]) / total
        for f in fractions
    }


def summarize(
    records: Sequence[QueryStages], k: int, corpus_size: int, *, higher_is_better: bool = True
) -> SearchStats:
    """Aggregate per-query records (pure). Raises `InputError` when there are none."""
    if not records:
        raise InputError("no queries to summarize")
    stages_max = max(len(r.stage_ids) for r in records)
    stage_times = [
        float(np.mean([r.stage_times_s[i] for r in records if len(r.stage_times_s) > i]))
        for i in range(stages_max)
    ]
    totals = np.array([sum(r.stage_times_s) for r in records])
    recall = [
        float(
            np.mean(
                [
                    len(set(r.stage_ids[min(i, len(r.stage_ids) - 1)]) & set(r.final)) / k
                    for r in records
                ]
            )
        )
        for i in range(stages_max)
    ]
    first = Counter(r.first_final_stage() for r in records)
    first_set = Counter(r.first_final_stage(as_set=True) for r in records)
    before_last = sum(r.first_final_stage() < len(r.stage_ids) - 1 for r in records)
    hideable = [
        sum(r.stage_times_s[r.first_final_stage() + 1 :]) / max(sum(r.stage_times_s), 1e-12)
        for r in records
    ]
    violations = 0
    for r in records:
        for a, b in zip(r.kth_scores, r.kth_scores[1:], strict=False):
            violations += (b < a) if higher_is_better else (b > a)
    return SearchStats(
        queries=len(records),
        k=k,
        stages_max=stages_max,
        stage_time_mean_s=tuple(stage_times),
        total_time_mean_s=float(totals.mean()),
        total_time_p50_s=float(np.percentile(totals, 50)),
        total_time_p99_s=float(np.percentile(totals, 99)),
        recall_at_stage=tuple(recall),
        first_final_stage=tuple(first.get(i, 0) for i in range(stages_max)),
        first_final_set_stage=tuple(first_set.get(i, 0) for i in range(stages_max)),
        final_before_last_share=before_last / len(records),
        hideable_time_share=float(np.mean(hideable)),
        monotone_violations=int(violations),
        skew=popularity_skew((r.final for r in records), corpus_size),
        distinct_docs=len({d for r in records for d in r.final}),
        corpus_size=corpus_size,
    )
