"""95% confidence intervals of per-question figures (`ragcache bench quality`).

- A share (every value 0 or 1: exact match, contains, recall, agreement): the Wilson score
  interval, which stays inside [0, 1] and keeps a width at 0% and 100% (a bootstrap of 300
  identical answers would say [100%, 100%]).
- A mean of values in between (F1): the percentile bootstrap, questions resampled with
  replacement (`BOOTSTRAP_RESAMPLES`, seeded).
- A difference between two systems on the same questions: the paired bootstrap, the same
  resampled questions for both (the 2.5th and 97.5th percentiles of the mean difference).

Pure functions of their inputs and seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

Z95 = 1.959963984540054
"""The standard normal's 97.5th percentile."""
BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class Interval:
    """A figure and its 95% confidence interval, `low <= value <= high` (a bootstrap
    interval of a skewed mean may sit off-centre)."""

    value: float
    low: float
    high: float
    method: str
    """"wilson", "bootstrap" or "paired-bootstrap"."""

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_json(self) -> dict[str, Any]:
        return {"value": self.value, "ci95": [self.low, self.high], "method": self.method}


def _array(values: Sequence[float]) -> npt.NDArray[np.float64]:
    array = np.asarray(values, dtype=np.float64)  # [n]
    if array.ndim != 1 or array.size == 0:
        raise ValueError("an interval needs at least one value")
    return array


def wilson(values: Sequence[float]) -> Interval:
    """The Wilson score interval of the share of ones among 0/1 `values`."""
    array = _array(values)
    if not np.isin(array, (0.0, 1.0)).all():
        raise ValueError("the Wilson interval is for 0/1 values")
    n = array.size
    share = float(array.mean())
    centre = (share + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    spread = Z95 * math.sqrt(share * (1 - share) / n + Z95**2 / (4 * n**2)) / (1 + Z95**2 / n)
    # At 0% (100%) the low (high) end is exactly 0 (1); say so rather than round near it.
    low = 0.0 if share == 0.0 else max(0.0, centre - spread)
    high = 1.0 if share == 1.0 else min(1.0, centre + spread)
    return Interval(share, low, high, "wilson")


def _resampled_means(
    array: npt.NDArray[np.float64], resamples: int, seed: int
) -> npt.NDArray[np.float64]:
    rows = np.random.default_rng(seed).integers(0, array.size, size=(resamples, array.size))
    return array[rows].mean(axis=1)  # [resamples]


def bootstrap(
    values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> Interval:
    """The percentile bootstrap interval of the mean of `values`."""
    array = _array(values)
    low, high = np.quantile(_resampled_means(array, resamples, seed), [0.025, 0.975])
    mean = float(array.mean())
    return Interval(mean, min(float(low), mean), max(float(high), mean), "bootstrap")


def mean_interval(
    values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> Interval:
    """`wilson` for 0/1 values, else `bootstrap`."""
    array = _array(values)
    if np.isin(array, (0.0, 1.0)).all():
        return wilson(values)
    return bootstrap(values, resamples, seed)


def paired_difference(
    values: Sequence[float],
    reference: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """mean(values) - mean(reference) over the same questions, with the paired bootstrap
    interval (the questions resampled once for both). Raises `ValueError` when the two do not
    have the same length."""
    a, b = _array(values), _array(reference)
    if a.shape != b.shape:
        raise ValueError(f"paired values differ in length: {a.size} and {b.size}")
    differences = a - b  # [n]
    low, high = np.quantile(_resampled_means(differences, resamples, seed), [0.025, 0.975])
    mean = float(differences.mean())
    return Interval(mean, min(float(low), mean), max(float(high), mean), "paired-bootstrap")


def questions_for(sd: float, half_width: float) -> int:
    """Questions for a normal 95% interval of a mean of values with standard deviation `sd`
    to be at most +-`half_width`: ceil((1.96 sd / half_width)^2)."""
    if half_width <= 0 or sd < 0:
        raise ValueError("half_width must be positive and sd not negative")
    return max(1, math.ceil((Z95 * sd / half_width) ** 2))
