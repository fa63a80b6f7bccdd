"""vLLM's paged KV layouts, read off shape and strides (storage/paged_layout.py, no vLLM needed):
every layout vLLM builds, kernel-block splits, round trips through the copy code, refusals."""

from __future__ import annotations

import pytest
import torch

from ragcache_core.errors import ConfigError
from ragcache_core.storage.copy.base import TokenIndex
from ragcache_core.storage.copy.torch_ops import TorchCopyOps
from ragcache_core.storage.paged_layout import (
    describe_paged_cache,
    strided_paged_kv,
    vllm_style_views,
)
from ragcache_core.storage.pool_layout import PoolLayout

ORDERS = {  # vLLM's KVCacheLayout stride permutations of the logical [L, B, H, N, C]
    "LBNHC": (0, 1, 3, 2, 4),  # the CUDA default: not contiguous as [B, H, N, C]
    "LBHNC": (0, 1, 2, 3, 4),  # CPU, and FlashInfer on Blackwell
    "BLNHC": (1, 0, 3, 2, 4),  # block-outermost: layers interleaved between blocks
    "BLHNC": (1, 0, 2, 3, 4),
}
CASES = [(name, 1) for name in ORDERS] + [("LBNHC", 2), ("LBHNC", 4)]
L, B, N = 2, 4, 16


def _views(name: str, ratio: int, heads: int, head_size: int, dtype: torch.dtype) -> list:
    buffer = torch.zeros(L * B * heads * N * 2 * head_size, dtype=dtype)
    return vllm_style_views(
        buffer,
        order=ORDERS[name],
        num_layers=L,
        num_blocks=B,
        num_heads=heads,
        block_size=N,
        head_size=head_size,
        ratio=ratio,
    )


@pytest.mark.parametrize(("name", "ratio"), CASES)
def test_views_match_vllms_own_construction(name: str, ratio: int) -> None:
    """The test helper builds exactly the views vLLM hands a connector (same shape, strides,
    offsets), so the tests below test what CUDA engines register."""
    interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    heads, head_size = 2, 8
    spec = interface.FullAttentionSpec(
        block_size=N, num_kv_heads=heads, head_size=head_size, dtype=torch.float32
    )
    page = spec.page_size_bytes
    layout = KVCacheLayout[name]
    strides = (page * B, page) if layout.is_layer_compact else (page, page * L)
    tensor = interface.KVCacheTensor(
        size=page * B * L,
        layers=[f"layer.{i}" for i in range(L)],
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    raw = torch.zeros(page * B * L, dtype=torch.int8)
    theirs = interface.create_kv_cache_views(
        raw, spec, B, layout, tensor, kernel_block_size=N // ratio
    )
    mine = vllm_style_views(
        raw.view(torch.float32),
        order=ORDERS[name],
        num_layers=L,
        num_blocks=B,
        num_heads=heads,
        block_size=N,
        head_size=head_size,
        ratio=ratio,
    )
    for a, b in zip(theirs, mine, strict=True):
        assert (a.shape, a.stride(), a.storage_offset()) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
        )


@pytest.mark.parametrize(("name", "ratio"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_size"), [(1, 8), (2, 16)])
def test_round_trip_is_bit_exact(
    name: str, ratio: int, dtype: torch.dtype, heads: int, head_size: int
) -> None:
    caches = _views(name, ratio, heads, head_size, dtype)
    paged = strided_paged_kv(caches, block_size=N, num_kv_heads=heads, head_size=head_size)
    assert paged.strided is not None
    assert paged.strided.block_size == N // ratio
    pool_layout = PoolLayout(L, heads, head_size, str(dtype).removeprefix("torch."), 4)
    pool = torch.randn(pool_layout.pool_shape(6)).to(dtype)
    # 7 tokens from slots 1 and 3 to scheduler positions 13..19 of blocks 2 and 0 (crossing
    # a block, and kernel blocks when ratio > 1).
    positions = list(range(13, 20))
    block_table = [2, 0]
    slot_mapping = [block_table[p // N] * N + p % N for p in positions]
    index = TokenIndex(
        torch.tensor([1, 1, 1, 3, 3, 3, 3]),
        torch.tensor([1, 2, 3, 0, 1, 2, 3]),
        torch.tensor(slot_mapping),
    )
    ops = TorchCopyOps(torch.device("cpu"))
    ops.load(pool, index, paged)
    for i, slot in enumerate(slot_mapping):  # compare against direct view indexing
        pool_slot, row = int(index.pool_slots[i]), int(index.pool_rows[i])
        kernel_block, offset = divmod(slot, N // ratio)
        for layer in range(L):
            token = caches[layer][kernel_block, :, offset].view(heads, 2, head_size)  # [H, 2, D]
            assert torch.equal(token[:, 0], pool[pool_slot, layer, 0, row])
            assert torch.equal(token[:, 1], pool[pool_slot, layer, 1, row])
    back = torch.zeros_like(pool)
    ops.store(paged, index, back)
    assert torch.equal(back[1, :, :, 1:4], pool[1, :, :, 1:4])
    assert torch.equal(back[3], pool[3])
    assert float(back[0].abs().sum()) == 0.0


def test_block_outermost_layouts_have_a_layer_stride() -> None:
    caches = _views("BLNHC", 1, 2, 8, torch.float32)
    layout = describe_paged_cache(caches, block_size=N, num_kv_heads=2, head_size=8)
    assert layout.layer_stride == 2 * N * 2 * 8  # one page
    assert layout.block_stride == L * 2 * N * 2 * 8


def test_unsupported_layouts_are_refused_with_shape_and_backend() -> None:
    caches = _views("LBNHC", 1, 2, 8, torch.float32)
    with pytest.raises(ConfigError, match=r"FLASH_ATTN.*2 KV heads per layer, the model has 4"):
        describe_paged_cache(
            caches, block_size=N, num_kv_heads=4, head_size=8, backend="FLASH_ATTN"
        )
    with pytest.raises(ConfigError, match="quantized or padded"):
        describe_paged_cache(caches, block_size=N, num_kv_heads=2, head_size=6)
    with pytest.raises(ConfigError, match="does not divide the block size"):
        describe_paged_cache(caches, block_size=24, num_kv_heads=2, head_size=8)
    overlapping = torch.zeros(64).as_strided((4, 2, N, 16), (1, 1, 1, 1))
    with pytest.raises(ConfigError, match="overlaps"):
        describe_paged_cache([overlapping], block_size=N, num_kv_heads=2, head_size=8)
    with pytest.raises(ConfigError, match="layer 1 has"):
        describe_paged_cache([caches[0], caches[1][:2]], block_size=N, num_kv_heads=2, head_size=8)
    with pytest.raises(ConfigError, match="expected"):
        describe_paged_cache([torch.zeros(4, 4, 4)], block_size=4, num_kv_heads=4, head_size=2)
