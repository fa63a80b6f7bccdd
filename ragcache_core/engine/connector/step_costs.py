"""What the worker's steps cost, and what the connector's copies took of them.

The worker side times every step it runs (from the step's metadata to its report: the forward
pass and every copy) and every kind of copy in it, with the bytes each moved:

    load       host pool -> paged KV, before the forward pass (hits on the host tier)
    handout    paged KV -> host pool, before the forward pass: documents vLLM hands blocks of
               out for this step (eviction-time writes: on the step's critical path)
    lookahead  paged KV -> host pool, after the forward pass: the look-ahead window's copies
    store      paged KV -> host pool, after the forward pass: write-through stores

`StepCosts` is cumulative since the engine started: each report carries the latest totals, so
a lost or late report loses nothing and the app keeps the newest it saw. Step times go into a
histogram of log-spaced buckets (25% apart), enough for a p50 or p99 within a quarter.
Pure Python, JSON-able; no vLLM import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

COPY_KINDS = ("load", "handout", "lookahead", "store")
BUCKET_BASE_S = 1e-4
"""The first bucket's upper edge (0.1 ms)."""
BUCKET_RATIO = 1.25


def bucket_of(seconds: float) -> int:
    """The histogram bucket of a duration: bucket i holds (edge(i-1), edge(i)]."""
    if seconds <= BUCKET_BASE_S:
        return 0
    return math.ceil(math.log(seconds / BUCKET_BASE_S) / math.log(BUCKET_RATIO) - 1e-9)


def bucket_edge(bucket: int) -> float:
    """The upper edge of `bucket`, in seconds."""
    return BUCKET_BASE_S * BUCKET_RATIO**bucket


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Steps run and their copies, since the engine started. `copy_s` and `copy_bytes` by kind
    (`COPY_KINDS`); `copy_steps` by kind: the steps that ran at least one copy of it;
    `histogram`: bucket -> steps (`bucket_of`)."""

    steps: int = 0
    step_s: float = 0.0
    histogram: dict[int, int] = field(default_factory=dict)
    copy_s: dict[str, float] = field(default_factory=dict)
    copy_bytes: dict[str, int] = field(default_factory=dict)
    copy_steps: dict[str, int] = field(default_factory=dict)

    def add_step(self, seconds: float, copies: dict[str, tuple[float, int]]) -> StepCosts:
        """These totals with one more step of `seconds`, whose copies took `copies`
        (kind -> (seconds, bytes))."""
        histogram = dict(self.histogram)
        bucket = bucket_of(seconds)
        histogram[bucket] = histogram.get(bucket, 0) + 1
        copy_s, copy_bytes = dict(self.copy_s), dict(self.copy_bytes)
        copy_steps = dict(self.copy_steps)
        for kind, (spent, moved) in copies.items():
            copy_s[kind] = copy_s.get(kind, 0.0) + spent
            copy_bytes[kind] = copy_bytes.get(kind, 0) + moved
            copy_steps[kind] = copy_steps.get(kind, 0) + 1
        return StepCosts(
            self.steps + 1, self.step_s + seconds, histogram, copy_s, copy_bytes, copy_steps
        )

    def since(self, earlier: StepCosts) -> StepCosts:
        """What happened after `earlier` (an earlier snapshot of the same engine's totals; a
        later engine's totals, which restart at 0, are returned whole)."""
        if earlier.steps > self.steps:
            return self
        histogram = {
            b: n - earlier.histogram.get(b, 0)
            for b, n in self.histogram.items()
            if n > earlier.histogram.get(b, 0)
        }
        return StepCosts(
            self.steps - earlier.steps,
            self.step_s - earlier.step_s,
            histogram,
            {k: v - earlier.copy_s.get(k, 0.0) for k, v in self.copy_s.items()},
            {k: v - earlier.copy_bytes.get(k, 0) for k, v in self.copy_bytes.items()},
            {k: v - earlier.copy_steps.get(k, 0) for k, v in self.copy_steps.items()},
        )

    def quantile_s(self, q: float) -> float:
        """The step time below which a fraction `q` of the steps fell (a bucket's upper edge);
        0 with no step."""
        if not self.steps:
            return 0.0
        need, seen = q * self.steps, 0
        for bucket in sorted(self.histogram):
            seen += self.histogram[bucket]
            if seen >= need:
                return bucket_edge(bucket)
        return bucket_edge(max(self.histogram))

    def summary(self) -> dict[str, Any]:
        """The figures `stats()` and the bench show: steps, their mean, p50 and p99 in ms, and
        per copy kind its seconds, bytes, steps and share of the steps' time."""
        out: dict[str, Any] = {
            "steps": self.steps,
            "step_mean_ms": 1000 * self.step_s / self.steps if self.steps else 0.0,
            "step_p50_ms": 1000 * self.quantile_s(0.5),
            "step_p99_ms": 1000 * self.quantile_s(0.99),
        }
        for kind in COPY_KINDS:
            spent = self.copy_s.get(kind, 0.0)
            out[f"{kind}_copy_s"] = spent
            out[f"{kind}_copy_bytes"] = self.copy_bytes.get(kind, 0)
            out[f"{kind}_copy_steps"] = self.copy_steps.get(kind, 0)
            out[f"{kind}_copy_share"] = spent / self.step_s if self.step_s else 0.0
        return out

    def slower(self, other: StepCosts) -> StepCosts:
        """Of two workers' totals for the same steps (tensor parallel), the slower one's."""
        return self if self.step_s >= other.step_s else other

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "step_s": self.step_s,
            "histogram": [[b, n] for b, n in sorted(self.histogram.items())],
            "copy_s": dict(self.copy_s),
            "copy_bytes": dict(self.copy_bytes),
            "copy_steps": dict(self.copy_steps),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepCosts:
        return cls(
            int(data["steps"]),
            float(data["step_s"]),
            {int(b): int(n) for b, n in data["histogram"]},
            {str(k): float(v) for k, v in data["copy_s"].items()},
            {str(k): int(v) for k, v in data["copy_bytes"].items()},
            {str(k): int(v) for k, v in data["copy_steps"].items()},
        )


NO_STEPS = StepCosts()
"""No step run yet (an immutable default: its dicts are never mutated)."""
