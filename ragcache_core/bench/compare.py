"""`ragcache bench serve`'s verdicts on measured points: each system's highest rate within the
SLO, and one system against another at every shared rate (a ratio is a claim only when the
min..max spreads of at least 2 repeats each are apart)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["compare", "spread", "sustained"]


def sustained(points: Sequence[dict[str, Any]], slo_s: float) -> dict[str, dict[str, float] | None]:
    """Per system: the highest rate up to which every rate's TTFT p95 met the SLO in every
    repeat (the ladder stops at the first rate that misses), with the lowest throughput of that
    rate's repeats; None when the first rate already missed."""
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for p in points:
        by.setdefault((p["system"], p["rate_rps"]), []).append(p)
    out: dict[str, dict[str, float] | None] = {}
    missed: set[str] = set()
    for (system, rate), reps in sorted(by.items(), key=lambda kv: kv[0][1]):
        out.setdefault(system, None)
        if system in missed:
            continue
        if slo_s > 0 and all(r["ttft_p95_s"] <= slo_s for r in reps):
            out[system] = {
                "rate_rps": rate,
                "throughput_rps": min(r["throughput_rps"] for r in reps),
            }
        else:
            missed.add(system)
    return out


def spread(points: Sequence[dict[str, Any]], system: str, rate: float, key: str) -> list[float]:
    """[min, median, max] of `key` over the repeats of one system at one rate ([] if none)."""
    values = sorted(p[key] for p in points if p["system"] == system and p["rate_rps"] == rate)
    return [values[0], statistics.median(values), values[-1]] if values else []


def _count(points: Sequence[dict[str, Any]], system: str, rate: float) -> int:
    return sum(1 for p in points if p["system"] == system and p["rate_rps"] == rate)


def compare(
    points: Sequence[dict[str, Any]],
    target: str = "ragcache",
    others: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """`target` (RAGCache) against every other system (or `others`) at every shared rate: the
    ratio of median TTFT means (other / target; above 1 the target is faster) and whether the
    spreads of at least 2 repeats each are apart (only then is the ratio a claim)."""
    rows = []
    rates = sorted({p["rate_rps"] for p in points if p["system"] == target})
    if others is None:
        others = sorted({p["system"] for p in points} - {target})
    for rate in rates:
        mine = spread(points, target, rate, "ttft_mean_s")
        for other in others:
            theirs = spread(points, other, rate, "ttft_mean_s")
            if not theirs or not mine[1]:
                continue
            repeats = min(_count(points, target, rate), _count(points, other, rate))
            # One run has no spread: it can show a difference, never claim one.
            apart = repeats >= 2 and (mine[2] < theirs[0] or theirs[2] < mine[0])
            rows.append(
                {
                    "rate_rps": rate,
                    "system": other,
                    "against": target,
                    "ratio_ttft_mean": theirs[1] / mine[1],
                    "spread_other_s": [theirs[0], theirs[2]],
                    "spread_against_s": [mine[0], mine[2]],
                    "spreads_apart": apart,
                }
            )
    return rows
