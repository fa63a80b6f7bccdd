"""The engine's step costs (`engine/connector/step_costs.py`): buckets, quantiles, totals since
a snapshot, the JSON form, and what `stats()` shows."""

from __future__ import annotations

import pytest

from ragcache_core.engine.connector.step_costs import (
    BUCKET_RATIO,
    NO_STEPS,
    StepCosts,
    bucket_edge,
    bucket_of,
)


@pytest.mark.parametrize("seconds", [1e-5, 1e-4, 1.1e-4, 0.003, 0.25, 7.0])
def test_a_duration_falls_in_the_bucket_whose_edges_hold_it(seconds: float) -> None:
    bucket = bucket_of(seconds)
    assert seconds <= bucket_edge(bucket) * (1 + 1e-9)
    if bucket:
        assert seconds > bucket_edge(bucket - 1)


def test_quantiles_are_within_a_bucket_of_the_true_ones() -> None:
    costs = NO_STEPS
    times = [0.010] * 98 + [0.100, 2.0]  # p50 10 ms, p99 100 ms, one outlier
    for t in times:
        costs = costs.add_step(t, {})
    assert costs.steps == 100 and costs.step_s == pytest.approx(sum(times))
    assert 0.010 <= costs.quantile_s(0.5) < 0.010 * BUCKET_RATIO
    assert 0.100 <= costs.quantile_s(0.99) < 0.100 * BUCKET_RATIO
    assert costs.quantile_s(1.0) >= 2.0
    assert NO_STEPS.quantile_s(0.99) == 0.0


def test_copies_add_up_by_kind_and_a_snapshot_subtracts() -> None:
    first = NO_STEPS.add_step(0.02, {"handout": (0.005, 1000), "load": (0.001, 10)})
    later = first.add_step(0.03, {"handout": (0.004, 500)}).add_step(0.01, {})
    assert later.copy_s["handout"] == pytest.approx(0.009)
    assert later.copy_bytes == {"handout": 1500, "load": 10}
    assert later.copy_steps == {"handout": 2, "load": 1}
    since = later.since(first)
    assert since.steps == 2 and since.copy_bytes == {"handout": 500, "load": 0}
    assert since.copy_steps == {"handout": 1, "load": 0}
    assert sum(since.histogram.values()) == 2
    # A restarted engine's totals start again at 0: taken whole, not subtracted.
    restarted = NO_STEPS.add_step(0.5, {})
    assert restarted.since(later) == restarted


def test_the_summary_gives_milliseconds_and_shares_of_the_steps_time() -> None:
    costs = NO_STEPS.add_step(0.040, {"handout": (0.010, 4096)}).add_step(0.060, {})
    summary = costs.summary()
    assert summary["steps"] == 2 and summary["step_mean_ms"] == pytest.approx(50.0)
    assert summary["handout_copy_share"] == pytest.approx(0.1)
    assert summary["handout_copy_bytes"] == 4096 and summary["handout_copy_steps"] == 1
    assert summary["store_copy_s"] == 0.0 and summary["store_copy_share"] == 0.0
    assert summary["step_p99_ms"] >= 60.0


def test_the_json_form_round_trips() -> None:
    costs = NO_STEPS.add_step(0.02, {"store": (0.001, 64)}).add_step(0.2, {})
    assert StepCosts.from_json(costs.to_json()) == costs
    assert costs.slower(NO_STEPS) is costs and NO_STEPS.slower(costs) is costs
