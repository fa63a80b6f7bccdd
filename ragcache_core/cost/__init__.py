"""Cost model: estimated prefill time T(cached, new) from a profiled grid (docs/design.md 2.3)."""

from __future__ import annotations

from ragcache_core.cost.analytic import AnalyticPrefill, analytic_profile, default_cost_model
from ragcache_core.cost.model import CostModel, InterpolatedCostModel
from ragcache_core.cost.profile import PROFILE_FORMAT, CopyCost, CostProfile

__all__ = [
    "PROFILE_FORMAT",
    "AnalyticPrefill",
    "CopyCost",
    "CostModel",
    "CostProfile",
    "InterpolatedCostModel",
    "analytic_profile",
    "default_cost_model",
]
