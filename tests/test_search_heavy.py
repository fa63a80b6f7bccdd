"""The search-heavy workload: the padded knowledge base (synthetic rows dropped and counted, the
last stage equal to Faiss's own search, exact search, the cache folder), the core split, the
statistics of the ablation, and its smoke run on the real engines (tiny model): speculation is
started and adopted or aborted, answers equal the non-speculative run's, and the dropped
synthetic hits are counted as an independent search counts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _runs import EngineRuns

from ragcache_core.bench.cores import BIND_ENV, CoreSplit
from ragcache_core.bench.search_heavy import (
    HEAVY_MODES,
    exact_answers,
    index_home,
    load_heavy_workload,
)
from ragcache_core.bench.search_heavy_report import compare_key, search_stats
from ragcache_core.bench.workloads import Request
from ragcache_core.config import CacheConfig
from ragcache_core.errors import ConfigError, InputError
from ragcache_core.retrieval.embedder import EmbedderConfig
from ragcache_core.retrieval.padded import GaussianModel, PaddedIndex, PaddedSettings, SearchRecord
from ragcache_core.runtime.speculation import SearchClock
from ragcache_core.search import final_result

SMALL = PaddedSettings(
    vectors=4_000, nlist=16, train_points=1_024, embedder=EmbedderConfig(dimension=16)
)


def _words(text: str) -> int:
    return len(text.split())


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> PaddedIndex:
    workload = load_heavy_workload(HEAVY_MODES["smoke"], _words, 0, None)
    kb, built = PaddedIndex.cached(workload.documents, SMALL, tmp_path_factory.mktemp("kb"))
    assert built
    return kb


def _questions(n: int = 40) -> list[str]:
    workload = load_heavy_workload(HEAVY_MODES["smoke"], _words, 0, None)
    return [r.question for r in workload.stream(n)]


def test_synthetic_rows_are_dropped_from_every_stage_and_counted(small: PaddedIndex) -> None:
    source = small.source(1.0, 4)
    dropped = 0
    for question in _questions():
        query = small.embedder.embed_query(question).reshape(1, -1)
        params = small.faiss_index.nprobe
        small.faiss_index.nprobe = small.nlist
        _, rows = small.faiss_index.search(query, 2)  # Faiss's own search, every list
        small.faiss_index.nprobe = params
        stages = list(source.search_stages(question, 2))
        expected = [int(r) for r in rows[0] if r < small.n_real]
        assert [d.id for d in stages[-1].documents] == [small.documents[r].id for r in expected]
        for stage in stages:  # no stage shows a synthetic row
            assert len(stage.documents) == len(stage.scores) <= 2
        dropped += 2 - len(expected)
    records = source.log.take()
    assert len(records) == len(_questions()) and source.log.take() == []
    assert sum(r.dropped for r in records) == dropped > 0  # 16 dimensions: padding competes
    assert all(len(r.stage_s) == len(r.stage_rows) == 4 for r in records)


def test_exact_search_regenerates_the_rows_the_index_holds(small: PaddedIndex) -> None:
    questions = _questions(20)
    queries = small.embedder.embed(questions)
    scores, rows = small.exact_topk(queries, 3)
    every = np.concatenate([block for _, block in small.vectors()])  # [ntotal, d]
    assert every.shape == (small.ntotal, small.embedder.dimension)
    brute = queries @ every.T
    assert np.array_equal(rows, np.argsort(-brute, axis=1, kind="stable")[:, :3])
    assert np.allclose(scores, np.take_along_axis(brute, rows, axis=1))
    # The float16 codes of the index are those vectors: probing every list finds them.
    exact = exact_answers(small, [Request(q) for q in questions], 3)
    source = small.source(1.0, 2)
    for q in questions:
        final_result(source, q, 3)
    stats = search_stats(source.log.take(), exact, 3)
    assert stats["recall_vs_exact"] >= 0.95 and stats["recall_questions"] == len(set(questions))


def test_the_index_is_cached_by_its_settings_and_documents(
    small: PaddedIndex, tmp_path: Path
) -> None:
    docs = small.documents
    first, built = PaddedIndex.cached(docs, SMALL, tmp_path)
    again, built_again = PaddedIndex.cached(docs, SMALL, tmp_path)
    assert built and not built_again
    q = first.embedder.embed(_questions(5))
    assert np.array_equal(first.faiss_index.search(q, 2)[1], again.faiss_index.search(q, 2)[1])
    _, built_other = PaddedIndex.cached(docs, replace(SMALL, seed=1), tmp_path)
    assert built_other and len(list(tmp_path.glob("padded-*"))) == 2
    folder = next(tmp_path.glob("padded-*"))
    with pytest.raises(InputError, match="other documents"):
        PaddedIndex.load(folder, docs[:-1])


def test_synthetic_rows_follow_the_real_embeddings_distribution() -> None:
    rng = np.random.default_rng(3)
    real = rng.standard_normal((5000, 8)) @ np.diag([3, 2, 1, 1, 0.5, 0.5, 0.2, 0.1]) + 0.5
    real /= np.linalg.norm(real, axis=1, keepdims=True)
    model = GaussianModel.fit(real.astype(np.float32))
    block = model.block(0, 0, 20_000)
    assert np.allclose(np.linalg.norm(block, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(block, model.block(0, 0, 20_000))  # regenerated, not stored
    assert np.abs(block.mean(axis=0) - real.mean(axis=0)).max() < 0.05


def test_the_speculation_gate_follows_each_sources_recent_searches() -> None:
    class Source:
        can_speculate = True

    class Slotted:
        __slots__ = ("can_speculate",)

    clock, a, b = SearchClock(), Source(), Source()
    assert clock.mean_s(a) is None and clock.slow_enough(a, 0.1)  # not measured: speculate
    clock.observe(a, 0.5)
    clock.observe(b, 0.01)
    assert clock.mean_s(a) == 0.5 and clock.slow_enough(a, 0.1)
    assert not clock.slow_enough(b, 0.1) and clock.slow_enough(b, 0.0)  # 0: always
    for _ in range(20):  # the mean follows the recent searches
        clock.observe(a, 0.02)
    assert clock.mean_s(a) == pytest.approx(0.02, abs=0.01) and not clock.slow_enough(a, 0.1)
    shared = Slotted()  # not weakly referenceable: measured together with its kind
    clock.observe(shared, 0.3)
    assert clock.mean_s(Slotted()) == 0.3
    with pytest.raises(ConfigError, match="speculation_min_search_s"):
        CacheConfig(speculation_min_search_s=-1)
    with pytest.raises(ConfigError, match="speculation_min_search_s"):
        CacheConfig(speculation_min_search_s=float("nan"))


def _record(rows: list[tuple[int, ...]], question: str = "q") -> SearchRecord:
    return SearchRecord(question, 0.001, tuple(0.01 for _ in rows), tuple(rows), n_real=100)


def test_search_stats_name_when_the_final_documents_appeared() -> None:
    records = [
        _record([(1, 2), (1, 2), (1, 2)]),  # final from stage 0
        _record([(3, 4), (1, 2), (1, 2)], "r"),  # final from stage 1
        _record([(1, 500), (1, 7), (1, 600)], "s"),  # synthetic 600 dropped: (1,) from stage 2
    ]
    stats = search_stats(records, {"q": (1, 2), "r": (1, 9)}, 2)
    assert [r.last_change for r in records] == [0, 1, 2]
    assert stats["final_at_stage"] == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert stats["stage0_is_final"] == pytest.approx(1 / 3)
    assert stats["synthetic_in_topk_slots"] == 1
    assert stats["synthetic_slot_rate"] == pytest.approx(1 / 6)
    assert stats["recall_vs_exact"] == pytest.approx(0.75) and stats["recall_questions"] == 2
    assert stats["hideable_mean_s"] == pytest.approx((0.02 + 0.01 + 0.0) / 3)


def test_ablation_claims_need_apart_spreads() -> None:
    def point(system: str, ttft: float) -> dict[str, object]:
        return {"system": system, "rate_rps": 0.0, "ttft_mean_s": ttft}

    apart = [point("ragcache", 0.2), point("ragcache", 0.21), point("ragcache-nospec", 0.3)]
    apart.append(point("ragcache-nospec", 0.32))
    c = compare_key(apart, "ttft_mean_s")
    assert c is not None and c["spreads_apart"] and c["ratio_nospec_over_spec"] > 1.4
    overlap = [*apart, point("ragcache", 0.31)]
    c = compare_key(overlap, "ttft_mean_s")
    assert c is not None and not c["spreads_apart"]
    single = [point("ragcache", 0.2), point("ragcache-nospec", 0.3)]
    c = compare_key(single, "ttft_mean_s")
    assert c is not None and not c["spreads_apart"]  # one round has no spread


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity")
def test_core_split_pins_the_search_thread_and_sets_vllms_binding() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: no split")
    split = CoreSplit.halves()
    assert split is not None and not split.search_cpus & split.engine_cpus
    before = os.environ.get(BIND_ENV)
    with split.engine_environment():
        assert os.environ[BIND_ENV] == ",".join(str(c) for c in sorted(split.engine_cpus))
    assert os.environ.get(BIND_ENV) == before
    seen: list[set[int]] = []
    thread = threading.Thread(
        target=lambda: (split.pin_search_thread(), seen.append(os.sched_getaffinity(0)))
    )
    thread.start()
    thread.join()
    assert seen == [set(split.search_cpus)]
    assert sorted(os.sched_getaffinity(0)) == cpus  # only that thread moved


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--workloads", "search-heavy,short"), "runs alone"),
        (("--workloads", "search-heavy", "--search-ratios", "0,1"), "--search-ratios"),
        (("--workloads", "search-heavy", "--search-stages", "1"), "--search-stages"),
        (("--workloads", "search-heavy", "--systems", "vllm,ragcache"), "compares ragcache"),
    ],
)
def test_bad_search_heavy_arguments_are_one_line_exit_2(
    args: tuple[str, ...], message: str
) -> None:
    result = _cli("--smoke", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def _smoke(model: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    result = _cli(
        "--smoke",
        "--workloads",
        "search-heavy",
        "--model",
        str(model),
        "--out",
        str(out),
        "--json",
    )
    return result, out


def runners(model: Path) -> dict[str, Callable[[Path], Any]]:
    """The smoke run, with the suite's other engine runs (`_runs`)."""
    return {
        "test_smoke_speculates_answers_as_without_and_counts_dropped_hits": lambda out: _smoke(
            model, out
        )
    }


@pytest.mark.vllm
def test_smoke_speculates_answers_as_without_and_counts_dropped_hits(
    request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    result, tmp_path = engine_runs.result(request)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert document == json.loads((tmp_path / "serve.json").read_text())
    heavy = HEAVY_MODES["smoke"]
    kb = document["knowledge_base"]
    assert kb["vectors"] == heavy.index.vectors and kb["synthetic"] == kb["vectors"] - kb["real"]
    assert [r["ratio"] for r in document["ratios"]] == sorted(heavy.ratios)
    # An independent count of the synthetic rows in each question's final top-k.
    workload = load_heavy_workload(heavy, _words, 0, None)
    index, built = PaddedIndex.cached(workload.documents, heavy.index, index_home())
    assert not built  # the run cached it
    drops = adopted = 0
    for ratio in document["ratios"]:
        staged = index.staged(ratio["ratio"], heavy.stages)
        for part, n in (("light", heavy.light), ("loaded", heavy.requests)):
            stream = workload.stream(heavy.warmup + n)
            dropped = []
            for r in stream:
                rows = staged.search(index.embedder.embed_query(r.question), 2).ids[0]
                dropped.append(int(sum(int(x) >= index.n_real for x in rows)))
            for point in ratio[part]["points"]:
                assert point["search"]["searches"] == len(stream)
                assert point["search"]["synthetic_in_topk_slots"] == sum(dropped)
                measured = dropped[heavy.warmup :]
                assert point["prompt_docs_mean"] == pytest.approx(2 - sum(measured) / len(measured))
                drops += sum(dropped)
                counters = point["counters_with_warmup"]
                if point["system"] == "ragcache":
                    started = counters["speculation_started"]
                    assert started > 0
                    assert counters["speculation_used"] + counters["speculation_aborted"] == started
                    adopted += counters["speculation_used"]
                else:
                    assert counters["speculation_started"] == 0
                    assert point["speculative_answers"] == 0
                    assert point["non_overlapped_search_mean_s"] == pytest.approx(
                        point["search_mean_s"]
                    )
            for answers in ratio[part]["answers"]:
                assert answers["identical"] == answers["requests"] == len(stream)
    assert drops > 0 and adopted > 0
