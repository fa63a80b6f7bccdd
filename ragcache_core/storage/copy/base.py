"""Device-specific KV copies behind one small interface (`CopyOps`).

Three kinds of copy exist, all driven by index tensors built from a plan:

    copy_pages  whole slots between pools        (stages the host slots a load reads on the device)
    load        pool rows -> paged KV rows       LoadSpan: (slot, row) -> (block, offset)
    store       paged KV rows -> pool rows       StoreSpan: (block, offset) -> (slot, row)

Paged KV tokens are addressed by vLLM's slot mapping (`block_id * block_size + offset`), so a
document boundary can fall anywhere inside a block. `TorchCopyOps` (torch_ops.py) implements
all three with torch indexing for CPU and CUDA; `TritonCopyOps` (triton_ops.py, over the
kernels of triton_kernels.py) on CUDA; `copy_ops_for` (factory.py) picks one per device. This
module holds the interfaces and the index helpers they share; it imports no implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class TokenLocation(Protocol):
    """Tokens located in a paged cache (opaque to the pools)."""

    slot_mapping: torch.Tensor


class PagedKV(Protocol):
    """Token-level access to every attention layer of vLLM's paged cache (see
    `ragcache_core.storage.paged_layout.LinearPagedKV`, built per attention backend)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_layers(self) -> int: ...

    def locate(self, slot_mapping: torch.Tensor) -> TokenLocation:
        """The tokens at `slot_mapping` [T] (block * block_size + offset)."""
        ...

    def read(self, layer: int, where: TokenLocation) -> torch.Tensor:
        """K and V of the located tokens of `layer`: [T, 2, H, D]."""
        ...

    def read_into(
        self, layer: int, where: TokenLocation, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """K and V of the located tokens of `layer` into `key`, `value` (contiguous
        [T, H, D]): `read` without allocating."""
        ...

    def write(
        self, layer: int, where: TokenLocation, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Overwrite the located tokens of `layer` with `key`, `value` [T, H, D]."""
        ...


@dataclass(frozen=True, slots=True)
class TokenIndex:
    """Row-to-row index of one copy between a pool and the paged cache: token i is row
    `pool_rows[i]` of slot `pool_slots[i]` and vLLM slot `slot_mapping[i]`
    (block * block_size + offset). Int64 tensors of length T on the paged cache's device."""

    pool_slots: torch.Tensor  # [T]
    pool_rows: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]

    @property
    def num_tokens(self) -> int:
        return int(self.pool_slots.shape[0])


class CopyOps(Protocol):
    """Copies between pools ([slots, L, 2, P, H, D]) and vLLM's paged cache.

    Calls may be asynchronous on accelerators; `synchronize()` waits for all of them. Each
    call only reads its sources and writes its destinations; indices must be in range
    (raises `IndexError`/`RuntimeError` otherwise, possibly after a partial write).
    """

    device: torch.device

    def register_host(self, tensor: torch.Tensor) -> None:
        """Make a host tensor fast to copy from/to the device (pin it). No-op on CPU."""
        ...

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo `register_host` (before the host tensor is unmapped). No-op on CPU."""
        ...

    def copy_pages(
        self,
        src: torch.Tensor,
        src_slots: Sequence[int],
        dst: torch.Tensor,
        dst_slots: Sequence[int],
    ) -> None:
        """dst[dst_slots[i]] = src[src_slots[i]] (whole slots, possibly across devices)."""
        ...

    def load(self, pool: torch.Tensor, index: TokenIndex, paged: PagedKV) -> None:
        """For every layer l: paged tokens <- pool[:, l] rows (pool may be on the host)."""
        ...

    def store(self, paged: PagedKV, index: TokenIndex, pool: torch.Tensor) -> None:
        """For every layer l: pool[:, l] rows <- paged tokens (pool on the paged device)."""
        ...

    def synchronize(self) -> None: ...


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group slot pairs into runs (src_start, dst_start, length) where both sides advance by
    one: slots are allocated in runs, and one slice copy per run beats a gather."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def pool_rows(
    index: TokenIndex, pool_shape: Sequence[int], layers: range | None = None
) -> torch.Tensor:
    """Row numbers [len(layers), 2, T] of the index's tokens in a contiguous pool of
    `pool_shape` [S, L, 2, P, H, D] viewed as rows of H * D elements (every layer when
    `layers` is None): row ((slot * L + l) * 2 + k) * P + r holds K (k = 0) or V (k = 1) of
    layer l of the token at (slot, r)."""
    import torch

    _, num_layers, _, page, _, _ = pool_shape
    wanted = range(num_layers) if layers is None else layers
    device = index.pool_slots.device
    layer = torch.arange(wanted.start, wanted.stop, device=device)[:, None, None]  # [G, 1, 1]
    kv = torch.arange(2, device=device)[None, :, None]  # [1, 2, 1]
    slots = index.pool_slots[None, None, :]  # [1, 1, T]
    return ((slots * num_layers + layer) * 2 + kv) * page + index.pool_rows[None, None, :]


STAGING_BYTES = 256 * 2**20
"""A staging tensor holds this much at most: a step's layers go through it in groups."""


def layer_groups(num_layers: int, per_layer_bytes: int) -> list[range]:
    """Consecutive layers in groups whose K and V fit `STAGING_BYTES` (one layer at least)."""
    size = max(1, min(num_layers, STAGING_BYTES // max(1, per_layer_bytes)))
    return [range(i, min(i + size, num_layers)) for i in range(0, num_layers, size)]


def check_slots(what: str, slots: Sequence[int], capacity: int) -> None:
    """Raise `IndexError` for a slot outside 0..capacity-1 (host-side: no device sync)."""
    bad = [s for s in slots if not 0 <= s < capacity]
    if bad:
        raise IndexError(f"{what} slot(s) {bad[:4]} out of range 0..{capacity - 1}")
