"""Scheduler-side connector logic (runs in vLLM's engine-core process).

vLLM's prefix caching is on: it matches its own cached blocks first (the GPU tier) and asks
how many tokens past that hit the connector will load (`get_num_new_matched_tokens`). This
side reads each request's plan from `kv_transfer_params`, answers with the host-tier tokens
past vLLM's hit, and puts each request's copies into the step where they must run:

    first step the request is scheduled   load (when vLLM accepted the external tokens)
    step whose forward completes prompt   store (the prompt's KV is then final in paged KV)

A load that failed leaves vLLM's prefix cache holding hashes of blocks with bad KV (under
`kv_load_failure_policy="recompute"` vLLM keeps them for the recomputation): this side evicts
those hashes, from the failed block to the request's last, through the block pool vLLM binds
(`bind_gpu_block_pool`), before the next step is scheduled, so no later request matches them.

Eviction-time host writes (`host_write="eviction"`, docs/design.md 2.2) are the
`EvictionWindow`'s (window.py): a finished request's keep spans are recorded, the window is
scanned every step, its copies ride in the step's metadata, and what it copied or let go, and
which recorded documents left vLLM's blocks, ride on the next report of any request.

It decides nothing about what is cached: the plan says which slots and which documents (the
app's policy decides host admission and host eviction), and vLLM's LRU decides what leaves its
blocks; this side executes. Pure Python over vLLM's scheduler objects; no tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from ragcache_core.engine.connector.config import FAULT_KEY, RESULT_KEY, ConnectorConfig
from ragcache_core.engine.connector.metadata import RequestOps, StepOps, WorkerReport
from ragcache_core.engine.connector.report import ConnectorResult
from ragcache_core.engine.connector.spans import plan_problems
from ragcache_core.engine.connector.step_costs import NO_STEPS, StepCosts
from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.plan import PLAN_KEY, LoadSpan, Plan, StoreSpan, WindowLosses

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """What the scheduler side knows about one request with a plan."""

    plan: Plan
    prompt_len: int
    problems: tuple[str, ...]
    fail_load_span: tuple[int, ...]
    fail_host_write: bool = False
    kill_host_write: bool = False
    block_ids: list[int] = field(default_factory=list)
    query_start: int = 0
    load_lo: int = 0
    load_hi: int = 0
    loaded_end: int = 0
    """End of the prompt prefix actually served from the host pool (after failures)."""
    local_tokens: int = 0
    """vLLM's own prefix-cache hit (the GPU tier), block-aligned, at its first scheduling."""
    external_at_first: int | None = None
    """The tokens vLLM accepted from the connector at the request's first scheduling: what
    its `num_cached_tokens` counts beside its own hit (vLLM reports the first scheduling's
    counts; a preempted request that loads again does not change them)."""
    overwritten_tokens: int = 0
    """Tokens past vLLM's hit the plan would have loaded that this side refused at the last
    scheduling: their host copy, a lease victim, was overwritten before the plan's tree heard
    of it (`EvictionWindow.load_limit`); vLLM computed them."""
    copied_load: tuple[LoadSpan, ...] = ()
    """Load spans past the plan's, from copies the window made that the plan's tree had not
    applied (`EvictionWindow.copied_loads`), as accepted at the last scheduling."""
    load_pending: bool = False
    store_sent: bool = False
    failed_spans: list[int] = field(default_factory=list)
    store_ran: bool = False
    """The store ran: the worker's `WorkerReport` said so, or the request finished in the
    step that stored (`finished`)."""
    load_copy_s: float = 0.0
    store_copy_s: float = 0.0
    window_copy_s: float = 0.0
    """Seconds of the window's eviction-time copies in the steps that computed this request's
    prompt (they ran after those steps' forward passes)."""

    @property
    def num_loadable(self) -> int:
        # vLLM computes at least the last prompt token itself.
        return min(self.plan.num_loaded_tokens, self.prompt_len - 1)


class SchedulerSide:
    """State of the requests carrying plans, keyed by vLLM request id. Mutated only by vLLM's
    scheduler thread, through the methods below (which mirror `KVConnectorBase_V1`)."""

    def __init__(self, config: ConnectorConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self._tracked: dict[str, _Tracked] = {}
        self._unconfirmed_stores: set[str] = set()
        """Requests reported stored at `finished` before their step's worker report came."""
        self._prefilling: set[str] = set()
        """The requests that the last built step computes prompt tokens of."""
        self.block_pool: Any = None
        """vLLM's `BlockPool`, bound by vLLM at scheduler start (`bind_block_pool`)."""
        self.window: EvictionWindow | None = (
            EvictionWindow(
                window_blocks=config.window_blocks,
                block_size=block_size,
                page_size=config.page_size,
                back_to_head=config.back_to_head,
                handout=config.handout,
            )
            if config.host_write == "eviction"
            else None
        )
        """The eviction window (None: the host tier is written at compute, by store spans)."""
        self.steps: StepCosts = NO_STEPS
        """The workers' steps and copies, as their latest report said (cumulative)."""

    def release_all(self) -> bool:
        """vLLM's `reset_cache` (`reset_prefix_cache(reset_connector=True)`, which `clear()`
        sends): forget the eviction window's records (its held blocks go back). Returns True
        (vLLM reads False as a refusal)."""
        if self.window is not None and self.block_pool is not None:
            self.window.reset(self.block_pool)
        return True

    def bind_block_pool(self, block_pool: Any) -> None:
        """vLLM's GPU block pool: where failed loads' hashes are evicted (`on_worker_report`)."""
        self.block_pool = block_pool

    def track_and_count_loads(
        self, req_id: str, params: dict[str, Any] | None, prompt_len: int, num_computed: int
    ) -> int:
        """vLLM's `get_num_new_matched_tokens`: tokens past `num_computed` the worker will load.
        Mutates: parses, checks and tracks the request's plan on first sight, and records
        `num_computed` as where this scheduling's loads start (read by `after_alloc`). Zero once
        the prompt was completed (a preempted request that already produced a token
        recomputes: its plan's pins may be gone)."""
        tracked = self._track(req_id, params, prompt_len)
        if tracked is None or tracked.problems or tracked.store_sent:
            return 0
        tracked.query_start = num_computed
        loadable = tracked.num_loadable
        window, plan = self.window, tracked.plan
        limit = window.load_limit(plan) if window is not None else None
        tracked.overwritten_tokens, tracked.copied_load = 0, ()
        if limit is not None and limit < loadable:
            tracked.overwritten_tokens = loadable - max(limit, num_computed, 0)
            loadable = limit
        elif window is not None and loadable == plan.num_loaded_tokens:
            tracked.copied_load = window.copied_loads(plan, loadable)
            if tracked.copied_load:
                last = tracked.copied_load[-1]
                loadable = min(last.token_start + last.num_tokens, tracked.prompt_len - 1)
        return max(0, loadable - num_computed)

    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        tracked = self._tracked.get(req_id)
        if tracked is None or tracked.problems or tracked.store_sent:
            return
        if tracked.external_at_first is None:
            tracked.local_tokens = tracked.query_start
            tracked.external_at_first = max(num_external_tokens, 0)
        if num_external_tokens <= 0:
            return
        tracked.load_lo = tracked.query_start
        tracked.load_hi = tracked.query_start + num_external_tokens
        tracked.loaded_end = tracked.load_hi
        tracked.load_pending = True

    def build_step(self, scheduler_output: Any) -> StepOps:
        """This step's copies for every scheduled request with a plan, and the eviction
        window's. Flags `scheduler_output.has_sync_kv_loads` when the step loads or copies at
        hand-out (both in `start_load_kv`, which must then precede the forward pass)."""
        step = StepOps()
        self._prefilling = set()
        num_scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            if new.num_computed_tokens < tracked.prompt_len:
                self._prefilling.add(new.req_id)
            ops = self._ops(new.req_id, tracked, new.num_computed_tokens, num_scheduled)
            if ops is not None:
                step.requests.append(ops)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # A resumed (preempted) request gets its whole block list anew.
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            if cached.num_computed_tokens[i] < tracked.prompt_len:
                self._prefilling.add(req_id)
            ops = self._ops(req_id, tracked, cached.num_computed_tokens[i], num_scheduled)
            if ops is not None:
                step.requests.append(ops)
        if self.window is not None and self.block_pool is not None:
            reading = frozenset(
                slot for ops in step.requests for span in ops.load for slot in span.slots
            )
            step.handout_writes, step.host_writes = self.window.step_writes(
                self.block_pool, reading
            )
        if step.handout_writes or any(ops.load for ops in step.requests):
            # vLLM calls `start_load_kv` after the forward pass in a step it counts no
            # synchronous load in (a new request with external tokens): the copies at hand-out
            # would read blocks the forward pass has just overwritten. They and the loads run
            # in `start_load_kv` and must precede the forward pass (as HiSparse's connector
            # flags its steps).
            scheduler_output.has_sync_kv_loads = True
        return step

    def on_worker_report(self, report: object) -> None:
        """A step's outcome (vLLM calls it after a step whose workers had something to
        report; a store that ran always has). Load failures: vLLM recomputes from the failed
        span's block, so the prompt will be completed again and the store must be sent again
        then, and the failed blocks' hashes (from the failed span's block to the request's
        last block) leave vLLM's prefix cache now. Stores that ran and copy times are
        recorded for the request's final report; a store counted at `finished` that the next
        report lacks is logged as the bug it would be."""
        if self.window is not None and self.block_pool is not None:
            written = report.host_written if isinstance(report, WorkerReport) else set()
            self.window.on_report(written, self.block_pool)
        unconfirmed, self._unconfirmed_stores = self._unconfirmed_stores, set()
        if isinstance(report, WorkerReport):
            unconfirmed -= report.stored
        for req_id in sorted(unconfirmed):
            logger.error("RAGCache: request %s finished, but its store did not run", req_id)
        if not isinstance(report, WorkerReport):
            return
        self.steps = report.steps
        for req_id, (load_s, store_s) in report.copy_s.items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.load_copy_s += load_s
                tracked.store_copy_s += store_s
        if report.window_copy_s:
            for req_id in self._prefilling:
                tracked = self._tracked.get(req_id)
                if tracked is not None:
                    tracked.window_copy_s += report.window_copy_s
        for req_id in report.stored:
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.store_ran = True
        for req_id, span in report.load_failures.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            tracked.failed_spans.append(span)
            tracked.store_sent = False
            tracked.store_ran = False
            loads = tracked.plan.load + tracked.copied_load
            first = max(loads[span].token_start, tracked.load_lo)
            tracked.loaded_end = min(tracked.loaded_end, first - first % self.block_size)
            self._evict_from(tracked, first // self.block_size)

    def _evict_from(self, tracked: _Tracked, first_block: int) -> None:
        """Drop the prefix-cache hashes of `tracked`'s blocks from `first_block` on: they were
        loaded wrong or computed over KV loaded wrong. The request keeps the blocks and
        recomputes them; no other request can match them any more."""
        bad = set(tracked.block_ids[first_block:])
        if not bad:
            return
        if self.block_pool is None:
            raise RuntimeError(
                "RAGCache: a load failed but vLLM bound no block pool to evict its blocks from"
            )
        self.block_pool.evict_blocks(bad)

    def finished(self, req_id: str, *, aborted: bool = False) -> dict[str, Any] | None:
        """Forget the request; its report for `RequestOutput.kv_transfer_params`. A request
        that completed its prompt and was not `aborted` has its keep spans recorded for the
        eviction window first.

        A store sent in this step counts as run: vLLM calls this hook (`request_finished`)
        before the same step's worker report reaches `on_worker_report`, and a `max_tokens=1`
        request finishes in the step that stores it. It has run by now: scheduling is
        synchronous (step N+1 is scheduled after step N's output: no async scheduling, no
        pipeline parallelism, no speculative decoding, `RESERVED_EXTRA`), the worker's store is
        synchronous and a failing one fails the step, and the worker skips a store only for a
        request whose load failed in that step, which vLLM does not finish in that step
        (`update_from_output` skips it). The step's report is still checked."""
        tracked = self._tracked.pop(req_id, None)
        if tracked is None:
            return None
        if tracked.store_sent and tracked.plan.store and not tracked.store_ran:
            tracked.store_ran = True
            self._unconfirmed_stores.add(req_id)
        window = self.window
        lease = tracked.plan.lease
        if window is not None and lease and tracked.plan.keep:
            if tracked.store_sent and not aborted:
                window.record(
                    tracked.plan.keep,
                    tracked.block_ids,
                    self.block_pool,
                    epoch=lease.epoch,
                    version=lease.version,
                    fail=tracked.fail_host_write,
                    kill=tracked.kill_host_write,
                )
            else:
                window.unfollowed(tracked.plan.keep, epoch=lease.epoch, version=lease.version)
        result = dataclasses.replace(_result(tracked), steps=self.steps)
        if not aborted:  # vLLM drops an aborted request's report: keep them for the next
            copied, dropped, gone = window.take_changes() if window is not None else ((), (), ())
            result = dataclasses.replace(
                result,
                host_copied=copied,
                host_overwritten=window.take_overwritten() if window is not None else (),
                host_dropped=dropped,
                host_gone=gone,
                host_lost=window.take_losses() if window is not None else WindowLosses(),
                stranded_blocks=window.stranded_blocks if window is not None else 0,
            )
        return {RESULT_KEY: result.to_json()}

    def _track(
        self, req_id: str, params: dict[str, Any] | None, prompt_len: int
    ) -> _Tracked | None:
        tracked = self._tracked.get(req_id)
        if tracked is not None or not params or PLAN_KEY not in params:
            return tracked
        try:
            plan = Plan.from_json(params[PLAN_KEY])
            problems = tuple(
                plan_problems(
                    plan,
                    prompt_len=prompt_len,
                    page_size=self.config.page_size,
                    host_slots=self.config.host_slots,
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            plan, problems = Plan(page_size=self.config.page_size), (f"malformed plan: {exc}",)
        if not problems and plan.lease is not None and self.window is not None:
            self.window.take_lease(plan.lease)
            self.window.planned(plan.keep, plan.lease)
        fault = params.get(FAULT_KEY) or {}
        tracked = _Tracked(
            plan=plan,
            prompt_len=prompt_len,
            problems=problems,
            fail_load_span=tuple(int(i) for i in fault.get("fail_load_span", ())),
            fail_host_write=bool(fault.get("fail_host_write", False)),
            kill_host_write=bool(fault.get("kill_host_write", False)),
        )
        self._tracked[req_id] = tracked
        return tracked

    def _ops(
        self, req_id: str, tracked: _Tracked, num_computed: int, num_scheduled: dict[str, int]
    ) -> RequestOps | None:
        if tracked.problems:
            return None
        plan = tracked.plan
        load: tuple[LoadSpan, ...] = ()
        lo = hi = 0
        if tracked.load_pending:
            tracked.load_pending = False
            load, lo, hi = plan.load + tracked.copied_load, tracked.load_lo, tracked.load_hi
        store: tuple[StoreSpan, ...] = ()
        completes_prompt = (
            num_computed < tracked.prompt_len <= num_computed + num_scheduled.get(req_id, 0)
        )
        if completes_prompt and not tracked.store_sent:
            tracked.store_sent = True
            store = plan.store
        if not (load or store):
            return None
        return RequestOps(
            req_id=req_id,
            block_ids=tuple(tracked.block_ids),
            load=load,
            load_lo=lo,
            load_hi=hi,
            store=store,
            fail_load_span=tracked.fail_load_span,
        )


def _result(tracked: _Tracked) -> ConnectorResult:
    host = 0
    for span in tracked.plan.load + tracked.copied_load:
        first = max(span.token_start, tracked.load_lo)
        last = min(span.token_start + span.num_tokens, tracked.loaded_end)
        host += max(0, last - first)
    return ConnectorResult(
        loaded_tokens=host,
        external_tokens=tracked.external_at_first or 0,
        gpu_tokens=tracked.local_tokens,
        host_tokens=host,
        store_scheduled=tracked.store_sent and bool(tracked.plan.store),
        stored=tracked.store_ran,
        failed_load_spans=tuple(tracked.failed_spans),
        rejected=tracked.problems,
        load_copy_s=tracked.load_copy_s,
        store_copy_s=tracked.store_copy_s,
        window_copy_s=tracked.window_copy_s,
        overwritten_tokens=max(0, tracked.overwritten_tokens),
    )
