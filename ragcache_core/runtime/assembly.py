"""The parts of one `RAGCache`, built from its `CacheConfig`: the host KV pool and the connector's
view of it (the GPU tier is vLLM's own KV cache), the knowledge tree, the admission queue, the
engine settings.

Pure construction (no engine is started here); `RAGCache.__init__` calls these in order.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

from ragcache_core.capacity import slots_in_tokens
from ragcache_core.config import CacheConfig
from ragcache_core.engine.connector import ConnectorConfig
from ragcache_core.engine.settings import DeviceInfo, EngineSettings
from ragcache_core.runtime.admission import Admission
from ragcache_core.storage.host_pool import HostPool
from ragcache_core.tree import KnowledgeTree, RootKey


@dataclass(frozen=True)
class Pools:
    """The KV pool of one cache: what the connector maps, and the host pool the app owns
    (shared memory that outlives an engine; None when the host tier is off)."""

    connector: ConnectorConfig
    host_pool: HostPool | None

    @property
    def name(self) -> str:
        return self.connector.host_pool_name


def open_pools(model: str, config: CacheConfig) -> Pools:
    """Size the host pool from the config and create it (a new shared-memory file named after
    this process; the caller removes it)."""
    from ragcache_core.storage.pool_layout import layout_for_model

    assert config.dtype is not None  # resolved by `resolve_device_defaults`
    layout = layout_for_model(model, dtype=config.dtype, page_size=config.page_size)
    host_slots = slots_in_tokens(config.host_pool_tokens, config.page_size)
    name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}" if host_slots else ""
    host_pool = HostPool.create(name, layout, host_slots, reuse=False) if host_slots else None
    connector = ConnectorConfig(
        layout=layout,
        host_slots=host_slots,
        host_pool_name=name,
        # With no host tier the window copies nothing, but still follows the documents in
        # vLLM's blocks, so that the tree knows them (`Node.resident`).
        host_write=config.host_write,
        window_blocks=window_blocks(config) if config.writes_at_eviction else 0,
        back_to_head=config.writes_at_eviction and config.host_write_return == "head",
        handout=config.host_write_at_handout,
    )
    return Pools(connector, host_pool)


def window_blocks(config: CacheConfig) -> int:
    """The look-ahead in vLLM blocks (whole blocks covering
    `CacheConfig.host_write_window_tokens`; 0: none)."""
    assert config.block_size is not None  # resolved by `resolve_device_defaults`
    return -(-config.host_write_window_tokens // config.block_size)


def build_tree(
    config: CacheConfig,
    root_key: RootKey,
    connector: ConnectorConfig,
    settings: EngineSettings,
) -> KnowledgeTree:
    """The knowledge tree over the host pool, with the configured policy and cost model. Its
    only slot tier is the host tier: vLLM's prefix cache holds the GPU-resident KV (the tree
    knows it as `Node.resident`), and vLLM's LRU decides what leaves vLLM's blocks."""
    from ragcache_core.cost import CostProfile, InterpolatedCostModel, default_cost_model

    cost_model = (
        InterpolatedCostModel(CostProfile.load(config.cost_profile))
        if config.cost_profile
        else default_cost_model()
    )
    assert config.max_num_batched_tokens is not None  # resolved by `resolve_device_defaults`
    return KnowledgeTree(
        root_key,
        host_slots=connector.host_slots,
        page_size=config.page_size,
        policy=config.policy,
        cost_model=cost_model,
        max_depth=config.max_cached_depth,
        store_policy=config.store_policy,
        block_size=settings.block_size,
        host_write=config.host_write,
        host_lease_slots=-(-config.max_num_batched_tokens // config.page_size)
        if config.writes_at_eviction
        else 0,
        host_lease_victims=config.host_lease_victims,
    )


def build_admission(config: CacheConfig) -> Admission:
    """The prefill admission queue: a token budget per step, reordering when configured."""
    assert config.max_num_batched_tokens is not None  # resolved by `resolve_device_defaults`
    return Admission(
        config.max_prefill_bs,
        "cache_aware" if config.reorder else "fcfs",
        config.reorder_window,
        token_budget=config.prefill_token_budget or config.max_num_batched_tokens,
    )


def build_engine_settings(
    model: str, config: CacheConfig, connector: ConnectorConfig, device: DeviceInfo
) -> EngineSettings:
    """vLLM's settings for this cache (the one builder, `engine/settings.py`)."""
    from ragcache_core.engine.settings import build_settings, cache_engine_spec

    spec = cache_engine_spec(
        model,
        config,
        connector=connector.kv_transfer_config(),
        prefix_caching=True,  # vLLM's prefix cache is the GPU tier
    )
    return build_settings(spec, device)
