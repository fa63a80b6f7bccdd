"""`bench prefill` and `profile` trust no plan blindly: a RAGCache run whose plan was not
served (rejected, nothing loaded, stores not run) fails the measurement instead of recording
an uncached time as a hit. A fake engine stands in for vLLM + the connector: it keeps which
pool slots hold KV, reports only what a plan really did to them, and times each run by what
it computed, so the reports can be checked against the runs. The last two tests run both
commands on the real engine (tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass
class FakeConnector:
    """The pools' contents and the reports a connector would give.

    A store writes its slots of the GPU pool only when `stores_run` (the real worker's
    stores did not run at max_tokens=1: that is what a fake claiming `stored=True` for every
    store plan hid); a swap-out copies written GPU slots to the host pool; a load reads only
    slots that were written, and only whole blocks of `BLOCK` tokens (vLLM computes the rest).
    A run's TTFT is `COMPUTE_S` per computed token + `LOAD_S[tier]` per token loaded from
    that tier, and `FLOOR_S` for a vLLM prefix-cache hit."""

    stores_run: bool = True
    rejected: tuple[str, ...] = ()
    written: dict[Tier, set[int]] = field(
        default_factory=lambda: {Tier.GPU: set(), Tier.HOST: set()}
    )
    runs: list[tuple[int, Plan | None, bool]] = field(default_factory=list)

    def serve(self, prompt_len: int, plan: Plan | None, floor: bool) -> PlannedRun:
        self.runs.append((prompt_len, plan, floor))
        if plan is None:
            ttft = FLOOR_S if floor and self._seen_before(prompt_len) else prompt_len * COMPUTE_S
            return PlannedRun(prompt_len, (5,), (), ttft, ConnectorResult())
        if self.rejected:
            return PlannedRun(
                prompt_len,
                (5,),
                (),
                prompt_len * COMPUTE_S,
                ConnectorResult(rejected=self.rejected),
            )
        for copy in plan.swap_out:
            if set(copy.src_slots) <= self.written[Tier.GPU]:
                self.written[Tier.HOST] |= set(copy.dst_slots)
        loaded = {Tier.GPU: 0, Tier.HOST: 0}
        for span in plan.load:
            if set(span.slots) <= self.written[span.tier]:
                loaded[span.tier] += span.num_tokens // BLOCK * BLOCK
        if plan.store and self.stores_run:
            for span in plan.store:
                self.written[Tier.GPU] |= set(span.slots)
        total = sum(loaded.values())
        result = ConnectorResult(
            loaded_tokens=total,
            gpu_tokens=loaded[Tier.GPU],
            host_tokens=loaded[Tier.HOST],
            store_scheduled=bool(plan.store),
            stored=bool(plan.store) and self.stores_run,
        )
        ttft = (prompt_len - total) * COMPUTE_S + sum(n * LOAD_S[t] for t, n in loaded.items())
        return PlannedRun(prompt_len, (5,), (), ttft, result)

    def _seen_before(self, prompt_len: int) -> bool:
        """The floor runs: the same document was just put into vLLM's prefix cache."""
        return sum(1 for n, plan, floor in self.runs if floor and n == prompt_len) > 1


BLOCK = 16
COMPUTE_S, FLOOR_S = 1e-3, 1e-4
LOAD_S = {Tier.GPU: 1e-5, Tier.HOST: 3e-5}


def _fake_engine(connector: FakeConnector) -> type:
    """A `CachedEngine` stand-in whose runs `connector` serves."""

    class FakeEngine:
        gpu_slots = host_slots = 512

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def run(
            self,
            prompt: Sequence[int],
            plan: Plan | None,
            *args: Any,
            read_prefix_cache: bool = False,
            **kwargs: Any,
        ) -> PlannedRun:
            return connector.serve(len(prompt), plan, read_prefix_cache)

        def reset_prefix_cache(self) -> None:
            pass

        def close(self, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> FakeEngine:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return FakeEngine


def test_bench_prefill_fails_on_an_unserved_plan(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ragcache_core.bench.prefill import measure

    for broken, message in [
        (FakeConnector(rejected=("the pools' page size is 32",)), "rejected it"),
        (FakeConnector(stores_run=False), "its stores did not run"),
    ]:
        monkeypatch.setattr("ragcache_core.engine.cached.CachedEngine", _fake_engine(broken))
        with pytest.raises(RAGCacheError, match=message):
            measure(str(tiny_model), doc_tokens=(64,), repeats=1)


def test_bench_prefill_reports_what_each_run_measured(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each column is the TTFT of its own kind of run: full prefill computes the whole
    prompt, a GPU or host hit loads the document's whole blocks (70 tokens: 64 loaded, 6
    recomputed) and computes the rest, the floor is vLLM's prefix-cache hit."""
    from ragcache_core.bench.prefill import QUESTION_TOKENS, measure

    connector = FakeConnector()
    monkeypatch.setattr("ragcache_core.engine.cached.CachedEngine", _fake_engine(connector))
    (row,) = measure(str(tiny_model), doc_tokens=(70,), repeats=2)["results"]
    prompt = 70 + QUESTION_TOKENS
    computed = (prompt - 64) * COMPUTE_S
    assert row["full_s"] == pytest.approx(prompt * COMPUTE_S)
    assert row["gpu_hit_s"] == pytest.approx(computed + 64 * LOAD_S[Tier.GPU])
    assert row["host_hit_s"] == pytest.approx(computed + 64 * LOAD_S[Tier.HOST])
    assert row["floor_s"] == pytest.approx(FLOOR_S)
    assert row["alignment_recomputed_tokens"] == 6
    loads = [plan.load[0].tier for _, plan, _ in connector.runs if plan is not None and plan.load]
    assert loads == [Tier.GPU, Tier.GPU, Tier.HOST, Tier.HOST]  # two repeats of each hit


def test_profile_fails_on_an_unserved_plan(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ragcache_core.engine.profiler import profile_prefill

    for broken, message in [
        (FakeConnector(rejected=("the pools' page size is 32",)), "rejected it"),
        (FakeConnector(stores_run=False), "its stores did not run"),
    ]:
        monkeypatch.setattr("ragcache_core.engine.profiler.CachedEngine", _fake_engine(broken))
        with pytest.raises(RAGCacheError, match=message):
            profile_prefill(str(tiny_model), (0, 32), (16, 32), repeats=1)


def test_profile_grid_is_the_time_of_each_cached_and_new_pair(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """T(alpha, beta): alpha tokens loaded from the GPU pool and beta computed, at every
    point of the grid (row alpha, column beta)."""
    from ragcache_core.engine.profiler import profile_prefill

    connector = FakeConnector()
    monkeypatch.setattr("ragcache_core.engine.profiler.CachedEngine", _fake_engine(connector))
    profile = profile_prefill(str(tiny_model), (32, 0), (48, 16), repeats=1)
    assert profile.cached_tokens == (0, 32) and profile.new_tokens == (16, 48)
    expected = [[b * COMPUTE_S + a * LOAD_S[Tier.GPU] for b in (16, 48)] for a in (0, 32)]
    assert [list(row) for row in profile.prefill_s] == [
        [pytest.approx(t) for t in row] for row in expected
    ]


# ---------------------------------------------------------------- the real engine (tiny model)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.vllm
def test_bench_prefill_runs_on_the_real_engine(tiny_model: Path, engine_pool: Any) -> None:
    """`ragcache bench prefill` as documented, on vLLM: its one-token runs store (a
    `max_tokens=1` request finishes in the step that stores it), the hits load every document
    token of whole blocks, and each time is a real TTFT."""
    engine_pool.close()  # one engine at a time
    done = _cli(
        *("bench", "prefill", "--model", str(tiny_model)),
        *("--doc-tokens", "128", "--repeats", "1", "--json"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout)["results"]
    assert result["doc_tokens"] == 128
    assert result["alignment_recomputed_tokens"] == 0  # 128 tokens: whole blocks, all loaded
    assert all(result[k] > 0 for k in ("full_s", "gpu_hit_s", "host_hit_s", "floor_s"))


@pytest.mark.vllm
def test_profile_runs_on_the_real_engine(
    tiny_model: Path, tmp_path: Path, engine_pool: Any
) -> None:
    """`ragcache profile` as documented, on vLLM: a 2 x 2 grid whose cached points stored
    and loaded (the run fails otherwise), written as the cost model reads it."""
    from ragcache_core.cost.profile import CostProfile

    engine_pool.close()  # one engine at a time
    out = tmp_path / "profile.json"
    done = _cli(
        *("profile", "--model", str(tiny_model), "--out", str(out)),
        *("--cached", "0", "128", "--new", "16", "32", "--repeats", "1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads(out.read_text())
    assert (profile["cached_tokens"], profile["new_tokens"]) == ([0, 128], [16, 32])
    assert all(t > 0 for row in profile["prefill_s"] for t in row)
    CostProfile.load(out)  # the cost model accepts it
