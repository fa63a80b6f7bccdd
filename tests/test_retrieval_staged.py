"""Staged Faiss searches: the last stage equals the plain search, stages are monotone and full."""

from __future__ import annotations

import itertools

import faiss
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragcache_core.errors import ConfigError, InputError
from ragcache_core.retrieval import (
    ListsPerStage,
    MatrixFlat,
    SingleStage,
    StagedHNSW,
    StagedIVF,
    TargetStageTime,
    staged_search_for,
)
from ragcache_core.retrieval.base import Metric
from ragcache_core.retrieval.hnsw import ef_schedule

DIM = 24
METRICS = [faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2]


def _vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    faiss.normalize_L2(x)
    return x


@pytest.fixture(scope="module")
def base() -> np.ndarray:
    xb = _vectors(3000, 0)
    xb[101] = xb[100]  # exact duplicates: ties that a naive merge would order differently
    xb[200:206] = xb[300]
    return xb


def _ivf(xb: np.ndarray, metric: int, nlist: int = 48, nprobe: int = 10) -> faiss.IndexIVFFlat:
    quantizer = faiss.IndexFlat(DIM, metric)
    index = faiss.IndexIVFFlat(quantizer, DIM, nlist, metric)
    index.cp.min_points_per_centroid = 1
    index.train(xb)
    index.add(xb)
    index.nprobe = nprobe
    return index


def _queries(xb: np.ndarray, n: int, seed: int) -> np.ndarray:
    q = _vectors(n, seed)
    if n >= 3:
        q[0] = xb[100]  # hits the duplicated pair
        q[1] = 0.0  # every score ties
        q[2] = xb[300]
    return q


def _metric(faiss_metric: int) -> Metric:
    return Metric.INNER_PRODUCT if faiss_metric == faiss.METRIC_INNER_PRODUCT else Metric.L2


def _assert_monotone(stages: list, metric: Metric) -> None:
    for earlier, later in itertools.pairwise(stages):
        if metric.higher_is_better:
            assert np.all(later.scores[:, -1] >= earlier.scores[:, -1])
        else:
            assert np.all(later.scores[:, -1] <= earlier.scores[:, -1])


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("nq", [1, 3, 20, 57])
@pytest.mark.parametrize("plan", [ListsPerStage(1), ListsPerStage(3), TargetStageTime(2e-6)])
def test_ivf_last_stage_equals_plain_search(base, metric, nq, plan) -> None:
    index = _ivf(base, metric)
    queries = _queries(base, nq, seed=nq)
    for k in (1, 4, 10):
        expected_d, expected_i = index.search(queries, k)
        stages = list(StagedIVF(index, sizing=plan).stages(queries, k))
        assert [s.is_last for s in stages] == [False] * (len(stages) - 1) + [True]
        assert [s.index for s in stages] == list(range(len(stages)))
        np.testing.assert_array_equal(stages[-1].ids, expected_i)
        np.testing.assert_array_equal(stages[-1].scores, expected_d)
        _assert_monotone(stages, _metric(metric))
        for s in stages:  # every stage is a full top-k of distinct valid rows
            assert s.ids.shape == (nq, k) and np.all(s.ids >= 0)
            assert all(len(set(row)) == k for row in s.ids.tolist())


def test_ivf_stages_scan_chunks_and_speculation_sees_early_results(base) -> None:
    index = _ivf(base, faiss.METRIC_INNER_PRODUCT, nprobe=12)
    stages = list(StagedIVF(index, sizing=ListsPerStage(3)).stages(base[:5], 1))
    # A stored vector is its own best match: its list is ranked first, so stage 0 already has it.
    assert len(stages) == 4
    np.testing.assert_array_equal(stages[0].ids[:, 0], np.arange(5))
    assert all(b.elapsed_s >= a.elapsed_s for a, b in itertools.pairwise(stages))


def test_ivf_explicit_nprobe_equals_search_with_that_nprobe(base) -> None:
    index = _ivf(base, faiss.METRIC_L2, nprobe=3)
    queries = _queries(base, 9, seed=5)
    params = faiss.SearchParametersIVF(nprobe=20)
    _expected_d, expected_i = index.search(queries, 5, params=params)
    last = StagedIVF(index, nprobe=20).search(queries, 5)
    np.testing.assert_array_equal(last.ids, expected_i)
    assert index.nprobe == 3  # the caller's index is never mutated


@settings(max_examples=25, deadline=None)
@given(
    nlist=st.integers(4, 40),
    nprobe=st.integers(1, 40),
    per_stage=st.integers(1, 7),
    k=st.integers(1, 12),
    nq=st.integers(1, 30),
    seed=st.integers(0, 10_000),
)
def test_ivf_exactness_property(nlist, nprobe, per_stage, k, nq, seed) -> None:
    xb = _vectors(600, seed)
    xb[10:14] = xb[20]
    index = _ivf(xb, faiss.METRIC_INNER_PRODUCT, nlist=nlist, nprobe=min(nprobe, nlist))
    queries = np.concatenate([_vectors(nq, seed + 1), xb[20:21]])
    _, expected_i = index.search(queries, k)
    staged = StagedIVF(index, sizing=ListsPerStage(per_stage))
    reach = staged._vectors_reached(index.quantizer.search(queries, staged.nprobe)[1])
    if np.any(reach[:, -1] < k):
        with pytest.raises(InputError, match="fewer than k"):
            staged.search(queries, k)
        return
    np.testing.assert_array_equal(staged.search(queries, k).ids, expected_i)


@pytest.mark.parametrize("metric", METRICS)
def test_hnsw_last_stage_equals_plain_search_and_is_monotone(base, metric) -> None:
    index = faiss.IndexHNSWFlat(DIM, 16, metric)
    index.hnsw.efConstruction = 40
    index.add(base)
    index.hnsw.efSearch = 96
    queries = _queries(base, 200, seed=7)
    expected_d, expected_i = index.search(queries, 5)
    staged = StagedHNSW(index)
    stages = list(staged.stages(queries, 5))
    assert [s.index for s in stages] == list(range(len(staged.schedule_for(5))))
    assert len(stages) == 4  # ef 16, 32, 64, 96
    np.testing.assert_array_equal(stages[-1].ids, expected_i)
    np.testing.assert_array_equal(stages[-1].scores, expected_d)
    _assert_monotone(stages, _metric(metric))
    assert index.hnsw.efSearch == 96


def test_ef_schedule() -> None:
    assert ef_schedule(128, 2) == (16, 32, 64, 128)
    assert ef_schedule(100, 40) == (40, 80, 100)
    assert ef_schedule(16, 20) == (16,)
    with pytest.raises(ConfigError):
        ef_schedule(64, 2, growth=1.0)


def test_flat_is_one_exact_stage(base) -> None:
    index = faiss.IndexFlatIP(DIM)
    index.add(base)
    queries = _queries(base, 4, seed=3)
    stages = list(staged_search_for(index).stages(queries, 3))
    assert len(stages) == 1 and stages[0].is_last
    np.testing.assert_array_equal(stages[0].ids, index.search(queries, 3)[1])
    assert not SingleStage(index).can_speculate


def test_staged_search_for_picks_by_index_type(base) -> None:
    hnsw = faiss.IndexHNSWFlat(DIM, 8)
    assert isinstance(staged_search_for(_ivf(base, faiss.METRIC_L2)), StagedIVF)
    assert isinstance(staged_search_for(hnsw), StagedHNSW)
    assert isinstance(staged_search_for(faiss.IndexIDMap(faiss.IndexFlatL2(DIM))), SingleStage)


def test_matrix_flat_matches_exact_cosine() -> None:
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((50, 6)) * rng.uniform(0.1, 5, size=(50, 1))  # unnormalized
    query = rng.standard_normal(6)
    cos = matrix @ query / (np.linalg.norm(matrix, axis=1) * np.linalg.norm(query))
    stage = MatrixFlat(matrix).search(query, 4)
    np.testing.assert_array_equal(stage.ids[0], np.argsort(-cos)[:4])


def test_bad_queries_are_input_errors(base) -> None:
    index = _ivf(base, faiss.METRIC_INNER_PRODUCT)
    staged = StagedIVF(index)
    with pytest.raises(InputError, match=r"dimension 24"):
        staged.search(np.zeros((2, DIM + 1), dtype=np.float32), 3)
    with pytest.raises(InputError, match="larger than the index"):
        staged.search(base[:1], len(base) + 1)
    with pytest.raises(InputError, match="positive integer"):
        staged.search(base[:1], 0)
    with pytest.raises(InputError, match="NaN"):
        staged.search(np.full((1, DIM), np.nan, dtype=np.float32), 1)
    with pytest.raises(InputError, match="fewer than k"):
        StagedIVF(index, nprobe=1).search(base[:1], 2000)
    with pytest.raises(ConfigError):
        StagedIVF(faiss.IndexFlatL2(DIM))
    with pytest.raises(InputError, match="dimension"):
        MatrixFlat(np.ones((3, 4))).search(np.ones(5), 1)
