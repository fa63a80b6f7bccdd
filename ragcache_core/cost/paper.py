"""The paper's GPU as a cost profile, built from published figures (`--profile paper-a10g`).

No GPU with vLLM has run this project, so a GPU figure can only be projected: the simulator
(`ragcache simulate`) with this profile. The setting is the paper's main one (Jin et al.,
RAGCache, section 7): LLaMA2-7B in fp16 on one NVIDIA A10G (24 GB, PCIe 4.0 x16), a 192 GiB
host cache. Each number, and where it comes from:

  * KV per token: 2 (K and V) x 32 layers x 32 KV heads x head size 128 x 2 bytes = 512 KiB
    (LLaMA2-7B's published configuration; Mistral-7B's 8 KV heads would give a quarter).
  * The fixed cost of a forward pass: reading the weights once, 6.74e9 parameters x 2 bytes /
    600 GB/s (the A10G's memory bandwidth, NVIDIA's A10 datasheet) = 22.5 ms.
  * Compute: 2 x 6.74e9 FLOPs per token for the weights, and 4 x 32 layers x 4,096 (model
    width) FLOPs per query-key pair for attention (QK^T and PV), at one effective rate, chosen
    so that a 4,000-token prefill takes 1 s: the paper's "prefill reaches one second past
    4,000 tokens" (section 2). That rate is 59 TFLOP/s.
  * Those give T(alpha, beta) = fixed + per_token x beta + attention x beta x (alpha + beta/2)
    (`AnalyticPrefill`, the same form as the default profile). The paper's "a cached prefix
    prefills up to 11.5x faster" then holds for a 4,000-token request that computes its last
    247 tokens (a question and the template's tail: `cached_split` solves for them):
    T(0, 4000) / T(3753, 247) = 11.5.
  * The copy rate: the paper's "3.9x faster even with the copy from host memory" for the same
    request: T(0, 4000) / (T(3753, 247) + the copy of 3,753 tokens) = 3.9 gives 11.6 GB/s for
    the 1.97 GB of KV (37% of PCIe 4.0 x16's 31.5 GB/s: the copies are many small pages).

Memory (not part of a profile; the simulator's flags, docs/benchmarks.md "The paper's GPU,
projected"): vLLM's KV is what 90% of 24 GiB (vLLM's default `gpu_memory_utilization`) leaves
after 12.6 GiB of weights and ~1.5 GiB of activations, 7.5 GiB = 15,360 tokens; the host's 192
GiB is 393,216 tokens.
"""

from __future__ import annotations

from collections.abc import Callable

from ragcache_core.cost.analytic import AnalyticPrefill, analytic_profile
from ragcache_core.cost.profile import CostProfile

PARAMETERS = 6.74e9
"""LLaMA2-7B's parameters."""
WEIGHT_BYTES = 2 * PARAMETERS
"""fp16."""
MEMORY_BYTES_PER_S = 600e9
"""The A10G's memory bandwidth."""
LAYERS, KV_HEADS, HEAD_SIZE, WIDTH = 32, 32, 128, 4096
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_SIZE * 2
FULL_PREFILL = (4000, 1.0)
"""(tokens, seconds): the paper's prefill of a 4,000-token request."""
CACHED_SPEEDUP = 11.5
HOST_SPEEDUP = 3.9


def paper_formula() -> AnalyticPrefill:
    """T(alpha, beta) on the paper's A10G (see the module docstring)."""
    fixed = WEIGHT_BYTES / MEMORY_BYTES_PER_S
    tokens, seconds = FULL_PREFILL
    linear_flops = 2 * PARAMETERS
    pair_flops = 4 * LAYERS * WIDTH
    work = linear_flops * tokens + pair_flops * tokens * tokens / 2
    rate = work / (seconds - fixed)
    return AnalyticPrefill(
        fixed_s=fixed, per_token_s=linear_flops / rate, attention_s=pair_flops / rate
    )


def cached_split(formula: AnalyticPrefill) -> tuple[int, int]:
    """(cached, computed) tokens of the 4,000-token request that prefills `CACHED_SPEEDUP` x
    faster with its cached prefix than without: the most tokens computed for which it still
    does (T grows with the tokens computed)."""
    tokens, seconds = FULL_PREFILL
    target = seconds / CACHED_SPEEDUP
    computed = max(b for b in range(1, tokens) if formula.prefill_time(tokens - b, b) <= target)
    return tokens - computed, computed


def paper_copy_bytes_per_s(formula: AnalyticPrefill) -> float:
    """The host -> GPU copy rate at which that request's host hit is `HOST_SPEEDUP` x faster
    than its full prefill."""
    seconds = FULL_PREFILL[1]
    cached, computed = cached_split(formula)
    copy_s = seconds / HOST_SPEEDUP - formula.prefill_time(cached, computed)
    return cached * KV_BYTES_PER_TOKEN / copy_s


def paper_a10g() -> CostProfile:
    """The profile: `paper_formula` on the analytic grid, with the derived copy rate."""
    formula = paper_formula()
    profile = analytic_profile(formula)
    return CostProfile(
        model="LLaMA2-7B (fp16), from the RAGCache paper's published figures",
        hardware="1x NVIDIA A10G 24 GB, PCIe 4.0 x16 (projected, not measured)",
        cached_tokens=profile.cached_tokens,
        new_tokens=profile.new_tokens,
        prefill_s=profile.prefill_s,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        copy_bytes_per_s=paper_copy_bytes_per_s(formula),
    )


PAPER_PROFILES: dict[str, Callable[[], CostProfile]] = {"paper-a10g": paper_a10g}
"""The built-in profiles `ragcache simulate --profile` takes by name."""
