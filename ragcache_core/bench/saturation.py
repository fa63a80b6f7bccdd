"""`ragcache bench serve --saturate SYSTEM`: issue 39's saturated rate, the rate at which one
system's mean TTFT reaches `SATURATED_TTFT` x its light-load mean TTFT, found on a ladder of
that system alone (`sweep._find_saturation` runs the ladder; this module holds the rule and
its record)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SATURATED_OVER", "SATURATED_TTFT", "Saturation", "saturated_rate"]

SATURATED_TTFT = 2.0
"""`--saturate`: the saturated rate is where the system's mean TTFT is this multiple of its
light-load mean TTFT (issue 39)."""
SATURATED_OVER = 1.5
"""`--saturate` measures every system at the saturated rate and at this multiple of it."""


@dataclass(frozen=True)
class Saturation:
    """Where one system saturates (`--saturate`): its light-load mean TTFT, the ladder of that
    system alone (rate, mean TTFT), and the rate at which the mean reaches `SATURATED_TTFT` x
    the light-load mean (None when the ladder never got there: the rates then are its last
    rung and `SATURATED_OVER` x it)."""

    system: str
    light_ttft_mean_s: float
    ladder: list[tuple[float, float]]
    rate_rps: float | None

    def line(self) -> str:
        rungs = ", ".join(f"{r:.2f}/s {t * 1000:.0f} ms" for r, t in self.ladder)
        where = (
            f"{self.rate_rps:.2f}/s"
            if self.rate_rps is not None
            else "not reached by the ladder (its last rung is used)"
        )
        return (
            f"saturated rate of {self.system} (mean TTFT {SATURATED_TTFT:g}x its light-load "
            f"{self.light_ttft_mean_s * 1000:.0f} ms): {where}; ladder: {rungs}"
        )


def saturated_rate(ladder: Sequence[tuple[float, float]], limit_s: float) -> float | None:
    """The rate at which the mean TTFT reaches `limit_s`, on a ladder of (rate, mean TTFT) in
    rising rate order: interpolated between the last rung below and the first at or above it,
    linearly in log(rate) (the rungs are geometric); the first rung's rate when it is already
    above; None when no rung reaches it."""
    for i, (rate, ttft) in enumerate(ladder):
        if ttft < limit_s:
            continue
        if i == 0:
            return rate
        low_rate, low_ttft = ladder[i - 1]
        share = (limit_s - low_ttft) / (ttft - low_ttft)
        return round(low_rate * (rate / low_rate) ** share, 3)
    return None
