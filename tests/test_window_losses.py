"""Where kept documents go when they are not copied (`WindowLosses`, docs/design.md 2.2): the
eviction window's counts over vLLM's real `BlockPool`, the report that carries them, and the
tree's counts beside them (`concurrent_computes`), as `stats()` shows them."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.engine.connector.config import RESULT_KEY
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.plan import PLAN_KEY, HostLease, KeepSpan, Plan, WindowLosses
from ragcache_core.storage.pool_layout import PoolLayout
from ragcache_core.tree import KnowledgeTree
from tests._tree_helpers import ROOT, doc


def _ahead(window: Any, pool: Any) -> list[Any]:
    """The step's eviction-time copies (at hand-out, then the look-ahead's)."""
    handout, lookahead = window.step_writes(pool)
    return [*handout, *lookahead]


BLOCK = 4
PAGE = 2
KEEP = (KeepSpan(7, None, 0, 8), KeepSpan(8, 7, 8, 8))  # root: blocks 0-1; document: 2-3


def _pool(num_blocks: int, used: int) -> tuple[BlockPool, list[int]]:
    """A pool whose request held `used` full cached blocks, still running (not freed)."""
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
    blocks = pool.get_new_blocks(used)
    for i, block in enumerate(blocks):
        key = make_block_hash_with_group_id(f"h{i}".encode(), 0)
        block.set_block_hash(key, BLOCK)
        pool.cached_block_hash_to_block.insert(key, block)
    return pool, [b.block_id for b in blocks]


def _finished(
    used: int = 5, lease: int = 16, window: int = 8
) -> tuple[BlockPool, list[int], EvictionWindow]:
    """KEEP recorded at its request's finish, the request's blocks freed (last block first:
    they are at the queue's tail, behind every never-used block)."""
    pool, ids = _pool(16, used)
    w = EvictionWindow(window_blocks=window, block_size=BLOCK, page_size=PAGE)
    w.take_lease(HostLease(epoch=1, version=0, applied=0, slots=tuple(range(lease))))
    w.record(KEEP, ids, pool, epoch=1, version=1)
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    return pool, ids, w


def test_copied_documents_are_no_loss() -> None:
    pool, _, window = _finished()
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)  # the request's blocks at the head
    writes = _ahead(window, pool)
    assert [w.key for w in writes] == [7, 8]
    window.on_report({7, 8}, pool)
    pool.get_new_blocks(pool.get_num_free_blocks())  # now vLLM evicts them: on the host
    assert window.take_changes()[2] == ((7, 1), (8, 1))
    assert window.take_losses() == WindowLosses()


def test_a_plan_built_before_the_tree_applied_a_copy_computes_it_and_is_counted() -> None:
    pool, _, window = _finished()
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)
    window.on_report({w.key for w in _ahead(window, pool)}, pool)  # copies 1 (root), 2 (document)
    stale = HostLease(epoch=1, version=1, applied=0, slots=tuple(range(16)))
    window.planned(KEEP, stale)  # vLLM's blocks still hold both: read there, no loss
    assert window.take_losses() == WindowLosses()
    pool.get_new_blocks(pool.get_num_free_blocks())  # vLLM evicts them: only the host has them
    window.planned(KEEP, stale)  # planned before the tree heard of either copy
    window.planned(KEEP, HostLease(epoch=1, version=2, applied=1, slots=tuple(range(16))))
    window.planned(KEEP, HostLease(epoch=1, version=3, applied=2, slots=tuple(range(16))))
    assert window.take_losses() == WindowLosses(unapplied=3)
    window.take_changes()  # the sweep: both records leave, remembered as on the host
    window.planned(KEEP, stale)
    assert window.take_losses() == WindowLosses(unapplied=2)


def test_a_step_that_takes_every_block_copies_what_it_takes_nothing_is_missed() -> None:
    """Before copies at hand-out, a step that took blocks from beyond the look-ahead lost
    their documents (`missed`); now vLLM names every block it hands out."""
    pool, _, window = _finished()
    pool.get_new_blocks(pool.get_num_free_blocks())  # one step takes everything
    window.take_changes()  # between scheduling and the step's metadata: nothing swept yet
    assert [w.key for w in window.step_writes(pool)[0]] == [7, 8]
    window.on_report({7, 8}, pool)
    copied, _, gone = window.take_changes()
    assert [key for _, key, _ in copied] == [7, 8] and gone == ((7, 1), (8, 1))
    assert window.take_losses() == WindowLosses()


def test_a_document_partly_taken_is_copied_whole_from_the_blocks_handed_out() -> None:
    pool, _, window = _finished(window=3)
    pool.get_new_blocks(pool.get_num_free_blocks() - 3)  # blocks 4 (question) and 3 taken
    # The document's block 3 was handed out: the document (and its root) are copied at
    # hand-out, before anything writes block 3; the look-ahead has nothing left to copy.
    handout, ahead = window.step_writes(pool)
    assert [w.key for w in handout] == [7, 8] and ahead == []
    window.on_report({7, 8}, pool)
    window.take_changes()
    assert window.take_losses() == WindowLosses()
    assert 8 not in window._records and 7 in window._records


def test_documents_refused_a_lease_count_as_no_lease_not_missed() -> None:
    pool, _, window = _finished(lease=7, window=2)  # root and document need 4 + 4 slots
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)
    assert _ahead(window, pool) == []  # the document is at the head, the lease too small
    assert window.take_losses() == WindowLosses()  # refused, not lost yet: still cached
    pool.get_new_blocks(pool.get_num_free_blocks())
    # Handed out: the document refused again, for good; the root, handed out too, fits alone.
    assert [w.key for w in _ahead(window, pool)] == [7]
    window.on_report({7}, pool)
    window.take_changes()
    assert window.take_losses() == WindowLosses(no_lease=1)


def test_a_document_whose_parent_left_uncopied_is_broken() -> None:
    pool, ids, window = _finished()
    pool.evict_blocks({ids[0]})  # vLLM evicted the root's first block (its hash is gone)
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)
    assert _ahead(window, pool) == []
    # The document is whole, but its copy needs the root's: let go, broken. The root itself
    # was not seen whole by the window: missed.
    assert window.take_losses() == WindowLosses(missed=1, broken=1)


def test_the_next_report_carries_the_losses_and_the_tree_adds_them_up() -> None:
    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=PAGE)
    config = ConnectorConfig(
        layout=layout, host_slots=16, host_pool_name="x", host_write="eviction", window_blocks=3
    )
    side = SchedulerSide(config, BLOCK)
    pool, ids = _pool(16, used=5)
    side.bind_block_pool(pool)
    lease = HostLease(epoch=5, version=1, applied=0, slots=tuple(range(8)))
    params = {PLAN_KEY: Plan(page_size=PAGE, keep=KEEP, lease=lease).to_json()}
    side.track_and_count_loads("r", params, 19, 0)
    tracked = side._tracked["r"]
    tracked.block_ids, tracked.store_sent = list(ids), True  # its prompt was computed
    side.finished("r")
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    # Their hashes dropped without a hand-out (as a failed load's blocks are evicted): the
    # window never had the chance to copy them.
    pool.evict_blocks(set(ids))
    later = {PLAN_KEY: Plan(page_size=PAGE, lease=lease).to_json()}

    def report(req_id: str) -> ConnectorResult:
        side.track_and_count_loads(req_id, later, 9, 0)
        out: Any = side.finished(req_id)
        return ConnectorResult.from_json(out[RESULT_KEY])

    first = report("s")
    assert first.host_lost == WindowLosses(missed=2)
    assert report("t").host_lost == WindowLosses()  # carried once
    tree = KnowledgeTree(
        ROOT, host_slots=32, page_size=PAGE, host_write="eviction", host_lease_slots=8
    )
    tree.apply_host_writes((), (), lost=first.host_lost)
    tree.apply_host_writes((), (), lost=WindowLosses(no_lease=1, broken=3))
    assert tree.host_writes is not None
    assert tree.host_writes.lost == WindowLosses(missed=2, no_lease=1, broken=3)
    tree.clear()
    assert tree.host_writes.lost == WindowLosses()


def test_the_losses_survive_the_report_json() -> None:
    result = ConnectorResult(host_lost=WindowLosses(1, 2, 3, 4))
    assert ConnectorResult.from_json(result.to_json()).host_lost == result.host_lost
    assert ConnectorResult.from_json({**result.to_json(), "host_lost": [0, 0, 0]}).host_lost == (
        WindowLosses()
    )


def _tree() -> KnowledgeTree:
    return KnowledgeTree(
        ROOT, host_slots=64, page_size=PAGE, host_write="eviction", host_lease_slots=8
    )


def test_a_document_two_open_requests_compute_counts_once_per_extra_request() -> None:
    tree = _tree()
    first = tree.begin_request(4, [doc("a", 8)], 2)
    tree.confirm(first)  # the root and "a" are in vLLM's blocks now
    writes = tree.host_writes
    assert writes is not None and writes.concurrent_computes == 0
    one = tree.begin_request(4, [doc("b", 8)], 2)
    two = tree.begin_request(4, [doc("b", 8)], 3)  # "b" is being computed by `one`
    three = tree.begin_request(4, [doc("a", 8), doc("c", 4)], 2)  # "a" is held: computes c
    assert writes.concurrent_computes == 1
    tree.abort(two)
    tree.confirm(one)  # "b" is in vLLM's blocks now: a new request reads it
    four = tree.begin_request(4, [doc("b", 8)], 2)
    assert writes.concurrent_computes == 1
    tree.confirm(three)
    tree.confirm(four)
    five = tree.begin_request(4, [doc("d", 8)], 2)
    tree.abort(five)  # an ended request computes nothing any more
    six = tree.begin_request(4, [doc("d", 8)], 2)
    assert writes.concurrent_computes == 1
    tree.confirm(six)
    tree.check_integrity()
    tree.clear()
    assert writes.concurrent_computes == 0


def test_the_scheduler_side_counts_plans_that_missed_an_unapplied_copy() -> None:
    from types import SimpleNamespace

    from ragcache_core.engine.connector.metadata import WorkerReport

    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=PAGE)
    config = ConnectorConfig(
        layout=layout, host_slots=16, host_pool_name="x", host_write="eviction", window_blocks=8
    )
    side = SchedulerSide(config, BLOCK)
    pool, ids = _pool(16, used=5)
    side.bind_block_pool(pool)
    lease = HostLease(epoch=5, version=1, applied=0, slots=tuple(range(16)))
    side.track_and_count_loads("r", {PLAN_KEY: Plan(PAGE, keep=KEEP, lease=lease).to_json()}, 19, 0)
    tracked = side._tracked["r"]
    tracked.block_ids, tracked.store_sent = list(ids), True
    side.finished("r")
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    pool.get_new_blocks(pool.get_num_free_blocks() - 5)
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    step = SimpleNamespace(
        num_scheduled_tokens={}, scheduled_new_reqs=[], scheduled_cached_reqs=cached
    )
    assert [w.key for w in side.build_step(step).host_writes] == [7, 8]
    side.on_worker_report(WorkerReport(host_written={7, 8}))
    pool.get_new_blocks(pool.get_num_free_blocks())  # vLLM evicts both: the host holds them
    # A plan the tree built before it applied the copies keeps (computes) them again.
    stale = HostLease(epoch=5, version=2, applied=0, slots=tuple(range(16)))
    side.track_and_count_loads("s", {PLAN_KEY: Plan(PAGE, keep=KEEP, lease=stale).to_json()}, 19, 0)
    out: Any = side.finished("s", aborted=True)  # its report is dropped: counts wait
    side.track_and_count_loads("t", {PLAN_KEY: Plan(PAGE, lease=stale).to_json()}, 9, 0)
    out = side.finished("t")
    assert ConnectorResult.from_json(out[RESULT_KEY]).host_lost == WindowLosses(unapplied=2)
