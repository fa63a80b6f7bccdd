"""`bench prefill` and `profile` trust no plan blindly: a RAGCache run whose plan was not
served (rejected, nothing loaded or found in vLLM's prefix cache, stores not run) fails the
measurement instead of recording an uncached time as a hit (`require_plan_ran`, unit-tested
here). Both commands then run on the real engine (tiny model): `bench prefill` itself fails
when a GPU hit moved a byte or a host hit was served by vLLM's prefix cache."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _runs import EngineRuns

from ragcache_core.engine.cached import PlannedRun, require_plan_ran
from ragcache_core.engine.connector import ConnectorResult
from ragcache_core.errors import RAGCacheError
from ragcache_core.plan import LoadSpan, Plan, StoreSpan, Tier

PAGE = 16
LOAD = Plan(PAGE, load=(LoadSpan(Tier.HOST, (0, 1), 0, 20),))
STORE = Plan(PAGE, store=(StoreSpan(Tier.HOST, (0, 1), 0, 20),))


def _run(result: ConnectorResult, num_cached_tokens: int | None = None) -> PlannedRun:
    cached = result.external_tokens if num_cached_tokens is None else num_cached_tokens
    return PlannedRun(
        prompt_len=30,
        token_ids=(5,),
        logprobs=(),
        ttft_s=0.01,
        connector=result,
        num_cached_tokens=cached,
    )


def test_require_plan_ran() -> None:
    loaded = ConnectorResult(loaded_tokens=20, external_tokens=20, host_tokens=20)
    assert require_plan_ran(_run(loaded), LOAD) == 0
    partial = ConnectorResult(loaded_tokens=16, external_tokens=16, host_tokens=16)
    assert require_plan_ran(_run(partial), LOAD) == 4
    # vLLM's prefix cache (the GPU tier) served 16 tokens, the host pool the other 4.
    tail = ConnectorResult(loaded_tokens=4, external_tokens=4, host_tokens=4, gpu_tokens=16)
    assert require_plan_ran(_run(tail, 20), LOAD) == 0
    # All 20 in vLLM's prefix cache: nothing loaded, still served.
    assert require_plan_ran(_run(ConnectorResult(gpu_tokens=16), 20), LOAD) == 0
    assert require_plan_ran(_run(ConnectorResult(store_scheduled=True, stored=True)), STORE) == 0
    with pytest.raises(RAGCacheError, match="rejected it \\(slot 9 out of range\\)"):
        require_plan_ran(_run(ConnectorResult(rejected=("slot 9 out of range",))), LOAD)
    with pytest.raises(RAGCacheError, match="none of its 20 tokens to load were served"):
        require_plan_ran(_run(ConnectorResult()), LOAD)
    with pytest.raises(RAGCacheError, match="load spans \\[0\\] failed"):
        require_plan_ran(_run(ConnectorResult(loaded_tokens=0, failed_load_spans=(0,))), LOAD)
    with pytest.raises(RAGCacheError, match="its stores did not run"):
        require_plan_ran(_run(ConnectorResult(store_scheduled=True)), STORE)


# ---------------------------------------------------------------- the real engine (tiny model)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", *args], capture_output=True, text=True, timeout=600
    )


def runners(model: Path) -> dict[str, Callable[[Path], Any]]:
    """Both commands run with the suite's other engine runs (`_runs`)."""
    return {
        "test_bench_prefill_runs_on_the_real_engine": lambda out: _cli(
            *("bench", "prefill", "--model", str(model)),
            *("--doc-tokens", "128", "--repeats", "1", "--json"),
        ),
        "test_profile_runs_on_the_real_engine": lambda out: (
            _cli(
                *("profile", "--model", str(model), "--out", str(out / "profile.json")),
                *("--cached", "0", "128", "--new", "16", "32", "--repeats", "1"),
            ),
            out / "profile.json",
        ),
    }


@pytest.mark.vllm
def test_bench_prefill_runs_on_the_real_engine(
    request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    """`ragcache bench prefill` as documented, on vLLM: its one-token runs store (a
    `max_tokens=1` request finishes in the step that stores it), a GPU hit moves no byte and a
    host hit loads every document token (the command fails otherwise), and each time is a
    real TTFT."""
    done = engine_runs.result(request)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)["results"]
    assert result["doc_tokens"] == 128
    assert result["alignment_recomputed_tokens"] == 0  # 128 tokens: whole blocks, all loaded
    assert all(result[k] > 0 for k in ("full_s", "gpu_hit_s", "host_hit_s", "floor_s"))


@pytest.mark.vllm
def test_profile_runs_on_the_real_engine(
    request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    """`ragcache profile` as documented, on vLLM: a 2 x 2 grid whose cached points stored
    and loaded (the run fails otherwise), written as the cost model reads it."""
    from ragcache_core.cost.profile import CostProfile

    done, out = engine_runs.result(request)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads(out.read_text())
    assert (profile["cached_tokens"], profile["new_tokens"]) == ([0, 128], [16, 32])
    assert all(t > 0 for row in profile["prefill_s"] for t in row)
    CostProfile.load(out)  # the cost model accepts it
