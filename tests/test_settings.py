"""The engine-settings builder: device-right choices, tested on a description of each device
(no GPU and no engine needed)."""

from __future__ import annotations

import pytest

from ragcache_core.config import CacheConfig
from ragcache_core.engine.connector import ConnectorConfig
from ragcache_core.engine.settings import (
    CUDA_MEMORY_UTILIZATION,
    GIB,
    RESERVED_EXTRA,
    DeviceInfo,
    EngineSpec,
    build_settings,
    cache_engine_spec,
    resolve_device_defaults,
)
from ragcache_core.errors import ConfigError
from ragcache_core.storage.pool_layout import PoolLayout

CPU = DeviceInfo(kind="cpu", name="cpu", memory_bytes=24 * GIB)
H200 = DeviceInfo(kind="cuda", name="NVIDIA H200", memory_bytes=141 * GIB, capability=(9, 0))
T4 = DeviceInfo(kind="cuda", name="Tesla T4", memory_bytes=16 * GIB, capability=(7, 5))
CONNECTOR = ConnectorConfig(
    layout=PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=16),
).kv_transfer_config()


def test_cpu_defaults() -> None:
    settings = build_settings(EngineSpec(model="m", connector=CONNECTOR), CPU)
    assert (settings.dtype, settings.block_size, settings.enforce_eager) == ("float32", 32, True)
    assert settings.kv_cache_space_gib == 1.0 and settings.gpu_memory_utilization == 0.1
    assert settings.extra["async_scheduling"] is False
    kwargs = settings.to_engine_kwargs()
    assert kwargs["kv_cache_memory_bytes"] == GIB


def test_cuda_defaults_bf16_graphs_and_all_of_vllms_share() -> None:
    """No RAGCache GPU pool sits beside vLLM's KV cache any more (that cache is the GPU tier):
    vLLM gets its usual share of the GPU, with or without the connector."""
    settings = build_settings(EngineSpec(model="m", connector=CONNECTOR), H200)
    assert (settings.dtype, settings.block_size, settings.enforce_eager) == ("bfloat16", 16, False)
    assert settings.kv_cache_space_gib is None  # vLLM sizes its cache from its share
    assert settings.gpu_memory_utilization == CUDA_MEMORY_UTILIZATION == 0.9
    assert settings.extra["async_scheduling"] is False  # the connector needs it off
    assert "kv_cache_memory_bytes" not in settings.to_engine_kwargs()
    assert (
        build_settings(EngineSpec(model="m", connector=CONNECTOR), T4).gpu_memory_utilization == 0.9
    )


def test_cuda_without_connector_keeps_vllms_async_scheduling() -> None:
    settings = build_settings(EngineSpec(model="m"), H200)
    assert "async_scheduling" not in settings.extra
    assert settings.gpu_memory_utilization == 0.9


def test_pre_ampere_gets_fp16() -> None:
    assert build_settings(EngineSpec(model="m"), T4).dtype == "float16"


def test_the_gpu_pool_is_gone_from_the_engine_spec() -> None:
    with pytest.raises(TypeError):
        EngineSpec(model="m", connector=CONNECTOR, gpu_pool_bytes=GIB)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        cache_engine_spec("m", CacheConfig(), connector=CONNECTOR, gpu_pool_bytes=GIB)  # type: ignore[call-arg]


def test_prefix_caching_is_reserved_as_the_gpu_tier() -> None:
    assert "GPU tier" in RESERVED_EXTRA["enable_prefix_caching"]
    with pytest.raises(ConfigError, match="RAGCache's GPU tier"):
        build_settings(
            EngineSpec(model="m", connector=CONNECTOR, extra={"enable_prefix_caching": False}), CPU
        )
    assert build_settings(EngineSpec(model="m", prefix_caching=True), CPU).enable_prefix_caching


@pytest.mark.parametrize(
    "key",
    [
        "enable_prefix_caching",
        "kv_transfer_config",
        "async_scheduling",
        "dtype",
        "pipeline_parallel_size",
        "speculative_config",
    ],
)
def test_engine_extra_that_contradicts_the_connector_is_refused(key: str) -> None:
    spec = EngineSpec(model="m", connector=CONNECTOR, extra={key: True})
    with pytest.raises(ConfigError, match=key):
        build_settings(spec, CPU)
    build_settings(EngineSpec(model="m", extra={key: True}), CPU)  # fine without the connector


def test_explicit_values_win() -> None:
    spec = EngineSpec(
        model="m", dtype="float16", block_size=64, kv_cache_bytes=2 * GIB, max_num_seqs=8
    )
    settings = build_settings(spec, H200)
    assert (settings.dtype, settings.block_size, settings.kv_cache_space_gib) == (
        "float16",
        64,
        2.0,
    )
    with pytest.raises(ConfigError, match="multiple of 32"):
        build_settings(EngineSpec(model="m", block_size=16), CPU)


def test_cache_config_resolves_per_device() -> None:
    config = CacheConfig()
    cpu, gpu = resolve_device_defaults(config, CPU), resolve_device_defaults(config, H200)
    assert (cpu.dtype, cpu.block_size, cpu.max_num_batched_tokens) == ("float32", 32, 4096)
    assert (gpu.dtype, gpu.block_size, gpu.max_num_batched_tokens) == ("bfloat16", 16, 8192)
    spec = cache_engine_spec("m", gpu, connector=CONNECTOR)
    assert spec.kv_cache_bytes is None and spec.connector == CONNECTOR
    sized = cache_engine_spec("m", gpu.with_(vllm_kv_cache_gib=2.0), connector=CONNECTOR)
    assert sized.kv_cache_bytes == 2 * GIB  # vLLM's KV cache, the GPU tier, sized here
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        build_settings(
            cache_engine_spec(
                "m",
                cpu.with_(engine_extra={"enable_prefix_caching": True}),
                connector=CONNECTOR,
            ),
            CPU,
        )


def test_pool_settings_size_only_the_host_pool() -> None:
    from ragcache_core.engine.cached import PoolSettings

    layout = PoolLayout(num_layers=2, num_kv_heads=2, head_size=32, dtype="float32", page_size=16)
    pools = PoolSettings()
    assert (pools.host_pool_gib, pools.page_size, pools.host_pool_name) == (0.5, 16, "default")
    slots = pools.slots(layout)
    assert isinstance(slots, int) and slots == (GIB // 2) // layout.slot_bytes
    assert PoolSettings(host_pool_gib=0.0).slots(layout) == 0
    with pytest.raises(TypeError):
        PoolSettings(gpu_pool_gib=1.0)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="negative"):
        PoolSettings(host_pool_gib=-1.0)
