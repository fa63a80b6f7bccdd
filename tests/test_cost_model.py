"""Cost model: bilinear interpolation over a profile grid, extrapolation, JSON format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragcache_core.cost import (
    AnalyticPrefill,
    CostProfile,
    InterpolatedCostModel,
    analytic_profile,
    default_cost_model,
)
from ragcache_core.errors import ConfigError, InputError


def bilinear(a: float, b: float) -> float:
    return 0.01 + 2e-5 * a + 3e-4 * b + 1e-8 * a * b


def profile_of(f: object = bilinear) -> CostProfile:
    alphas, betas = (0, 100, 1000), (10, 50, 500)
    return CostProfile(
        model="m",
        hardware="h",
        cached_tokens=alphas,
        new_tokens=betas,
        prefill_s=tuple(tuple(bilinear(a, b) for b in betas) for a in alphas),
    )


@pytest.mark.parametrize("a,b", [(0, 10), (100, 50), (1000, 500), (37, 12), (640, 333)])
def test_bilinear_interpolation_is_exact_for_bilinear_functions(a: int, b: int) -> None:
    model = InterpolatedCostModel(profile_of())
    assert model.prefill_time(a, b) == pytest.approx(bilinear(a, b), rel=1e-12)


@pytest.mark.parametrize("a,b", [(2000, 500), (1000, 2000), (5000, 4000)])
def test_linear_extrapolation_outside_the_grid(a: int, b: int) -> None:
    # The edge cell's bilinear form continues linearly along each axis.
    model = InterpolatedCostModel(profile_of())
    assert model.prefill_time(a, b) == pytest.approx(bilinear(a, b), rel=1e-12)


# An irregular grid with uneven spacing and values no low-degree formula produces (as a
# measured profile's are): what the interpolator must return is written down by hand.
UNEVEN = CostProfile(
    model="m",
    hardware="h",
    cached_tokens=(0, 64, 1000),
    new_tokens=(16, 128, 512),
    prefill_s=((0.010, 0.050, 0.400), (0.012, 0.030, 0.200), (0.020, 0.090, 0.250)),
)


def test_grid_points_return_the_stored_times() -> None:
    model = InterpolatedCostModel(UNEVEN)
    for i, a in enumerate(UNEVEN.cached_tokens):
        for j, b in enumerate(UNEVEN.new_tokens):
            assert model.prefill_time(a, b) == UNEVEN.prefill_s[i][j]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (32, 16, 0.011),  # midway along alpha on a grid line
        (0, 72, 0.030),  # midway along beta
        (32, 72, (0.010 + 0.050 + 0.012 + 0.030) / 4),  # a cell's centre: its corners' mean
        (532, 320, (0.030 + 0.200 + 0.090 + 0.250) / 4),  # the far cell's centre
        (1468, 512, 0.275),  # beyond the last alpha: the last cell's slope continued
        (0, 896, 0.750),  # beyond the last beta
    ],
)
def test_interpolation_uses_the_cell_around_the_point(a: int, b: int, expected: float) -> None:
    assert InterpolatedCostModel(UNEVEN).prefill_time(a, b) == pytest.approx(expected, rel=1e-12)


def test_extrapolation_is_clamped_at_zero() -> None:
    profile = CostProfile("m", "h", (0, 10), (10, 20), ((0.0, 1.0), (0.0, 1.0)))
    assert InterpolatedCostModel(profile).prefill_time(0, 0) == 0.0


def test_interpolation_between_points_of_a_nonlinear_profile_is_bounded() -> None:
    model = default_cost_model()
    exact = AnalyticPrefill()
    for a, b in [(300, 100), (5000, 2000), (20000, 64)]:
        assert model.prefill_time(a, b) == pytest.approx(exact.prefill_time(a, b), rel=0.15)
    assert model.prefill_time(0, 1024) == pytest.approx(exact.prefill_time(0, 1024))


def test_cost_grows_with_new_and_cached_tokens() -> None:
    model = default_cost_model()
    assert model.prefill_time(0, 200) < model.prefill_time(0, 400)
    assert model.prefill_time(100, 200) < model.prefill_time(4000, 200)
    # Reusing 1,000 cached tokens beats recomputing them.
    assert model.prefill_time(1000, 100) < model.prefill_time(0, 1100) / 4


def test_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    profile = analytic_profile()
    profile.save(path)
    assert CostProfile.load(path) == profile
    data = json.loads(path.read_text())
    assert {"format", "model", "hardware", "cached_tokens", "new_tokens", "prefill_s"} <= set(data)


def test_bad_profiles_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="strictly increasing"):
        CostProfile("m", "h", (0, 0), (1, 2), ((1.0, 1.0), (1.0, 1.0)))
    with pytest.raises(ConfigError, match="grid"):
        CostProfile("m", "h", (0, 1), (1, 2), ((1.0, 1.0),))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "ragcache-cost-profile/1", "model": "m"}')
    with pytest.raises(InputError, match="missing field 'hardware'"):
        CostProfile.load(bad)
    bad.write_text("{nope")
    with pytest.raises(InputError, match="not valid JSON"):
        CostProfile.load(bad)


def test_the_paper_profile_reproduces_the_papers_figures() -> None:
    """`paper-a10g` is built from the paper's figures and gives them back: a 4,000-token
    prefill in 1 s, 11.5x faster with all but its last tokens cached, 3.9x with that prefix
    copied from host memory first; and a forward pass costs at least the weights' read."""
    from ragcache_core.cost.paper import cached_split, paper_a10g, paper_formula

    profile = paper_a10g()
    model = InterpolatedCostModel(profile)
    formula = paper_formula()
    assert model.prefill_time(0, 4000) == pytest.approx(1.0, rel=0.01)
    cached, computed = cached_split(formula)
    assert (cached, computed) == (3753, 247)
    assert 1.0 / formula.prefill_time(cached, computed) == pytest.approx(11.5, rel=0.01)
    with_copy = formula.prefill_time(cached, computed) + profile.copy_cost.seconds(cached)
    assert 1.0 / with_copy == pytest.approx(3.9, rel=1e-6)
    assert profile.kv_bytes_per_token == 512 * 1024
    assert 11e9 < profile.copy_bytes_per_s < 12e9
    assert formula.fixed_s == pytest.approx(13.48e9 / 600e9)  # the weights read once
    assert CostProfile.from_json(profile.to_json()) == profile
