"""Triton kernels for the KV copies of `CopyOps` on CUDA.

    scatter_tokens  pool rows -> paged cache (load)    one launch for all tokens (and layers)
    gather_tokens   paged cache -> pool rows (store)   one launch for all tokens (and layers)
    copy_slots      whole pool slots -> pool slots      one launch for all slot pairs; a pinned
                                                        host pool is read/written through UVA

The paged side is described by a `StridedLayout` (`paged_layout.describe_paged_cache`): element
(block b, head h, offset t, K/V k, dim d) of layer l sits at

    l * layer_stride + b * block_stride + h * head_stride + t * token_stride
        + k * kv_stride + d * dim_stride

from layer 0's first element, with `b = slot // block_size`, `t = slot % block_size` for a
token's vLLM slot mapping. The pool side is a contiguous `[S, L, 2, P, H, D]` tensor.

int64 everywhere: an H200's cache holds more than 2^31 elements, and Triton types a program
id, an `arange` and a small integer argument as int32, so a product of two of them wraps
silently. Every index that enters a product is therefore int64 first: program ids and aranges
go through `.to(tl.int64)`, and the index tensors (`TokenIndex`, slot lists) are int64. The
strides may arrive as int32 (Triton types an argument by its value); each product has an int64
operand, so it is computed in int64. `kernel_offsets` runs the kernels' own offset code and
returns what it computed, so the tests check that arithmetic with offsets past 2^31 without
allocating them.

Copies move bits, not numbers: every tensor is reinterpreted as the integer dtype of its
element size before a launch, so the result is bit-exact for any dtype (NaN payloads, -0.0)
and one compiled kernel serves bf16 and fp16 alike.

The kernels do not bounds-check: a wild address on CUDA is a sticky error that ends the
process's CUDA context. The launchers check every index first and raise `IndexError` before
anything is written; for index tensors on the device that costs one sync of six numbers
(`copy_pages` checks its Python slot lists without one).

A host pool is addressed by the kernels through UVA: `cudaHostRegister` (mapped) makes its
pages device-accessible, and Triton's launcher, which takes any object with `data_ptr()` and
`dtype`, translates the host address to its device alias (`MappedHost`). Where that does not
hold (UVA off, memory not registered) the torch path copies whole slots with `copy_`.

Triton has no CPU backend: on CPU these kernels run only under `TRITON_INTERPRET=1` (read when
a kernel is decorated, i.e. when this module is imported), which the tests use. The package
imports this module only when the device is CUDA. `TritonCopyOps` (`triton_ops.py`) puts the
kernels behind `CopyOps`; `scripts/copy_reference.py` states each copy in pure torch (the oracle
of the kernel tests and of `scripts/gpu_check.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ragcache_core.storage.copy.base import TokenIndex
from ragcache_core.storage.paged_layout import StridedLayout

_TILE = 4096
"""Elements one token program moves at most per (token, layer): 2H x D tiles are cut in head
chunks so that large head counts do not spill registers."""

_SLOT_BLOCK_BYTES = 16384
"""Bytes one `copy_slots` program moves: enough in flight per program for PCIe (UVA) reads."""

_MAX_GRID = 2**31 - 1
"""Largest grid on axis 0 (CUDA's limit); axes 1 and 2 are at most 65535."""

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _token_tile(  # type: ignore[no-untyped-def]
    pool_slots_ptr,
    pool_rows_ptr,
    slot_mapping_ptr,
    pool_slot_numel,
    pool_layer_numel,
    pool_kv_numel,
    block_size,
    block_stride,
    head_stride,
    token_stride,
    kv_stride,
    dim_stride,
    layer_stride,
    layer0,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    KH_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
):
    """Pool and cache offsets [KH_BLOCK, D_BLOCK] (int64) of this program's tile, and its mask.

    Program (token i, layer j, chunk c) covers rows kh = c * KH_BLOCK + [0, KH_BLOCK) of the
    token's 2H (K/V, head) rows (k = kh // H, h = kh % H) and dims [0, D_BLOCK) of each, in
    pool layer `layer0 + j` and cache layer j (cache offsets from the launch's base pointer).
    """
    token = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    kh = tl.program_id(2).to(tl.int64) * KH_BLOCK + tl.arange(0, KH_BLOCK).to(tl.int64)  # [KH]
    d = tl.arange(0, D_BLOCK).to(tl.int64)  # [D_BLOCK]
    slot = tl.load(pool_slots_ptr + token)  # int64 scalars (TokenIndex is int64)
    row = tl.load(pool_rows_ptr + token)
    where = tl.load(slot_mapping_ptr + token)
    block = where // block_size
    offset = where % block_size
    k = kh // NUM_HEADS  # [KH]
    h = kh % NUM_HEADS  # [KH]
    # pool[slot, layer0 + layer, k, row, h, d] of a contiguous [S, L, 2, P, H, D] tensor.
    pool_row = (
        slot * pool_slot_numel
        + (layer + layer0) * pool_layer_numel
        + k * pool_kv_numel
        + row * (NUM_HEADS * HEAD_SIZE)
        + h * HEAD_SIZE
    )  # [KH]
    cache_row = (
        layer * layer_stride
        + block * block_stride
        + offset * token_stride
        + h * head_stride
        + k * kv_stride
    )  # [KH]
    pool_off = pool_row[:, None] + d[None, :]  # [KH, D_BLOCK]
    cache_off = cache_row[:, None] + d[None, :] * dim_stride  # [KH, D_BLOCK]
    mask = (kh < 2 * NUM_HEADS)[:, None] & (d < HEAD_SIZE)[None, :]  # [KH, D_BLOCK]
    return pool_off, cache_off, mask


@triton.jit
def _token_copy_kernel(  # type: ignore[no-untyped-def]
    pool_ptr,
    cache_ptr,
    pool_slots_ptr,
    pool_rows_ptr,
    slot_mapping_ptr,
    pool_slot_numel,
    pool_layer_numel,
    pool_kv_numel,
    block_size,
    block_stride,
    head_stride,
    token_stride,
    kv_stride,
    dim_stride,
    layer_stride,
    layer0,
    TO_CACHE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    KH_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
):
    """scatter (TO_CACHE: pool -> cache) or gather (cache -> pool) of one tile; grid
    (tokens, layers in this launch, head chunks)."""
    pool_off, cache_off, mask = _token_tile(
        pool_slots_ptr,
        pool_rows_ptr,
        slot_mapping_ptr,
        pool_slot_numel,
        pool_layer_numel,
        pool_kv_numel,
        block_size,
        block_stride,
        head_stride,
        token_stride,
        kv_stride,
        dim_stride,
        layer_stride,
        layer0,
        NUM_HEADS,
        HEAD_SIZE,
        KH_BLOCK,
        D_BLOCK,
    )
    if TO_CACHE:
        tl.store(cache_ptr + cache_off, tl.load(pool_ptr + pool_off, mask=mask), mask=mask)
    else:
        tl.store(pool_ptr + pool_off, tl.load(cache_ptr + cache_off, mask=mask), mask=mask)


@triton.jit
def _token_offsets_kernel(  # type: ignore[no-untyped-def]
    pool_out_ptr,
    cache_out_ptr,
    pool_slots_ptr,
    pool_rows_ptr,
    slot_mapping_ptr,
    pool_slot_numel,
    pool_layer_numel,
    pool_kv_numel,
    block_size,
    block_stride,
    head_stride,
    token_stride,
    kv_stride,
    dim_stride,
    layer_stride,
    layer0,
    num_layers,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    KH_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
):
    """Writes the offsets `_token_tile` computes (not the data) to [T, L, 2H, D] int64 outputs:
    the copy kernels' address arithmetic, observable without memory at those addresses."""
    pool_off, cache_off, mask = _token_tile(
        pool_slots_ptr,
        pool_rows_ptr,
        slot_mapping_ptr,
        pool_slot_numel,
        pool_layer_numel,
        pool_kv_numel,
        block_size,
        block_stride,
        head_stride,
        token_stride,
        kv_stride,
        dim_stride,
        layer_stride,
        layer0,
        NUM_HEADS,
        HEAD_SIZE,
        KH_BLOCK,
        D_BLOCK,
    )
    token = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    kh = tl.program_id(2).to(tl.int64) * KH_BLOCK + tl.arange(0, KH_BLOCK).to(tl.int64)
    d = tl.arange(0, D_BLOCK).to(tl.int64)
    out = ((token * num_layers + layer) * (2 * NUM_HEADS) + kh)[:, None] * HEAD_SIZE + d[None, :]
    tl.store(pool_out_ptr + out, pool_off, mask=mask)
    tl.store(cache_out_ptr + out, cache_off, mask=mask)


@triton.jit
def _slot_copy_kernel(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_ptr,
    src_slots_ptr,
    dst_slots_ptr,
    slot_numel,
    chunks_per_slot,
    BLOCK: tl.constexpr,
):
    """dst slot dst_slots[p] <- src slot src_slots[p], BLOCK elements per program; grid
    (pairs x chunks_per_slot,), program = pair * chunks_per_slot + chunk."""
    pid = tl.program_id(0).to(tl.int64)
    pair = pid // chunks_per_slot
    chunk = pid % chunks_per_slot
    src = tl.load(src_slots_ptr + pair)  # int64
    dst = tl.load(dst_slots_ptr + pair)  # int64
    i = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK]
    mask = i < slot_numel
    x = tl.load(src_ptr + src * slot_numel + i, mask=mask)  # [BLOCK]
    tl.store(dst_ptr + dst * slot_numel + i, x, mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MappedHost:
    """A registered (cudaHostRegister'ed) host tensor as a Triton pointer argument.

    Triton's CUDA launcher accepts any object with `data_ptr()` and `dtype` and translates
    the address with `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`, which
    succeeds for registered host memory under UVA (64-bit Linux): the kernel then reads and
    writes the host pages over PCIe. For an unregistered address Triton raises `ValueError`
    ("cannot be accessed from Triton (cpu tensor?)"). Holds `tensor` to keep it alive.
    """

    tensor: torch.Tensor
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return int(self.tensor.data_ptr())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width (a view; copies stay bit-exact)."""
    return tensor.view(_BITS[tensor.element_size()])


def _pointer(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | MappedHost:
    """`tensor` (as bits) as a kernel argument on `device`: itself, or a `MappedHost` for a
    CPU tensor when the kernel runs on CUDA (the caller guarantees it is registered)."""
    bits = _bits(tensor)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return MappedHost(bits, bits.dtype)
    return bits


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the index tensors' device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tile_shape(num_heads: int, head_size: int) -> tuple[int, int, int]:
    """(KH_BLOCK, D_BLOCK, head chunks) of the token kernels: whole (padded) head rows, as many
    of the 2H rows as fit in `_TILE` elements."""
    d_block = _next_pow2(head_size)
    kh_block = min(_next_pow2(2 * num_heads), max(1, _TILE // d_block))
    return kh_block, d_block, triton.cdiv(2 * num_heads, kh_block)


def _check_pool(pool: torch.Tensor, layout: StridedLayout, num_layers: int) -> None:
    """Raises `ValueError` unless `pool` is a contiguous [S, L, 2, P, H, D] of this layout."""
    if pool.dim() != 6 or not pool.is_contiguous():
        raise ValueError(f"pool must be a contiguous [S, L, 2, P, H, D] tensor, got {pool.shape}")
    _, layers, two, _, heads, dims = pool.shape
    if (layers, two, heads, dims) != (num_layers, 2, layout.num_heads, layout.head_size):
        raise ValueError(
            f"pool {tuple(pool.shape)} does not match the cache: {num_layers} layers, "
            f"{layout.num_heads} heads of size {layout.head_size}"
        )


def _check_index(index: TokenIndex, num_slots: int, page_size: int, num_tokens: int) -> None:
    """Raises `IndexError` when an index is out of range: the kernels do not bounds-check, and
    a wild address on CUDA is a sticky error that ends the process's CUDA context. Costs one
    device-to-host sync (of 6 numbers)."""
    stacked = torch.stack((index.pool_slots, index.pool_rows, index.slot_mapping))  # [3, T]
    low, high = torch.aminmax(stacked, dim=1)  # [3], [3]
    lows_highs = torch.cat((low, high)).tolist()  # the one sync
    limits = (num_slots, page_size, num_tokens)
    if min(lows_highs[:3]) >= 0 and all(h < n for h, n in zip(lows_highs[3:], limits, strict=True)):
        return
    bad = (stacked < 0).any(0)  # [T]
    for values, limit in zip(stacked, limits, strict=True):
        bad |= values >= limit
    i = int(bad.nonzero()[0, 0])
    raise IndexError(
        f"token {i}: pool slot {int(index.pool_slots[i])} of {num_slots}, row "
        f"{int(index.pool_rows[i])} of {page_size}, cache slot {int(index.slot_mapping[i])} "
        f"of {num_tokens}"
    )


def _layer_bases(
    flats: Sequence[torch.Tensor], layout: StridedLayout
) -> list[tuple[torch.Tensor, int, int, int]]:
    """Launches as (cache base, first layer, layers, layer stride): one launch over every
    layer when `layout.layer_stride` holds for these tensors' addresses, else one per layer."""
    stride = layout.layer_stride
    if stride is not None:
        step = stride * flats[0].element_size()
        base = flats[0].data_ptr()
        if all(f.data_ptr() == base + i * step for i, f in enumerate(flats)):
            return [(flats[0], 0, len(flats), stride)]
    return [(flat, layer, 1, 0) for layer, flat in enumerate(flats)]


def _token_copy(
    pool: torch.Tensor,
    flats: Sequence[torch.Tensor],
    layout: StridedLayout,
    index: TokenIndex,
    *,
    to_cache: bool,
) -> None:
    """The launches of `scatter_tokens` (to_cache) and `gather_tokens`."""
    if index.num_tokens == 0:
        return
    _check_pool(pool, layout, len(flats))
    if pool.dtype != flats[0].dtype or pool.element_size() != flats[0].element_size():
        raise ValueError(f"pool dtype {pool.dtype} != cache dtype {flats[0].dtype}")
    if any(t.dtype != torch.int64 for t in (index.pool_slots, index.pool_rows, index.slot_mapping)):
        raise ValueError("TokenIndex tensors must be int64 (the kernels' offsets are int64)")
    num_slots, _, _, page_size, heads, dims = pool.shape
    _check_index(index, num_slots, page_size, layout.num_blocks * layout.block_size)
    device = index.slot_mapping.device
    kh_block, d_block, chunks = _tile_shape(heads, dims)
    pool_arg = _pointer(pool, device)
    for base, layer0, layers, layer_stride in _layer_bases(flats, layout):
        with _on(device):
            _token_copy_kernel[(index.num_tokens, layers, chunks)](
                pool_arg,
                _bits(base),
                index.pool_slots,
                index.pool_rows,
                index.slot_mapping,
                pool[0].numel(),  # elements per slot
                pool[0, 0].numel(),  # per (slot, layer)
                pool[0, 0, 0].numel(),  # per (slot, layer, K/V)
                layout.block_size,
                layout.block_stride,
                layout.head_stride,
                layout.token_stride,
                layout.kv_stride,
                layout.dim_stride,
                layer_stride,
                layer0,
                TO_CACHE=to_cache,
                NUM_HEADS=heads,
                HEAD_SIZE=dims,
                KH_BLOCK=kh_block,
                D_BLOCK=d_block,
            )


def scatter_tokens(
    pool: torch.Tensor,
    flats: Sequence[torch.Tensor],
    layout: StridedLayout,
    index: TokenIndex,
) -> None:
    """Load: for every layer l and token i, the paged cache's K/V of vLLM slot
    `index.slot_mapping[i]` <- `pool[index.pool_slots[i], l, :, index.pool_rows[i]]`.

    Reads `pool` (contiguous [S, L, 2, P, H, D], on the index's device or a registered host
    tensor when that device is CUDA) and the index; writes only the addressed elements of
    `flats` (`LinearPagedKV.flats`, layer order, as laid out by `layout`). One launch covers
    every token, and every layer when `layout.layer_stride` holds. Asynchronous on CUDA.
    Raises `ValueError` for a pool that does not match the cache, `IndexError` for an index
    out of range (nothing written then).
    """
    _token_copy(pool, flats, layout, index, to_cache=True)


def gather_tokens(
    flats: Sequence[torch.Tensor],
    layout: StridedLayout,
    index: TokenIndex,
    pool: torch.Tensor,
) -> None:
    """Store: for every layer l and token i, `pool[index.pool_slots[i], l, :,
    index.pool_rows[i]]` <- the paged cache's K/V of vLLM slot `index.slot_mapping[i]`.

    The reverse of `scatter_tokens` (same arguments, same errors); reads `flats`, writes only
    the addressed pool rows.
    """
    _token_copy(pool, flats, layout, index, to_cache=False)


def kernel_offsets(
    pool_shape: Sequence[int], layout: StridedLayout, index: TokenIndex, num_layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The element offsets the token kernels address, computed by their own code:
    (pool offsets, cache offsets), each [T, L, 2, H, D] int64 on the index's device, for a
    launch over all `num_layers` layers from layer 0's base (the cache offset includes
    `l * layout.layer_stride`, 0 when None). Touches no pool or cache memory, so offsets past
    2^31 can be checked with tiny tensors (tests, under the interpreter)."""
    _, _, _, page_size, heads, dims = pool_shape
    device = index.slot_mapping.device
    out_shape = (index.num_tokens, num_layers, 2, heads, dims)
    pool_out = torch.zeros(out_shape, dtype=torch.int64, device=device)
    cache_out = torch.zeros(out_shape, dtype=torch.int64, device=device)
    if index.num_tokens == 0:
        return pool_out, cache_out
    kh_block, d_block, chunks = _tile_shape(heads, dims)
    kv_numel = page_size * heads * dims
    _token_offsets_kernel[(index.num_tokens, num_layers, chunks)](
        pool_out,
        cache_out,
        index.pool_slots,
        index.pool_rows,
        index.slot_mapping,
        num_layers * 2 * kv_numel,
        2 * kv_numel,
        kv_numel,
        layout.block_size,
        layout.block_stride,
        layout.head_stride,
        layout.token_stride,
        layout.kv_stride,
        layout.dim_stride,
        layout.layer_stride or 0,
        0,
        num_layers,
        NUM_HEADS=heads,
        HEAD_SIZE=dims,
        KH_BLOCK=kh_block,
        D_BLOCK=d_block,
    )
    return pool_out, cache_out


def check_pool_pair(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Raises `ValueError` unless both pools are contiguous with equal slots."""
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_slots needs contiguous pools")
    if src.shape[1:] != dst.shape[1:] or src.element_size() != dst.element_size():
        raise ValueError(f"slot shapes differ: {tuple(src.shape)} vs {tuple(dst.shape)}")


def copy_slots(
    src: torch.Tensor,
    src_slots: torch.Tensor,
    dst: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """dst[dst_slots[i]] <- src[src_slots[i]] for every i: whole slots (dim 0 of contiguous
    pools of equal slot shape and element size), one launch for all pairs.

    `src_slots`, `dst_slots` [n] are int64 on the device the kernel runs on. On CUDA either
    pool may be a host tensor registered with cudaHostRegister (the kernel reads/writes it
    through UVA); Triton raises `ValueError` if it is not registered. Asynchronous on CUDA.
    Raises `ValueError` for mismatched pools, `IndexError` for a slot out of range (nothing
    copied then). Pairs must not overlap (a destination slot that is also a source is a race).
    """
    n = int(src_slots.shape[0])
    if int(dst_slots.shape[0]) != n:
        raise ValueError(f"{n} source slots but {int(dst_slots.shape[0])} destination slots")
    check_pool_pair(src, dst)
    if src_slots.dtype != torch.int64 or dst_slots.dtype != torch.int64:
        raise ValueError("slot indices must be int64 (the kernel's offsets are int64)")
    if n == 0 or src.shape[1:].numel() == 0:
        return
    pairs = torch.stack((src_slots, dst_slots))  # [2, n]
    low, high = torch.aminmax(pairs, dim=1)  # [2], [2]
    lows_highs = torch.cat((low, high)).tolist()  # one sync
    if min(lows_highs[:2]) < 0 or lows_highs[2] >= src.shape[0] or lows_highs[3] >= dst.shape[0]:
        raise IndexError(
            f"slot out of range: sources {src_slots.tolist()[:8]} of {src.shape[0]}, targets "
            f"{dst_slots.tolist()[:8]} of {dst.shape[0]}"
        )
    launch_slot_copy(src, src_slots, dst, dst_slots)


def launch_slot_copy(
    src: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """The launches of `copy_slots`, indices already checked."""
    n, slot_numel = int(src_slots.shape[0]), src.shape[1:].numel()
    device = src_slots.device
    block = max(16, _SLOT_BLOCK_BYTES // src.element_size())
    chunks = triton.cdiv(slot_numel, block)
    src_arg, dst_arg = _pointer(src, device), _pointer(dst, device)
    per_launch = max(1, _MAX_GRID // chunks)  # pairs per launch within the grid limit
    for start in range(0, n, per_launch):
        stop = min(n, start + per_launch)
        with _on(device):
            _slot_copy_kernel[((stop - start) * chunks,)](
                src_arg,
                dst_arg,
                src_slots[start:stop],
                dst_slots[start:stop],
                slot_numel,
                chunks,
                BLOCK=block,
            )
