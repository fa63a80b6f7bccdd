"""scripts/adaptive_pgdsf.py: adaptive PGDSF, removed from the package (a losing experiment)
and kept for the policy scripts, which register it as `apgdsf`. Its exact orders on the
contract suite's scenarios (test_policy_contract.py), and theta's adaptation, on the engine's
tree (the host tier)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from _tree_helpers import (
    PREFIX_COST_TOKENS,
    PrefixCost,
    cached_paths,
    doc,
    evicted_in_order,
    make,
    prefix_cost_victim,
    run,
)

from ragcache_core.plan import Tier
from ragcache_core.policy import POLICIES, NodeStats

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "adaptive_pgdsf.py"


@pytest.fixture
def adaptive(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The script's `AdaptivePGDSF`, registered as `apgdsf` for this test only."""
    spec = importlib.util.spec_from_file_location("adaptive_pgdsf", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(POLICIES, "apgdsf", module.AdaptivePGDSF)
    return module.AdaptivePGDSF


def test_without_an_evicted_key_back_it_orders_as_pgdsf(adaptive: Any) -> None:
    """The contract suite's scenarios: theta stays 1, so PGDSF's orders."""
    cache = make(host=30, page=1, policy="apgdsf")
    for name in ["a", "b", "c", "a", "a", "c"]:
        run(cache, doc(name))
    assert evicted_in_order(cache, ["d", "e", "f"]) == ["b", "c", "d"]
    cache = make(host=PREFIX_COST_TOKENS, page=1, policy="apgdsf", cost_model=PrefixCost())
    assert prefix_cost_victim(cache) == "y"


def test_it_weighs_recency_after_a_one_timer_returns(adaptive: Any) -> None:
    """A document evicted after one retrieval that is requested again lowers theta (recency
    was undervalued), one evicted after several raises it; each by the factor 1 + STEP."""
    cache = make(host=20, page=1, policy="apgdsf")
    policy = cache.policy
    assert isinstance(policy, adaptive)
    for name in ["a", "a", "b", "c"]:  # c evicts b (frequency 1, below a's 2)
        run(cache, doc(name))
    assert ("b",) not in cached_paths(cache)
    run(cache, doc("b"))  # b comes back from the ghost list: theta shrinks
    assert policy.theta[Tier.HOST] == pytest.approx(1 / (1 + adaptive.STEP))


def test_it_weighs_frequency_after_a_frequent_document_returns(adaptive: Any) -> None:
    """The hooks alone: a key evicted at frequency 2 that enters again raises theta; a copy
    dropped without eviction (invalidated) leaves no ghost."""
    policy = adaptive()
    frequent = NodeStats(10, 1.0, now=0)
    for now in (1, 2):
        frequent.touch(now, count=True, window=0)
    policy.on_enter(Tier.HOST, "k", frequent)
    policy.on_leave(Tier.HOST, "k", frequent, evicted=True)
    policy.on_enter(Tier.HOST, "k", NodeStats(10, 1.0, now=3))
    assert policy.theta[Tier.HOST] == pytest.approx(1 + adaptive.STEP)
    assert policy.theta[Tier.GPU] == 1.0  # per tier
    policy.on_leave(Tier.HOST, "k", frequent, evicted=False)
    assert not policy.ghosts[Tier.HOST].keys
