"""A built-in analytic profile, for simulation when no measured profile is at hand.

T(alpha, beta) = fixed + per_token * beta + attention * beta * (alpha + beta / 2)

`per_token` is the linear (MLP + projection) work of each new token; the last term is
attention: each new token attends to the cached tokens and, on average, half of the new ones.
The defaults are round numbers of the order of a 7B model on one datacenter GPU (about 8k
prefill tokens/s on short prompts); they shape relative costs, they are not a measurement. So
are its copies (`CopyCost`): a 7B Llama's 512 KiB of KV per token (fp16) at 25 GB/s, about what
PCIe 4.0 x16 moves. `cost/paper.py` derives a profile from the paper's own figures instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_core.cost.model import InterpolatedCostModel
from ragcache_core.cost.profile import CostProfile

DEFAULT_CACHED_GRID = (0, 256, 1024, 4096, 16384, 65536)
DEFAULT_NEW_GRID = (1, 64, 256, 1024, 4096, 16384)
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2
"""K and V x 32 layers x 32 KV heads x head size 128 x 2 bytes: a 7B Llama in fp16 (512 KiB)."""
DEFAULT_COPY_BYTES_PER_S = 25e9


@dataclass(frozen=True, slots=True)
class AnalyticPrefill:
    """Closed-form prefill time (seconds); the parameters are per-token coefficients."""

    fixed_s: float = 0.005
    per_token_s: float = 1.2e-4
    attention_s: float = 2.0e-8

    def prefill_time(self, cached_tokens: int, new_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        attended = cached_tokens + new_tokens / 2
        return (
            self.fixed_s + self.per_token_s * new_tokens + self.attention_s * new_tokens * attended
        )


def analytic_profile(
    formula: AnalyticPrefill | None = None,
    cached_grid: tuple[int, ...] = DEFAULT_CACHED_GRID,
    new_grid: tuple[int, ...] = DEFAULT_NEW_GRID,
) -> CostProfile:
    """Sample `formula` on a grid, giving a profile in the same format as a measured one."""
    f = formula or AnalyticPrefill()
    return CostProfile(
        model="analytic",
        hardware=(
            f"formula: {f.fixed_s} + {f.per_token_s}*beta + {f.attention_s}*beta*(alpha+beta/2)"
        ),
        cached_tokens=cached_grid,
        new_tokens=new_grid,
        prefill_s=tuple(tuple(f.prefill_time(a, b) for b in new_grid) for a in cached_grid),
        kv_bytes_per_token=DEFAULT_KV_BYTES_PER_TOKEN,
        copy_bytes_per_s=DEFAULT_COPY_BYTES_PER_S,
    )


def default_cost_model() -> InterpolatedCostModel:
    """The cost model used when no profile is given: the analytic profile, interpolated."""
    return InterpolatedCostModel(analytic_profile())
