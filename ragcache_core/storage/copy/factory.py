"""`copy_ops_for`: the `CopyOps` implementation for a device (the only module that imports the
implementations, inside the function, so nothing below it imports upwards)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ragcache_core.storage.copy.base import CopyOps


def copy_ops_for(device: torch.device) -> CopyOps:
    """The copy implementation for `device`: Triton kernels on CUDA (one launch per step and
    layer group), torch indexing elsewhere (Triton has no CPU backend)."""
    if device.type == "cuda":
        try:
            from ragcache_core.storage.copy.triton_ops import TritonCopyOps
        except ImportError as exc:  # Triton missing: the torch path is correct, only slower
            import logging

            logging.getLogger(__name__).warning("Triton unavailable (%s): torch copies", exc)
        else:
            return TritonCopyOps(device)
    from ragcache_core.storage.copy.torch_ops import TorchCopyOps

    return TorchCopyOps(device)
