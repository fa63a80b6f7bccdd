"""Longer request streams from a trace, with the trace's measured first-document skew.

`resample(requests, length)` models the first document of a request, the key that document
affinity routes on, as the trace shows it: a share q of requests start with a document no
other request starts with (one-off), and the rest start with a reused document whose
popularity follows Zipf(s).
1. Group the trace's requests by first document. q = the share of requests in groups of one;
   the reused groups (two or more requests) are ranked by size, ties first seen.
2. s = the maximum-likelihood Zipf exponent of the reused groups' sizes (`fit_zipf`).
3. The stream is K = ceil(length / len(requests)) times longer, so the universe of reused
   first documents grows K times too, from G groups to K x G ranks: rank r (0-based) is copy
   c = r // G of the group ranked r % G (ranks 0..G-1 are the trace's own groups, hottest
   first). Each request is one-off with probability q (a one-off template, copied under a new
   suffix), else its rank is drawn from Zipf(s) over the K x G ranks and its template is one of
   that group's requests, uniformly. A copy relabels every document id of its template as
   "<id>~<copy>": same token counts, same continuations, new ids.
4. Arrivals: seeded Poisson at `rate`, as `scripts/build_sim_traces.py` makes them.

So each document is reused about as often as in the trace (the infinite-cache hit rate stays
near the trace's), the reused documents keep the measured skew, and the structure below a
first document is the trace's own. What it does not keep: a hot document's share of the whole
stream falls as the universe grows (Zipf with s < 1 spreads over more ranks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ragcache_core.errors import InputError
from ragcache_core.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class ResampleFit:
    """What `resample` measured on the trace and used."""

    one_off_share: float
    zipf_s: float
    reused_groups: int
    copies: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def zipf_log_likelihood(counts: Sequence[int], s: float) -> float:
    """Log-likelihood of rank-frequency `counts` (descending) under Zipf(s) over len ranks."""
    ranks = np.arange(1, len(counts) + 1, dtype=np.float64)
    c = np.asarray(counts, dtype=np.float64)
    log_norm = math.log(float(np.sum(ranks**-s)))
    return float(-s * np.sum(c * np.log(ranks)) - c.sum() * log_norm)


def fit_zipf(counts: Sequence[int]) -> float:
    """The maximum-likelihood Zipf exponent in [0, 4] of descending `counts` (golden-section
    search; the likelihood is concave in s)."""
    if not counts:
        raise InputError("cannot fit a Zipf exponent to an empty trace")
    lo, hi = 0.0, 4.0
    phi = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - phi * (hi - lo), lo + phi * (hi - lo)
        if zipf_log_likelihood(counts, a) < zipf_log_likelihood(counts, b):
            lo = a
        else:
            hi = b
    return (lo + hi) / 2


def first_doc_groups(requests: Sequence[TraceRequest]) -> list[list[TraceRequest]]:
    """Requests grouped by first document, largest group first (ties: first seen)."""
    groups: dict[str, list[TraceRequest]] = {}
    for request in requests:
        if not request.docs:
            raise InputError(f"request {request.id!r} has no documents; cannot resample it")
        groups.setdefault(request.docs[0], []).append(request)
    return sorted(groups.values(), key=len, reverse=True)  # stable: ties keep first-seen order


def resample(
    requests: Sequence[TraceRequest],
    length: int,
    *,
    seed: int = 0,
    rate: float = 1.0,
    prefix: str = "resampled",
) -> tuple[list[TraceRequest], ResampleFit]:
    """`length` requests drawn as the module docstring says, and the fit they came from."""
    if length < 1 or rate <= 0:
        raise InputError(f"length must be >= 1 and rate > 0, got {length} and {rate}")
    groups = first_doc_groups(requests)
    reused = [g for g in groups if len(g) > 1]
    one_off = [g[0] for g in groups if len(g) == 1]
    fit = ResampleFit(
        one_off_share=len(one_off) / len(requests),
        zipf_s=fit_zipf([len(g) for g in reused]) if reused else 0.0,
        reused_groups=len(reused),
        copies=max(1, math.ceil(length / len(requests))),
    )
    rng = np.random.default_rng(seed)
    if reused:
        weights = np.arange(1, len(reused) * fit.copies + 1, dtype=np.float64) ** -fit.zipf_s
        ranks = rng.choice(len(weights), size=length, p=weights / weights.sum())
    else:
        ranks = np.zeros(length, dtype=np.int64)
    fresh = rng.random(length) < fit.one_off_share if one_off else np.zeros(length, dtype=bool)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=length))
    out = []
    for i in range(length):
        if fresh[i] or not reused:
            template, copy = one_off[int(rng.integers(len(one_off)))], i + 1
        else:
            copy, group = divmod(int(ranks[i]), len(reused))
            template = reused[group][int(rng.integers(len(reused[group])))]
        docs = template.docs if copy == 0 else tuple(f"{d}~{copy}" for d in template.docs)
        out.append(
            TraceRequest(
                id=f"{prefix}-{i}",
                arrival_s=round(float(arrivals[i]), 6),
                docs=docs,
                doc_tokens=template.doc_tokens,
                question_tokens=template.question_tokens,
            )
        )
    return out, fit
