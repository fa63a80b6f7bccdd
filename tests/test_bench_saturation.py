"""`ragcache bench serve --saturate SYSTEM` (issue 39's saturated rate): where the ladder of
one system finds its mean TTFT at twice its light-load mean, and which rates every system is
then measured at. The rounds are stubbed here (TTFT as a function of the rate) to isolate
the search; the command itself is refused with one line where it cannot run. The real engine
runs the same code through `bench serve` (docs/benchmarks.md names the runs)."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

import pytest

import ragcache_core.bench.sweep as sweep
from ragcache_core.bench.saturation import SATURATED_OVER, Saturation, saturated_rate
from ragcache_core.bench.serve import Outcome, PointRun
from ragcache_core.bench.sweep import MODES, sweep_workload
from ragcache_core.bench.workloads import Request, Workload


def test_the_rate_is_interpolated_between_the_rungs_around_twice_the_light_mean() -> None:
    ladder = [(1.0, 0.10), (2.0, 0.15), (4.0, 0.35)]
    # 0.20 lies a quarter of the way from 0.15 to 0.35: 2 * 2 ** 0.25 in log-rate.
    assert saturated_rate(ladder, 0.20) == pytest.approx(2 * 2**0.25, abs=1e-3)
    assert saturated_rate(ladder, 0.35) == pytest.approx(4.0)
    assert saturated_rate(ladder, 0.05) == 1.0  # already past it on the first rung
    assert saturated_rate(ladder, 0.50) is None  # never reached


def _run(system: str, rate: float, ttft: float, n: int = 3) -> PointRun:
    outcomes = tuple(Outcome(ttft, ttft + 0.01, (1,), 10, 0) for _ in range(n))
    return PointRun(system, rate, tuple(float(i) for i in range(n)), outcomes, 0)


class _Engines:
    """What `sweep_workload` uses of `Engines`, with nothing started."""

    def __init__(self) -> None:
        self.log = io.StringIO()

    def use(self, source: object, top_k: int) -> None:
        pass


def test_the_ladder_runs_one_system_then_every_system_at_the_rate_and_one_and_a_half_times_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    light = 0.1
    calls: list[tuple[tuple[str, ...], float, int]] = []

    def rounds(
        engines: Any,
        workload: Any,
        mode: Any,
        systems: Any,
        rate: float,
        *rest: Any,
    ) -> dict[str, list[PointRun]]:
        calls.append((tuple(systems), rate, mode.repeats))
        ttft = light * (1 + rate / 2)  # twice the light mean at rate 2
        result = rest[-1]
        result.points.extend(_run(n, rate, ttft).summary() for n in systems)
        return {n: [_run(n, rate, ttft)] * mode.repeats for n in systems}

    monkeypatch.setattr(sweep, "_rounds", rounds)
    monkeypatch.setattr(sweep, "_light", lambda e, n, w, m: _run(n, 0.0, light))
    monkeypatch.setattr(sweep, "_light_summary", lambda run: {"service_s": 1.0})
    workload = Workload("w", "a stub", (), (Request("q"),), 1)
    mode = MODES["full"]
    result = sweep_workload(
        _Engines(),  # type: ignore[arg-type]
        workload,
        None,
        mode,
        ["ragcache", "ragcache-docorder"],
        0,
        lambda label, total: lambda done: None,
        fixed_rate=0.5,
        saturate="ragcache",
    )
    assert result.saturation is not None
    ladder = [c for c in calls if c[0] == ("ragcache",)]
    assert [c[1] for c in ladder] == [0.5, 1.0, 2.0] and {c[2] for c in ladder} == {1}
    assert result.saturation.rate_rps == pytest.approx(2.0)
    measured = [c for c in calls if len(c[0]) == 2]
    assert [c[1] for c in measured] == [2.0, 2.0 * SATURATED_OVER]
    assert {c[2] for c in measured} == {mode.repeats}
    assert result.rates == [2.0, 2.0 * SATURATED_OVER]
    # The ladder's rungs are not points of the result: only the two rates, every system.
    assert {(p["system"], p["rate_rps"]) for p in result.points} == {
        (n, r) for n in ("ragcache", "ragcache-docorder") for r in result.rates
    }
    assert (
        Saturation(**result.to_json()["saturation"])
        .line()
        .startswith("saturated rate of ragcache (mean TTFT 2x its light-load 100 ms): 2.00/s")
    )


def test_a_first_rung_already_past_it_steps_down_the_ladder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calibrated on fast cached requests, the first rate can already be deep in overload:
    the ladder then goes down to a rung below twice the light mean and interpolates."""
    light = 0.1
    rates: list[float] = []

    def rounds(
        engines: Any, workload: Any, mode: Any, systems: Any, rate: float, *rest: Any
    ) -> dict[str, list[PointRun]]:
        rates.append(rate)
        ttft = light * (1 + rate / 2)  # twice the light mean at rate 2
        return {n: [_run(n, rate, ttft)] * mode.repeats for n in systems}

    monkeypatch.setattr(sweep, "_rounds", rounds)
    monkeypatch.setattr(sweep, "_light", lambda e, n, w, m: _run(n, 0.0, light))
    monkeypatch.setattr(sweep, "_light_summary", lambda run: {"service_s": 1.0})
    workload = Workload("w", "a stub", (), (Request("q"),), 1)
    result = sweep_workload(
        _Engines(),  # type: ignore[arg-type]
        workload,
        None,
        MODES["full"],
        ["ragcache"],
        0,
        lambda label, total: lambda done: None,
        fixed_rate=8.0,
        saturate="ragcache",
    )
    assert result.saturation is not None
    assert rates[:4] == [8.0, 4.0, 2.0, 1.0]  # 2.0 reaches the limit exactly: still past
    assert [r for r, _ in result.saturation.ladder] == [1.0, 2.0, 4.0, 8.0]
    assert result.saturation.rate_rps == pytest.approx(2.0)
    assert result.rates == [2.0, 2.0 * SATURATED_OVER]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--quick", "--saturate", "vllm-apc-total", "--systems", "vllm,ragcache"), "not among"),
        (("--smoke", "--saturate", "ragcache"), "--saturate needs a light-load run"),
    ],
)
def test_a_saturation_it_cannot_find_is_refused_in_one_line(
    args: tuple[str, ...], message: str
) -> None:
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_one_systems_answers_are_not_called_identical() -> None:
    from ragcache_core.bench.report import _answers_line

    one = {"rate_rps": 1.0, "repeat": 0, "identical": 5, "requests": 5, "systems": 1}
    assert "not compared" in _answers_line(one) and "5/5" not in _answers_line(one)
    two = one | {"systems": 2, "identical": 4}
    assert _answers_line(two).endswith("4/5")
