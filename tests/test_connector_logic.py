"""The connector's pure parts: plan checks, token indices, scheduler-side step building.

Scheduler outputs here are plain objects with the fields vLLM's `SchedulerOutput` has; the
same code runs inside the real engine in tests/test_exact.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.engine.connector.metadata import WorkerReport
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.spans import plan_problems, span_index
from ragcache_core.plan import PLAN_KEY, LoadSpan, Plan, SlotCopy, StoreSpan, Tier
from ragcache_core.storage.pool_layout import PoolLayout

PAGE, BLOCK = 4, 8
LAYOUT = PoolLayout(num_layers=1, num_kv_heads=1, head_size=32, dtype="float32", page_size=PAGE)
CONFIG = ConnectorConfig(layout=LAYOUT, gpu_slots=10, host_slots=10, host_pool_name="x")

PLAN = Plan(
    PAGE,
    swap_out=(SlotCopy((7,), (1,)),),
    load=(LoadSpan(Tier.GPU, (0, 1), 0, 6), LoadSpan(Tier.HOST, (2, 3, 4), 6, 10)),
    store=(StoreSpan((5, 6), 16, 5),),
)


def _problems(plan: Plan, prompt_len: int = 30) -> list[str]:
    return plan_problems(plan, prompt_len=prompt_len, page_size=PAGE, gpu_slots=10, host_slots=10)


def test_valid_plan_has_no_problems() -> None:
    assert _problems(PLAN) == []
    assert Plan.from_json(PLAN.to_json()) == PLAN


def test_plan_problems_are_named() -> None:
    gap = Plan(PAGE, load=(LoadSpan(Tier.GPU, (0, 1), 2, 6),))
    assert "starts at 2, expected 0" in _problems(gap)[0]
    few = Plan(PAGE, load=(LoadSpan(Tier.GPU, (0,), 0, 6),))
    assert "1 slots for 6 tokens" in _problems(few)[0]
    outside = Plan(PAGE, store=(StoreSpan((10, 11), 0, 5),))
    assert "gpu slot(s) [10, 11] outside the pool" in _problems(outside)[0]
    beyond = Plan(PAGE, store=(StoreSpan((1, 2), 27, 5),))
    assert "outside the prompt" in _problems(beyond)[0]
    assert "page size" in _problems(Plan(8))[0]


def test_span_index_maps_pages_to_blocks() -> None:
    index = span_index(
        slots=(2, 3, 4),
        token_start=6,
        num_tokens=10,
        lo=0,
        hi=14,  # only the first 8 tokens of the span are loaded
        block_ids=(5, 9),
        block_size=BLOCK,
        page_size=PAGE,
        device=torch.device("cpu"),
    )
    assert index.pool_slots.tolist() == [2, 2, 2, 2, 3, 3, 3, 3]
    assert index.pool_rows.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # positions 6, 7 in block 5; positions 8..13 in block 9
    assert index.slot_mapping.tolist() == [46, 47, 72, 73, 74, 75, 76, 77]


def _request(req_id: str, prompt_len: int, plan: Plan | None) -> SimpleNamespace:
    params = {PLAN_KEY: plan.to_json()} if plan is not None else None
    return SimpleNamespace(
        request_id=req_id, kv_transfer_params=params, num_prompt_tokens=prompt_len
    )


def _output(
    new: list[tuple[str, list[int], int]], scheduled: dict[str, int], cached: Any = None
) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(blocks,), num_computed_tokens=c)
            for r, blocks, c in new
        ],
        scheduled_cached_reqs=cached
        or SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens=scheduled,
    )


def test_scheduler_side_sends_copies_once_and_store_when_prompt_completes() -> None:
    side = SchedulerSide(CONFIG, BLOCK)
    req = _request("a", 30, PLAN)
    assert side.track_and_count_loads("a", req.kv_transfer_params, 30, 0) == 16
    side.after_alloc("a", 16)
    # Chunked prefill: this step computes 16..24 only (prompt not complete: no store).
    step = side.build_step(_output([("a", [0, 1, 2], 16)], {"a": 8}))
    (ops,) = step.requests
    assert ops.swap_out == PLAN.swap_out and ops.load == PLAN.load and ops.store == ()
    assert (ops.load_lo, ops.load_hi, ops.block_ids) == (0, 16, (0, 1, 2))
    cached = SimpleNamespace(
        req_ids=["a"], resumed_req_ids=set(), new_block_ids=[([3],)], num_computed_tokens=[24]
    )
    (ops,) = side.build_step(_output([], {"a": 6}, cached)).requests
    assert ops.swap_out == () and ops.load == () and ops.store == PLAN.store
    assert ops.block_ids == (0, 1, 2, 3)
    # Scheduled is not ran: `stored` waits for the worker's word.
    assert not side._tracked["a"].store_ran
    side.on_worker_report(WorkerReport(stored={"a"}, copy_s={"a": (0.0, 0.002)}))
    params = side.finished("a")
    result = ConnectorResult.from_transfer_params(params)
    assert (result.gpu_tokens, result.host_tokens) == (6, 10)
    assert result.store_scheduled and result.stored and result.store_copy_s == 0.002


def test_a_store_in_the_finishing_step_counts_and_a_report_without_it_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A max_tokens=1 request finishes in the step that stores it: vLLM calls `finished`
    before that step's worker report arrives, so the store sent counts as run (it did: the
    worker's store is synchronous and skipped only for a failed load, which vLLM does not
    finish). The next report must show it, else the error is logged; one that shows it is
    quiet."""
    side = SchedulerSide(CONFIG, BLOCK)
    for req_id in ("s", "t"):
        side.track_and_count_loads(req_id, {PLAN_KEY: PLAN.to_json()}, 30, 0)
        side.after_alloc(req_id, 16)
    step = side.build_step(
        _output([("s", [0, 1, 2, 3], 16), ("t", [4, 5, 6, 7], 16)], {"s": 14, "t": 14})
    )
    assert [ops.store for ops in step.requests] == [PLAN.store, PLAN.store]
    for req_id in ("s", "t"):
        result = ConnectorResult.from_transfer_params(side.finished(req_id))
        assert result.store_scheduled and result.stored
    with caplog.at_level(logging.ERROR):
        side.on_worker_report(WorkerReport(stored={"s"}))
    assert [r.getMessage() for r in caplog.records] == [
        "RAGCache: request t finished, but its store did not run"
    ]
    caplog.clear()
    side.on_worker_report(WorkerReport(stored=set()))  # checked once, not again
    assert not caplog.records


def test_a_store_not_sent_is_not_stored() -> None:
    side = SchedulerSide(CONFIG, BLOCK)
    side.track_and_count_loads("u", {PLAN_KEY: PLAN.to_json()}, 30, 0)
    side.after_alloc("u", 16)
    side.build_step(_output([("u", [0, 1, 2], 16)], {"u": 8}))  # prompt not complete
    result = ConnectorResult.from_transfer_params(side.finished("u"))  # aborted mid-prefill
    assert not result.store_scheduled and not result.stored


def test_worker_reports_merge_across_workers() -> None:
    one = WorkerReport({"a": 2}, {"a", "b"}, {"a": (0.1, 0.0), "b": (0.0, 0.3)})
    two = WorkerReport({"a": 1}, {"b"}, {"b": (0.0, 0.5)})
    merged = one.aggregate(two)
    assert isinstance(merged, WorkerReport)
    assert merged.load_failures == {"a": 1} and merged.stored == {"b"}
    assert merged.copy_s == {"a": (0.1, 0.0), "b": (0.0, 0.5)}


def test_scheduler_side_never_loads_all_prompt_tokens() -> None:
    side = SchedulerSide(CONFIG, BLOCK)
    plan = Plan(PAGE, load=(LoadSpan(Tier.GPU, (0, 1, 2), 0, 12),))
    assert side.track_and_count_loads("b", {PLAN_KEY: plan.to_json()}, 12, 0) == 11


def test_load_failure_resends_store_and_reports_recomputed_tokens() -> None:
    side = SchedulerSide(CONFIG, BLOCK)
    side.track_and_count_loads("c", {PLAN_KEY: PLAN.to_json()}, 30, 0)
    side.after_alloc("c", 16)
    (ops,) = side.build_step(_output([("c", [0, 1, 2, 3], 16)], {"c": 14})).requests
    assert ops.store == PLAN.store
    side.on_worker_report(WorkerReport({"c": 1}))  # host span failed; vLLM recomputes from 0
    cached = SimpleNamespace(
        req_ids=["c"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[0]
    )
    (ops,) = side.build_step(_output([], {"c": 30}, cached)).requests
    assert ops.store == PLAN.store and ops.load == ()
    result = ConnectorResult.from_transfer_params(side.finished("c"))
    assert result.failed_load_spans == (1,)
    assert (result.gpu_tokens, result.host_tokens) == (0, 0)  # span 1 starts in block 0


def test_rejected_plan_runs_nothing_and_says_why() -> None:
    side = SchedulerSide(CONFIG, BLOCK)
    bad = Plan(PAGE, load=(LoadSpan(Tier.GPU, (99, 1), 0, 6),))
    assert side.track_and_count_loads("d", {PLAN_KEY: bad.to_json()}, 30, 0) == 0
    assert side.build_step(_output([("d", [0], 0)], {"d": 30})).requests == []
    result = ConnectorResult.from_transfer_params(side.finished("d"))
    assert result.rejected and "outside the pool" in result.rejected[0]


def test_requests_without_plan_are_ignored() -> None:
    side = SchedulerSide(CONFIG, BLOCK)
    assert side.track_and_count_loads("e", None, 30, 0) == 0
    assert side.build_step(_output([("e", [0], 0)], {"e": 30})).requests == []
    assert side.finished("e") is None
