"""`bench prefill` and `profile` trust no plan blindly: a RAGCache run whose plan was not
served (rejected, nothing loaded, stores not run) fails the measurement instead of recording
an uncached time as a hit. Fake engines return the connector's reports; no vLLM runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from ragcache_core.engine.cached import PlannedRun, require_plan_ran
from ragcache_core.engine.connector import ConnectorResult
from ragcache_core.errors import RAGCacheError
from ragcache_core.plan import LoadSpan, Plan, StoreSpan, Tier

PAGE = 16
LOAD = Plan(PAGE, load=(LoadSpan(Tier.GPU, (0, 1), 0, 20),))
STORE = Plan(PAGE, store=(StoreSpan((0, 1), 0, 20),))


def _run(result: ConnectorResult) -> PlannedRun:
    return PlannedRun(prompt_len=30, token_ids=(5,), logprobs=(), ttft_s=0.01, connector=result)


def test_require_plan_ran() -> None:
    assert require_plan_ran(_run(ConnectorResult(loaded_tokens=20, gpu_tokens=20)), LOAD) == 0
    assert require_plan_ran(_run(ConnectorResult(loaded_tokens=16, gpu_tokens=16)), LOAD) == 4
    assert require_plan_ran(_run(ConnectorResult(store_scheduled=True, stored=True)), STORE) == 0
    with pytest.raises(RAGCacheError, match="rejected it \\(slot 9 out of range\\)"):
        require_plan_ran(_run(ConnectorResult(rejected=("slot 9 out of range",))), LOAD)
    with pytest.raises(RAGCacheError, match="none of its 20 tokens to load were loaded"):
        require_plan_ran(_run(ConnectorResult()), LOAD)
    with pytest.raises(RAGCacheError, match="load spans \\[0\\] failed"):
        require_plan_ran(_run(ConnectorResult(loaded_tokens=0, failed_load_spans=(0,))), LOAD)
    with pytest.raises(RAGCacheError, match="its stores did not run"):
        require_plan_ran(_run(ConnectorResult(store_scheduled=True)), STORE)


def _fake_engine(serve: Callable[[Plan], ConnectorResult]) -> type:
    """A `CachedEngine` stand-in whose connector answers each plan with `serve(plan)`."""

    class FakeEngine:
        gpu_slots = host_slots = 512

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def run(
            self, prompt: Sequence[int], plan: Plan | None, *args: Any, **kwargs: Any
        ) -> PlannedRun:
            result = ConnectorResult() if plan is None else serve(plan)
            return PlannedRun(len(prompt), (5,), (), 0.01, result)

        def reset_prefix_cache(self) -> None:
            pass

        def close(self, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> FakeEngine:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return FakeEngine


def _served(short_by: int) -> Callable[[Plan], ConnectorResult]:
    def serve(plan: Plan) -> ConnectorResult:
        loaded = max(0, plan.num_loaded_tokens - short_by) if plan.load else 0
        return ConnectorResult(loaded_tokens=loaded, gpu_tokens=loaded, stored=bool(plan.store))

    return serve


def _rejected(plan: Plan) -> ConnectorResult:
    return ConnectorResult(rejected=("the pools' page size is 32",))


def test_bench_prefill_fails_on_an_unserved_plan(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ragcache_core.bench.prefill import measure

    monkeypatch.setattr("ragcache_core.engine.cached.CachedEngine", _fake_engine(_rejected))
    with pytest.raises(RAGCacheError, match="rejected it"):
        measure(str(tiny_model), doc_tokens=(64,), repeats=1)
    monkeypatch.setattr("ragcache_core.engine.cached.CachedEngine", _fake_engine(_served(3)))
    report = measure(str(tiny_model), doc_tokens=(64,), repeats=2)
    assert report["results"][0]["alignment_recomputed_tokens"] == 3


def test_profile_fails_on_an_unserved_plan(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ragcache_core.engine.profiler import profile_prefill

    monkeypatch.setattr("ragcache_core.engine.profiler.CachedEngine", _fake_engine(_rejected))
    with pytest.raises(RAGCacheError, match="rejected it"):
        profile_prefill(str(tiny_model), (0, 32), (16, 32), repeats=1)
    monkeypatch.setattr("ragcache_core.engine.profiler.CachedEngine", _fake_engine(_served(0)))
    profile = profile_prefill(str(tiny_model), (0, 32), (16, 32), repeats=1)
    assert profile.cached_tokens == (0, 32)
