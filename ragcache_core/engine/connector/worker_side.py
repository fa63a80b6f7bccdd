"""Worker-side connector logic (runs in vLLM's worker process, beside the paged KV cache).

Owns the "GPU" pool (on the model's device) and maps the app's host pool. Per step, in this
order (docs/design.md 3.2):

    start_load_kv   1. swap_out  GPU pool -> host pool   (all requests of the step)
                    2. promote   host pool -> GPU pool
                    3. load      pool rows -> each request's paged KV rows
    (forward pass)
    wait_for_save   4. store     paged KV rows -> GPU pool (requests whose prompt completed)

Each kind of copy runs once per step for all requests (one index over every span of the step,
then one copy per layer, or one kernel launch on CUDA), not once per span and layer.

A load that raises marks the request's blocks from the failed span on as invalid; vLLM then
recomputes them (`kv_load_failure_policy="recompute"`), and this step's store for that request
is skipped (its forward pass read bad KV). The scheduler side re-sends the store when the
recomputation completes the prompt. A store that raises propagates: the step fails, so no
request whose store did not run ever produces a token (the app confirms stores at the first
token, see docs/data-plane.md).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.engine.connector.config import ConnectorConfig
from ragcache_core.engine.connector.metadata import RequestOps, StepOps, WorkerReport
from ragcache_core.engine.connector.spans import SpanRef, step_index
from ragcache_core.errors import ConfigError
from ragcache_core.plan import SlotCopy, Tier
from ragcache_core.storage.copy.base import CopyOps, PagedKV
from ragcache_core.storage.copy.factory import copy_ops_for
from ragcache_core.storage.host_pool import HostPool
from ragcache_core.storage.memory import available_host_bytes, check_fits

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class WorkerSide:
    """The pools and the copies. Created at connector start; `register` runs once vLLM has
    allocated its paged cache. Used only from the worker's model-runner thread."""

    def __init__(self, config: ConnectorConfig, block_size: int, backend: str = "unknown") -> None:
        self.config = config
        self.block_size = block_size
        self.backend = backend
        self.ops: CopyOps | None = None
        self.paged: PagedKV | None = None
        self.gpu_pool: torch.Tensor | None = None  # [gpu_slots, L, 2, P, H, D]
        self.host_pool: HostPool | None = None
        self._invalid_blocks: set[int] = set()
        self._failures: dict[str, int] = {}
        self._stored: set[str] = set()
        self._copy_s: dict[str, tuple[float, float]] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build token access to vLLM's paged cache and allocate/map the pools.

        The cache layout is read off the registered tensors (shape and strides on CUDA; a
        probe through vLLM's kernel on CPU), never assumed. Raises `ConfigError` when the
        model's KV shape differs from the configured layout, the layout is not supported, or
        the device pool does not fit in free memory (the numbers are in the message).
        """
        import torch

        from ragcache_core.engine.compat import layer_order
        from ragcache_core.storage.paged_layout import strided_paged_kv

        layout = self.config.layout
        caches = [kv_caches[name] for name in layer_order(list(kv_caches))]
        first = caches[0]
        device = first.device
        if device.type == "cpu":
            from ragcache_core.engine.paged_kv import cpu_paged_kv

            self.paged = cpu_paged_kv(caches, block_size=self.block_size)
            heads, head_size = int(first.shape[1]), int(first.shape[3]) // 2
        else:
            self.paged = strided_paged_kv(
                caches,
                block_size=self.block_size,
                num_kv_heads=layout.num_kv_heads,
                head_size=layout.head_size,
                backend=self.backend,
            )
            heads, head_size = layout.num_kv_heads, layout.head_size
        found = (len(caches), heads, head_size, str(first.dtype))
        wanted = (layout.num_layers, layout.num_kv_heads, layout.head_size, f"torch.{layout.dtype}")
        if found != wanted:
            raise ConfigError(
                f"RAGCache pools expect (layers, kv heads, head size, dtype) = {wanted}, "
                f"the engine's paged KV cache has {found}"
            )
        self.ops = copy_ops_for(device)
        gpu_bytes = layout.pool_bytes(self.config.gpu_slots)
        if device.type == "cuda":
            free = int(torch.cuda.mem_get_info(device)[0])
        else:
            free = available_host_bytes()
        check_fits("the device KV pool", gpu_bytes, free, "lower gpu_pool_tokens")
        dtype = getattr(torch, layout.dtype)
        self.gpu_pool = self.ops.allocate_pool(layout.pool_shape(self.config.gpu_slots), dtype)
        if self.config.host_slots:
            self.host_pool = HostPool.attach(
                self.config.host_pool_name, layout, self.config.host_slots
            )
            self.ops.register_host(self.host_pool.tensor)
        logger.info(
            "RAGCache pools: %d device slots (%.1f MiB on %s), %d host slots, page %d tokens, "
            "copies by %s",
            self.config.gpu_slots,
            gpu_bytes / 2**20,
            device,
            self.config.host_slots,
            layout.page_size,
            type(self.ops).__name__,
        )

    def begin_step(self) -> None:
        self._invalid_blocks = set()
        self._failures = {}
        self._stored = set()
        self._copy_s = {}

    def load(self, step: StepOps) -> None:
        """Copies before the forward pass: every swap_out, then every promote, then every
        load of the step (one index per pool tier)."""
        if not step.requests:
            return
        started = time.perf_counter()
        ops, paged, gpu = self._ready()
        swap_out = [c for r in step.requests for c in r.swap_out]
        if swap_out:
            ops.copy_pages(gpu, _sources(swap_out), self._host(), _destinations(swap_out))
        promote = [c for r in step.requests for c in r.promote]
        if promote:
            ops.copy_pages(self._host(), _sources(promote), gpu, _destinations(promote))
        spans: dict[Tier, list[tuple[RequestOps, int, SpanRef]]] = {Tier.GPU: [], Tier.HOST: []}
        for request in step.requests:
            injected = min(request.fail_load_span, default=len(request.load))
            for i, span in enumerate(request.load[:injected]):
                ref = SpanRef(
                    span.slots,
                    span.token_start,
                    span.num_tokens,
                    request.load_lo,
                    request.load_hi,
                    request.block_ids,
                )
                spans[span.tier].append((request, i, ref))
            if injected < len(request.load):
                logger.error("RAGCache: injected failure in load span %d", injected)
                self._fail(request, injected)
        for tier, refs in spans.items():
            if refs:
                self._load_tier(tier, refs, ops, paged, gpu)
        ops.synchronize()
        elapsed = time.perf_counter() - started
        for request in step.requests:
            self._copy_s[request.req_id] = (elapsed, 0.0)

    def store(self, step: StepOps) -> None:
        """Copies after the forward pass: every completed prompt's store spans -> GPU pool,
        in one index for the step. Raises whatever the copy raises (the step fails)."""
        requests = [r for r in step.requests if r.store and r.req_id not in self._failures]
        if not requests:
            return
        started = time.perf_counter()
        ops, paged, gpu = self._ready()
        refs = [
            SpanRef(span.slots, span.token_start, span.num_tokens, 0, 1 << 62, r.block_ids)
            for r in requests
            for span in r.store
        ]
        index = step_index(
            refs, block_size=self.block_size, page_size=self.config.page_size, device=ops.device
        )
        ops.store(paged, index, gpu)
        ops.synchronize()
        elapsed = time.perf_counter() - started
        for r in requests:
            self._stored.add(r.req_id)
            load_s = self._copy_s.get(r.req_id, (0.0, 0.0))[0]
            self._copy_s[r.req_id] = (load_s, elapsed)

    def invalid_block_ids(self) -> set[int]:
        return set(self._invalid_blocks)

    def report(self) -> WorkerReport | None:
        if not (self._failures or self._stored or self._copy_s):
            return None
        return WorkerReport(dict(self._failures), set(self._stored), dict(self._copy_s))

    def close(self) -> None:
        if self.host_pool is not None:
            if self.ops is not None:
                self.ops.unregister_host(self.host_pool.tensor)
            self.host_pool.close()
            self.host_pool = None
        self.gpu_pool = None

    def _load_tier(
        self,
        tier: Tier,
        refs: list[tuple[RequestOps, int, SpanRef]],
        ops: CopyOps,
        paged: PagedKV,
        gpu: torch.Tensor,
    ) -> None:
        """One load of every span read from `tier`; on failure every request with a span in
        it recomputes from its first such span."""
        try:
            index = step_index(
                [ref for _, _, ref in refs],
                block_size=self.block_size,
                page_size=self.config.page_size,
                device=ops.device,
            )
            ops.load(gpu if tier is Tier.GPU else self._host(), index, paged)
        except Exception:
            logger.exception("RAGCache load from the %s pool failed", tier)
            for request, i, _ in refs:
                self._fail(request, i)

    def _fail(self, request: RequestOps, span: int) -> None:
        """Load span `span` of `request` (and what follows it) is not trustworthy: vLLM
        recomputes from the block holding its first loaded token."""
        if request.req_id in self._failures and self._failures[request.req_id] <= span:
            return
        first = max(request.load[span].token_start, request.load_lo) // self.block_size
        last = slots_for_tokens(request.load_hi, self.block_size)  # blocks up to load_hi
        self._invalid_blocks.update(request.block_ids[first:last])
        self._failures[request.req_id] = span

    def _ready(self) -> tuple[CopyOps, PagedKV, torch.Tensor]:
        if self.ops is None or self.gpu_pool is None or self.paged is None:
            raise RuntimeError("RAGCache connector used before register_kv_caches")
        return self.ops, self.paged, self.gpu_pool

    def _host(self) -> torch.Tensor:
        if self.host_pool is None:
            raise RuntimeError("plan uses the host pool but the engine was started without one")
        return self.host_pool.tensor


def _sources(copies: list[SlotCopy]) -> list[int]:
    return [slot for c in copies for slot in c.src_slots]


def _destinations(copies: list[SlotCopy]) -> list[int]:
    return [slot for c in copies for slot in c.dst_slots]
