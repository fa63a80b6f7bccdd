"""Worker-side connector logic (runs in vLLM's worker process, beside the paged KV cache).

Maps the app's host pool; there is no GPU pool: the GPU tier is vLLM's own paged KV cache
with its prefix caching on, so a GPU hit is a block vLLM already holds and moves no byte.
Per step, in this order (docs/design.md 3.2):

    start_load_kv   handout  eviction-time copies of the documents vLLM handed blocks of out
                           for this step: blocks -> leased host slots (`HostWrite`), before
                           anything of the step writes those blocks
                    load   host pool rows -> each request's paged KV rows (the tokens past
                           vLLM's own prefix-cache hit)
    (forward pass)
    wait_for_save   store  paged KV rows -> host pool (requests whose prompt completed)
                    lookahead  the window's look-ahead copies: blocks the scheduler side
                           holds -> leased host slots
    (report)        the step's time and each kind of copy's time and bytes (`StepCosts`)

Each kind of copy runs once per step for all requests (one index over every span of the step,
then one copy per layer, or one kernel launch on CUDA), not once per span and layer.

A load that raises marks the request's blocks from the failed span on as invalid; vLLM then
recomputes them (`kv_load_failure_policy="recompute"`), the scheduler side evicts their hashes
from vLLM's prefix cache (no later request matches them), and this step's store for that
request is skipped (its forward pass read bad KV). The scheduler side re-sends the store when
the recomputation completes the prompt. A store that raises propagates: the step fails, so no
request whose store did not run ever produces a token (the app confirms stores at the first
token, see docs/data-plane.md). A host write that raises does not fail the step: it is reported
not run, and the tree never reads its slots.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.engine.connector.config import ConnectorConfig
from ragcache_core.engine.connector.metadata import HostWrite, RequestOps, StepOps, WorkerReport
from ragcache_core.engine.connector.spans import SpanRef, step_index
from ragcache_core.engine.connector.step_costs import NO_STEPS, StepCosts
from ragcache_core.errors import ConfigError
from ragcache_core.storage.copy.base import CopyOps, PagedKV
from ragcache_core.storage.copy.factory import copy_ops_for
from ragcache_core.storage.host_pool import HostPool

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class WorkerSide:
    """The host pool and the copies. Created at connector start; `register` runs once vLLM has
    allocated its paged cache. Used only from the worker's model-runner thread."""

    def __init__(self, config: ConnectorConfig, block_size: int, backend: str = "unknown") -> None:
        self.config = config
        self.block_size = block_size
        self.backend = backend
        self.ops: CopyOps | None = None
        self.paged: PagedKV | None = None
        self.host_pool: HostPool | None = None
        self._invalid_blocks: set[int] = set()
        self._failures: dict[str, int] = {}
        self._stored: set[str] = set()
        self._copy_s: dict[str, tuple[float, float]] = {}
        self._host_written: set[int] = set()
        self._host_writes = False
        self._window_s = 0.0
        self._step_started = 0.0
        self._copies: dict[str, tuple[float, int]] = {}
        """This step's copies by kind (`step_costs.COPY_KINDS`): (seconds, bytes)."""
        self.costs: StepCosts = NO_STEPS
        """Every step this worker ran, and its copies (cumulative, in every report)."""

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build token access to vLLM's paged cache and map the host pool.

        The cache layout is read off the registered tensors (shape and strides on CUDA; a
        probe through vLLM's kernel on CPU), never assumed. Raises `ConfigError` when the
        model's KV shape differs from the configured layout or the layout is not supported.
        """
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
        if self.config.host_slots:
            self.host_pool = HostPool.attach(
                self.config.host_pool_name, layout, self.config.host_slots
            )
            self.ops.register_host(self.host_pool.tensor)
        logger.info(
            "RAGCache host pool: %d slots, page %d tokens, paged KV on %s, copies by %s",
            self.config.host_slots,
            layout.page_size,
            device,
            type(self.ops).__name__,
        )

    def begin_step(self) -> None:
        self._invalid_blocks = set()
        self._failures = {}
        self._stored = set()
        self._copy_s = {}
        self._host_written = set()
        self._host_writes = False
        self._window_s = 0.0
        self._copies = {}
        self._step_started = time.perf_counter()

    def load(self, step: StepOps) -> None:
        """Copies before the forward pass: the documents vLLM handed blocks of out for this
        step (those blocks still hold them: the loads and the forward pass write them next),
        then every load of the step, in one index."""
        if step.handout_writes:
            self.write_evicted(step.handout_writes, kind="handout")
        if not step.requests:
            return
        started = time.perf_counter()
        ops, paged = self._ready()
        refs: list[tuple[RequestOps, int, SpanRef]] = []
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
                refs.append((request, i, ref))
            if injected < len(request.load):
                logger.error("RAGCache: injected failure in load span %d", injected)
                self._fail(request, injected)
        tokens = self._load(refs, ops, paged) if refs else 0
        ops.synchronize()
        elapsed = time.perf_counter() - started
        if tokens:
            self._count("load", elapsed, tokens)
        for request in step.requests:
            self._copy_s[request.req_id] = (elapsed, 0.0)

    def store(self, step: StepOps) -> None:
        """Copies after the forward pass: every completed prompt's store spans -> host pool,
        in one index for the step (raises whatever the copy raises: the step fails); then the
        window's look-ahead host writes (`write_evicted`)."""
        self._store(step)
        if step.host_writes:
            self.write_evicted(step.host_writes, kind="lookahead")

    def write_evicted(self, writes: list[HostWrite], *, kind: str) -> None:
        """Eviction-time copies (`kind`: "handout" or "lookahead"), in one index; a copy that
        raises is reported not run (with every copy of the call) and does not fail the step.
        `fail` copies run, then are reported not run (test hook: written slots that must never
        be read)."""
        self._host_writes = True
        started = time.perf_counter()
        ops, paged = self._ready()
        refs = [
            SpanRef(w.slots, w.token_start, w.num_tokens, 0, 1 << 62, w.block_ids) for w in writes
        ]
        kill = any(w.kill for w in writes)
        if kill:
            refs = refs[: max(1, len(refs) // 2)]
        try:
            index = step_index(
                refs, block_size=self.block_size, page_size=self.config.page_size, device=ops.device
            )
            ops.store(paged, index, self._host())
            ops.synchronize()
            if kill:
                logger.error("RAGCache: injected kill in the step's host writes")
                os.kill(os.getpid(), signal.SIGKILL)
        except Exception:
            logger.exception("RAGCache: eviction-time copies to the host pool failed")
            return
        finally:
            elapsed = time.perf_counter() - started
            self._window_s += elapsed
            self._count(kind, elapsed, sum(w.num_tokens for w in writes))
        for write in writes:
            if write.fail:
                logger.error("RAGCache: injected failure in the host write of key %d", write.key)
            else:
                self._host_written.add(write.key)

    def _store(self, step: StepOps) -> None:
        requests = [r for r in step.requests if r.store and r.req_id not in self._failures]
        if not requests:
            return
        started = time.perf_counter()
        ops, paged = self._ready()
        refs = [
            SpanRef(span.slots, span.token_start, span.num_tokens, 0, 1 << 62, r.block_ids)
            for r in requests
            for span in r.store
        ]
        index = step_index(
            refs, block_size=self.block_size, page_size=self.config.page_size, device=ops.device
        )
        ops.store(paged, index, self._host())
        ops.synchronize()
        elapsed = time.perf_counter() - started
        self._count("store", elapsed, index.num_tokens)
        for r in requests:
            self._stored.add(r.req_id)
            load_s = self._copy_s.get(r.req_id, (0.0, 0.0))[0]
            self._copy_s[r.req_id] = (load_s, elapsed)

    def invalid_block_ids(self) -> set[int]:
        return set(self._invalid_blocks)

    def report(self) -> WorkerReport:
        """The step's report (every step: it carries the step costs, `StepCosts`)."""
        self.costs = self.costs.add_step(time.perf_counter() - self._step_started, self._copies)
        return WorkerReport(
            dict(self._failures),
            set(self._stored),
            dict(self._copy_s),
            set(self._host_written),
            self._window_s,
            self.costs,
        )

    def _count(self, kind: str, seconds: float, tokens: int) -> None:
        """This step's copies of `kind` took `seconds` more and moved `tokens` more."""
        spent, moved = self._copies.get(kind, (0.0, 0))
        self._copies[kind] = (spent + seconds, moved + tokens * self.config.layout.token_bytes)

    def close(self) -> None:
        if self.host_pool is not None:
            if self.ops is not None:
                self.ops.unregister_host(self.host_pool.tensor)
            self.host_pool.close()
            self.host_pool = None

    def _load(
        self, refs: list[tuple[RequestOps, int, SpanRef]], ops: CopyOps, paged: PagedKV
    ) -> int:
        """One load of every span of the step; on failure every request with a span in it
        recomputes from its first span. Returns the tokens loaded (0 on failure)."""
        try:
            index = step_index(
                [ref for _, _, ref in refs],
                block_size=self.block_size,
                page_size=self.config.page_size,
                device=ops.device,
            )
            ops.load(self._host(), index, paged)
        except Exception:
            logger.exception("RAGCache load from the host pool failed")
            for request, i, _ in refs:
                self._fail(request, i)
            return 0
        return index.num_tokens

    def _fail(self, request: RequestOps, span: int) -> None:
        """Load span `span` of `request` (and what follows it) is not trustworthy: vLLM
        recomputes from the block holding its first loaded token."""
        if request.req_id in self._failures and self._failures[request.req_id] <= span:
            return
        first = max(request.load[span].token_start, request.load_lo) // self.block_size
        last = slots_for_tokens(request.load_hi, self.block_size)  # blocks up to load_hi
        self._invalid_blocks.update(request.block_ids[first:last])
        self._failures[request.req_id] = span

    def _ready(self) -> tuple[CopyOps, PagedKV]:
        if self.ops is None or self.paged is None:
            raise RuntimeError("RAGCache connector used before register_kv_caches")
        return self.ops, self.paged

    def _host(self) -> torch.Tensor:
        if self.host_pool is None:
            raise RuntimeError("plan uses the host pool but the engine was started without one")
        return self.host_pool.tensor
