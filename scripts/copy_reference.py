"""The copies of `CopyOps` stated in pure torch: the oracle of the kernel tests
(tests/test_triton_copy.py) and of `gpu_check.py`, and the plainest statement of what is copied
where. Offsets are int64 element offsets.

    cache_offsets   (token, K/V, head, dim) -> element of a strided paged layer
    pool_offsets    (token, K/V, head, dim) -> element of a contiguous [S, L, 2, P, H, D] pool
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragcache_core.storage.copy.base import TokenIndex
from ragcache_core.storage.paged_layout import StridedLayout


def cache_offsets(layout: StridedLayout, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Element offsets [T, 2, H, D] (int64) of the tokens at `slot_mapping` [T] from their
    layer's first element: the arithmetic of `_token_tile`, in torch."""
    slot_mapping = slot_mapping.to(torch.int64)
    device = slot_mapping.device
    block = (slot_mapping // layout.block_size)[:, None, None, None]  # [T, 1, 1, 1]
    offset = (slot_mapping % layout.block_size)[:, None, None, None]  # [T, 1, 1, 1]
    k = torch.arange(2, device=device)[None, :, None, None]  # [1, 2, 1, 1]
    h = torch.arange(layout.num_heads, device=device)[None, None, :, None]  # [1, 1, H, 1]
    d = torch.arange(layout.head_size, device=device)[None, None, None, :]  # [1, 1, 1, D]
    return (
        block * layout.block_stride
        + offset * layout.token_stride
        + k * layout.kv_stride
        + h * layout.head_stride
        + d * layout.dim_stride
    )  # [T, 2, H, D]


def pool_offsets(pool_shape: Sequence[int], index: TokenIndex, layer: int) -> torch.Tensor:
    """Element offsets [T, 2, H, D] (int64) of the index's rows of `layer` in a contiguous
    pool of `pool_shape` [S, L, 2, P, H, D]."""
    _, layers, _, page, heads, dims = pool_shape
    device = index.pool_slots.device
    slot = index.pool_slots.to(torch.int64)[:, None, None, None]  # [T, 1, 1, 1]
    row = index.pool_rows.to(torch.int64)[:, None, None, None]  # [T, 1, 1, 1]
    k = torch.arange(2, device=device)[None, :, None, None]  # [1, 2, 1, 1]
    h = torch.arange(heads, device=device)[None, None, :, None]  # [1, 1, H, 1]
    d = torch.arange(dims, device=device)[None, None, None, :]  # [1, 1, 1, D]
    kv = page * heads * dims
    return (
        slot * (layers * 2 * kv) + layer * 2 * kv + k * kv + row * heads * dims + h * dims + d
    )  # [T, 2, H, D]


def reference_scatter_tokens(
    pool: torch.Tensor, flats: Sequence[torch.Tensor], layout: StridedLayout, index: TokenIndex
) -> None:
    """`scatter_tokens` in torch (pool on the cache's device): the oracle of the tests."""
    offsets = cache_offsets(layout, index.slot_mapping)  # [T, 2, H, D]
    for layer, flat in enumerate(flats):
        flat[offsets] = pool[index.pool_slots, layer, :, index.pool_rows]  # [T, 2, H, D]


def reference_gather_tokens(
    flats: Sequence[torch.Tensor], layout: StridedLayout, index: TokenIndex, pool: torch.Tensor
) -> None:
    """`gather_tokens` in torch: the oracle of the tests."""
    offsets = cache_offsets(layout, index.slot_mapping)  # [T, 2, H, D]
    for layer, flat in enumerate(flats):
        pool[index.pool_slots, layer, :, index.pool_rows] = flat[offsets]  # [T, 2, H, D]


def reference_copy_slots(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """`copy_slots` in torch: dst[dst_slots] <- src[src_slots] (across devices too)."""
    dst[dst_slots.to(dst.device)] = src[src_slots.to(src.device)].to(dst.device)
