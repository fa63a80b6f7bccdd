"""Cost model: estimated prefill time T(alpha, beta) of one request.

alpha = tokens of the request that are cached (system prompt included), beta = tokens it
computes (uncached documents and the question). PGDSF uses T to value a node (docs/design.md 2.3);
the simulator and the reordering queue use it as the service time.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Protocol

from ragcache_core.cost.profile import CostProfile


class CostModel(Protocol):
    """Anything that estimates prefill time in seconds. Must be pure (no side effects)."""

    def prefill_time(self, cached_tokens: int, new_tokens: int) -> float: ...


def _cell(axis: tuple[int, ...], x: float) -> tuple[int, float]:
    """Index i of the grid cell [axis[i], axis[i+1]] used for x, and x's fraction in it.

    Outside the grid the edge cell is used, so the fraction is < 0 or > 1: linear
    extrapolation along the edge cell's slope.
    """
    i = bisect_right(axis, x) - 1
    i = min(max(i, 0), len(axis) - 2)
    lo, hi = axis[i], axis[i + 1]
    return i, (x - lo) / (hi - lo)


class InterpolatedCostModel:
    """Bilinear interpolation over a `CostProfile` grid (paper Algorithm 1).

    Inside the grid: exact bilinear interpolation of the four surrounding points. Outside:
    linear extrapolation from the nearest edge cell, clamped at 0 s (a profile cannot predict
    a negative time).
    """

    __slots__ = ("profile",)

    def __init__(self, profile: CostProfile) -> None:
        self.profile = profile

    def prefill_time(self, cached_tokens: int, new_tokens: int) -> float:
        p = self.profile
        i, ta = _cell(p.cached_tokens, cached_tokens)
        j, tb = _cell(p.new_tokens, new_tokens)
        grid = p.prefill_s
        # Interpolate along alpha on the two beta grid lines, then along beta.
        t_lo = grid[i][j] + ta * (grid[i + 1][j] - grid[i][j])
        t_hi = grid[i][j + 1] + ta * (grid[i + 1][j + 1] - grid[i][j + 1])
        return max(0.0, t_lo + tb * (t_hi - t_lo))
