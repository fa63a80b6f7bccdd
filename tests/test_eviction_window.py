"""The eviction window's logic (`engine/connector/window.py`) over vLLM's real `BlockPool`:
recording, the walk of the free queue's head, holding while copying, handing back, the lease.
The real-engine tests are in tests/test_exact_eviction.py."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from ragcache_core.engine.compat import check_eviction_window_hooks
from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.plan import HostLease, KeepSpan, WindowLosses


def _ahead(window: Any, pool: Any) -> list[Any]:
    """The step's eviction-time copies (at hand-out, then the look-ahead's)."""
    handout, lookahead = window.step_writes(pool)
    return [*handout, *lookahead]


BLOCK = 4
PAGE = 2


def _pool_with_request(num_blocks: int, used: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first request held `used` full blocks, all cached (hashed), now finished:
    vLLM frees a request's blocks in reverse (its last block is evicted first)."""
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
    blocks = pool.get_new_blocks(used)
    for i, block in enumerate(blocks):
        key = make_block_hash_with_group_id(f"h{i}".encode(), 0)
        block.set_block_hash(key, BLOCK)
        pool.cached_block_hash_to_block.insert(key, block)
    return pool, [b.block_id for b in blocks]


def _finish(pool: BlockPool, block_ids: list[int]) -> None:
    pool.free_blocks(reversed([pool.blocks[i] for i in block_ids]))


def _head(pool: BlockPool, n: int) -> list[int]:
    out = []
    for i, block in enumerate(pool.free_block_queue.iter_blocks_after(None)):
        if i >= n:
            break
        out.append(block.block_id)
    return out


KEEP = (KeepSpan(7, None, 0, 6), KeepSpan(8, 7, 6, 6))  # root [0, 6), a document [6, 12)


def _window(lease: int = 8, window: int = 3) -> EvictionWindow:
    w = EvictionWindow(window_blocks=window, block_size=BLOCK, page_size=PAGE)
    w.take_lease(HostLease(epoch=1, version=0, applied=0, slots=tuple(range(lease))))
    return w


def _side() -> tuple[Any, BlockPool, list[int]]:
    """A scheduler side in eviction mode (a 16-slot host pool, a window of 3 blocks) bound to
    a pool whose first request's 4 blocks are cached and still held (`_pool_with_request`)."""
    from ragcache_core.engine.connector import ConnectorConfig
    from ragcache_core.engine.connector.scheduler_side import SchedulerSide
    from ragcache_core.storage.pool_layout import PoolLayout

    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=PAGE)
    config = ConnectorConfig(
        layout=layout, host_slots=16, host_pool_name="x", host_write="eviction", window_blocks=3
    )
    side = SchedulerSide(config, BLOCK)
    pool, ids = _pool_with_request(8, used=4)
    side.bind_block_pool(pool)
    return side, pool, ids


def test_this_vllm_has_the_hooks() -> None:
    check_eviction_window_hooks()


def test_a_document_at_the_head_is_copied_with_its_parent_held_then_handed_back() -> None:
    pool, ids = _pool_with_request(16, used=4)  # 12 kept tokens + a question block
    window = _window()
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    free_before = pool.get_num_free_blocks()
    assert _ahead(window, pool) == []  # the freed blocks went to the queue's tail: not leaving
    pool.get_new_blocks(free_before - 4)  # someone takes every block before them
    writes = _ahead(window, pool)
    # Block 3 (the question's) is first, then block 2 (the document's last): the document is
    # leaving, so it and its uncopied parent (the root) are copied, root first.
    assert [w.key for w in writes] == [7, 8]
    assert writes[0].block_ids == tuple(ids[0:2]) and writes[0].token_start == 0
    assert writes[1].block_ids == tuple(ids[1:3]) and writes[1].token_start == 2
    assert [len(w.slots) for w in writes] == [3, 3]
    assert not set(writes[0].slots) & set(writes[1].slots)
    assert window.held_blocks == 4 and pool.get_num_free_blocks() == 1  # held: not evictable
    window.on_report({7, 8}, pool)
    assert window.held_blocks == 0 and pool.get_num_free_blocks() == 4
    copied, dropped, gone = window.take_changes()
    assert [(seq, key) for seq, key, _ in copied] == [(1, 7), (2, 8)] and dropped == gone == ()
    # The copies ride on every report until a lease says the tree applied them (a report
    # vLLM drops loses nothing); the rest, once.
    assert window.take_changes() == (copied, (), ())
    window.take_lease(HostLease(epoch=1, version=1, applied=2, slots=tuple(range(8))))
    assert window.take_changes() == ((), (), ())
    assert _ahead(window, pool) == []  # copied: let go when it comes back to the head
    # Its blocks leave vLLM's cache: the copied records are reported gone (the tree then
    # knows the documents are on the host alone), once.
    pool.get_new_blocks(pool.get_num_free_blocks())
    assert window.take_changes() == ((), (), ((7, 1), (8, 1)))
    assert 7 not in window._records and window.take_changes() == ((), (), ())


def test_a_failed_copy_hands_blocks_back_returns_slots_and_drops_the_record() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window()
    window.record(KEEP, ids, pool, epoch=1, version=1, fail=True)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    writes = _ahead(window, pool)
    assert all(w.fail for w in writes) and len(window._lease) == 2
    window.on_report(set(), pool)  # the worker reported neither as run
    assert window.held_blocks == 0 and len(window._lease) == 8
    assert window.take_changes() == ((), (7, 8), ((7, 1), (8, 1)))
    assert _ahead(window, pool) == []


def test_a_document_vllm_hands_out_is_copied_in_that_step_with_its_parent() -> None:
    """vLLM hands a recorded document's block out (its reuse callback fires before the hash
    goes): the document and its uncopied parent are copied in that step, from blocks nobody
    holds (they are the new requests'), before the step writes them."""
    pool, ids = _pool_with_request(8, used=4)
    window = _window(window=0)  # no look-ahead: every copy at hand-out
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    assert window.step_writes(pool) == ([], [])  # nothing handed out yet
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # takes the document's last block
    handout, ahead = window.step_writes(pool)
    assert ahead == [] and [w.key for w in handout] == [7, 8]
    assert handout[0].block_ids == tuple(ids[0:2]) and handout[1].block_ids == tuple(ids[1:3])
    assert window.held_blocks == 0 and pool.get_num_free_blocks() == 2
    window.on_report({7, 8}, pool)
    copied, dropped, gone = window.take_changes()
    assert [key for _, key, _ in copied] == [7, 8] and dropped == ()
    assert gone == ((8, 1),)  # its blocks left vLLM's cache: on the host alone now
    assert window.take_losses() == WindowLosses()
    window.take_lease(HostLease(epoch=1, version=1, applied=2, slots=tuple(range(8))))
    pool.get_new_blocks(2)  # the root's blocks go too: copied already, nothing more
    assert window.step_writes(pool) == ([], [])
    assert window.take_changes() == ((), (), ((7, 1),))


def test_a_document_handed_out_without_lease_room_is_lost_for_lack_of_lease() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window(lease=5, window=0)  # the chain needs 6 slots
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    assert window.step_writes(pool) == ([], []) and len(window._lease) == 5
    assert window.take_changes() == ((), (), ((8, 1),))
    assert window.take_losses() == WindowLosses(no_lease=1)


def test_a_copy_at_hand_out_never_overwrites_a_victim_the_steps_loads_read() -> None:
    """Copies at hand-out run before the step's loads: a victim a load of the step reads is
    passed over (the next one is overwritten instead), or the copy is refused."""
    pool, ids = _pool_with_request(8, used=4)
    window = EvictionWindow(window_blocks=0, block_size=BLOCK, page_size=PAGE)
    lease = HostLease(
        epoch=1, version=0, applied=0, slots=(), victims=((1, (0, 1, 2)), (2, (3, 4, 5)))
    )
    window.take_lease(lease)
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    handout, _ = window.step_writes(pool, frozenset({4}))  # a load reads victim 2's slot 4
    assert handout == []  # 6 slots needed, victim 1's 3 usable: refused
    assert window.take_overwritten() == ()
    pool2, ids2 = _pool_with_request(8, used=4)
    window2 = EvictionWindow(window_blocks=0, block_size=BLOCK, page_size=PAGE)
    window2.take_lease(
        HostLease(
            epoch=1,
            version=0,
            applied=0,
            slots=(9, 10, 11),
            victims=((1, (0, 1, 2)), (2, (3, 4, 5))),
        )
    )
    window2.record(KEEP, ids2, pool2, epoch=1, version=1)
    _finish(pool2, ids2)
    pool2.get_new_blocks(pool2.get_num_free_blocks() - 2)
    handout, _ = window2.step_writes(pool2, frozenset({1}))  # a load reads victim 1's slot 1
    assert [w.key for w in handout] == [7, 8]
    assert window2.take_overwritten() == ((1, 2),)  # victim 2, not victim 1
    assert {s for w in handout for s in w.slots} == {9, 10, 11, 3, 4, 5}


def test_a_reset_forgets_documents_handed_out_while_it_ran() -> None:
    """vLLM's prefix-cache reset calls every watched block's callback, then the connector's
    reset: nothing handed out then is copied."""
    pool, ids = _pool_with_request(8, used=4)
    window = _window(window=0)
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    assert pool.reset_prefix_cache()
    window.reset(pool)
    assert window.step_writes(pool) == ([], []) and 8 not in window._records


def test_without_lease_room_the_document_is_let_go() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window(lease=5, window=2)  # the chain needs 6 slots
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    assert _ahead(window, pool) == [] and window.held_blocks == 0
    assert 8 in window._records  # a later lease with room may still copy it


def test_a_lease_never_hands_out_slots_consumed_but_not_applied() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window(lease=8)
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    writes = _ahead(window, pool)
    window.on_report({7, 8}, pool)
    used = {s for w in writes for s in w.slots}
    # A newer plan built before the tree saw the copies restates the whole lease.
    window.take_lease(HostLease(epoch=1, version=1, applied=0, slots=tuple(range(8))))
    assert len(window._lease) == 2
    window.take_lease(HostLease(epoch=1, version=1, applied=0, slots=tuple(range(8, 16))))
    assert len(window._lease) == 2  # not newer: ignored
    window.take_lease(HostLease(epoch=1, version=2, applied=2, slots=tuple(range(8))))
    assert len(window._lease) == 8 and used <= set(range(8))  # the tree applied both


def test_a_lease_of_another_tree_forgets_the_previous_trees_records() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window()
    window.record(KEEP, ids, pool, epoch=1, version=1)
    window.take_lease(HostLease(epoch=2, version=0, applied=0, slots=(20, 21)))
    assert 7 not in window._records and len(window._lease) == 2
    window.record(KEEP, ids, pool, epoch=1, version=1)  # a request planned by the old tree
    assert 7 not in window._records


def test_blocks_held_without_a_report_are_handed_back_and_counted() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window()
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    assert _ahead(window, pool)
    assert _ahead(window, pool) == []  # no report came for the step: handed back, dropped
    assert window.stranded_blocks == 4 and window.held_blocks == 0
    assert len(window._lease) == 8 and window.take_changes()[:2] == ((), (7, 8))


def test_reset_forgets_every_record_and_holds_nothing() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window()
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    assert _ahead(window, pool)
    window.reset(pool)
    assert window.held_blocks == 0 and len(window._lease) == 8
    assert 7 not in window._records and 8 not in window._records


def test_a_partial_block_stops_recording() -> None:
    pool, ids = _pool_with_request(8, used=3)
    pool.blocks[ids[2]].reset_hash()  # the prompt's last block: not full, never cached
    window = _window()
    window.record(KEEP, ids, pool, epoch=1, version=1)
    assert 7 in window._records and 8 not in window._records
    # The tree counted both as in vLLM's blocks at the first token: the unrecorded one is gone.
    assert window.take_changes() == ((), (), ((8, 1),))


def test_a_let_go_document_evicted_by_vllm_is_reported_gone() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = _window(lease=0, window=8)  # no lease room: nothing is copied
    window.record(KEEP, ids, pool, epoch=1, version=3)
    _finish(pool, ids)
    assert _ahead(window, pool) == [] and window.take_changes() == ((), (), ())  # still cached
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)  # vLLM evicts the document's blocks
    assert window.step_writes(pool) == ([], [])  # still no room at hand-out
    # Dropped by the look-ahead, which finds it broken; the root's blocks are still cached.
    assert window.take_changes() == ((), (8,), ((8, 3),))
    assert 7 in window._records and 8 not in window._records


def test_a_child_is_copied_after_its_copied_parent_left_vllms_blocks() -> None:
    pool, ids = _pool_with_request(8, used=4)
    window = EvictionWindow(window_blocks=1, block_size=BLOCK, page_size=PAGE, back_to_head=True)
    window.take_lease(HostLease(epoch=1, version=0, applied=0, slots=tuple(range(8))))
    window.record(KEEP, ids, pool, epoch=1, version=1)
    pool.get_new_blocks(pool.get_num_free_blocks())  # every other block is taken
    pool.free_blocks([pool.blocks[i] for i in ids])  # freed root first: the root leaves first
    assert [w.key for w in _ahead(window, pool)] == [7]  # only the root's first block is watched
    window.on_report({7}, pool)  # its blocks go back to the head
    pool.get_new_blocks(1)  # vLLM evicts the root's first block
    copied, _, gone = window.take_changes()
    assert [key for _, key, _ in copied] == [7] and gone == ((7, 1),)
    # The document's blocks are still whole: its copy goes below the root's host copy.
    assert [w.key for w in _ahead(window, pool)] == [8]


def test_unfollowed_spans_are_reported_gone_for_this_epoch_only() -> None:
    window = _window()
    window.unfollowed(KEEP, epoch=1, version=4)
    window.unfollowed(KEEP, epoch=2, version=5)  # another tree's plan: not this lease's
    assert window.take_changes() == ((), (), ((7, 4), (8, 4)))


@pytest.mark.parametrize("missing", ["iter_blocks_after"])
def test_a_vllm_without_the_queue_walk_is_refused(monkeypatch: Any, missing: str) -> None:
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    from ragcache_core.errors import ConfigError

    monkeypatch.delattr(FreeKVCacheBlockQueue, missing)
    with pytest.raises(ConfigError, match=missing):
        check_eviction_window_hooks()


def test_the_scheduler_side_records_at_finish_copies_and_reports_on_the_next_finish() -> None:
    """`SchedulerSide` in eviction mode, hook by hook as vLLM calls them."""
    from types import SimpleNamespace

    from ragcache_core.engine.connector import ConnectorResult
    from ragcache_core.engine.connector.config import RESULT_KEY
    from ragcache_core.engine.connector.metadata import WorkerReport
    from ragcache_core.plan import PLAN_KEY, Plan

    side, pool, ids = _side()
    lease = HostLease(epoch=5, version=1, applied=0, slots=tuple(range(8)))
    plan = Plan(page_size=PAGE, keep=KEEP, lease=lease)
    params = {PLAN_KEY: plan.to_json()}

    def step(new: list[Any], scheduled: dict[str, int]) -> Any:
        cached = SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
        )
        out = SimpleNamespace(
            num_scheduled_tokens=scheduled, scheduled_new_reqs=new, scheduled_cached_reqs=cached
        )
        return side.build_step(out)

    assert side.track_and_count_loads("r", params, 15, 0) == 0
    side.after_alloc("r", 0)
    step([SimpleNamespace(req_id="r", block_ids=[ids], num_computed_tokens=0)], {"r": 15})
    first = ConnectorResult.from_json(side.finished("r")[RESULT_KEY])  # type: ignore[index]
    assert first.host_copied == () and side.window is not None
    assert 7 in side.window._records and 8 in side.window._records
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    ops = step([], {})
    assert [w.key for w in ops.host_writes] == [7, 8]
    side.on_worker_report(WorkerReport(host_written={7, 8}))
    assert side.window.held_blocks == 0
    # The next request's report carries the copies (an aborted one's would not).
    side.track_and_count_loads("s", {PLAN_KEY: Plan(page_size=PAGE, lease=lease).to_json()}, 9, 0)
    second = ConnectorResult.from_json(side.finished("s")[RESULT_KEY])  # type: ignore[index]
    assert [(seq, key) for seq, key, _ in second.host_copied] == [(1, 7), (2, 8)]
    assert second.stranded_blocks == 0
    side.release_all()  # clear(): the records go
    assert 7 not in side.window._records


def test_an_aborted_request_records_nothing_and_the_next_report_says_so() -> None:
    from ragcache_core.engine.connector import ConnectorResult
    from ragcache_core.engine.connector.config import RESULT_KEY
    from ragcache_core.plan import PLAN_KEY, Plan

    side, _, ids = _side()
    lease = HostLease(epoch=5, version=1, applied=0, slots=tuple(range(8)))
    params = {PLAN_KEY: Plan(page_size=PAGE, keep=KEEP, lease=lease).to_json()}
    side.track_and_count_loads("r", params, 15, 0)
    tracked = side._tracked["r"]
    tracked.block_ids, tracked.store_sent = list(ids), True  # its prompt was computed
    assert side.finished("r", aborted=True) is not None
    assert side.window is not None and 7 not in side.window._records
    # The tree counted them as in vLLM's blocks if the request reached its first token: the
    # next report says they are not followed (gone, with the plan's version).
    side.track_and_count_loads("s", {PLAN_KEY: Plan(page_size=PAGE, lease=lease).to_json()}, 9, 0)
    report = ConnectorResult.from_json(side.finished("s")[RESULT_KEY])  # type: ignore[index]
    assert report.host_gone == ((7, 1), (8, 1)) and report.host_copied == ()


@pytest.mark.parametrize("back_to_head", [False, True])
def test_copied_blocks_go_back_to_the_tail_or_where_they_were(back_to_head: bool) -> None:
    """Tail: `free_blocks`, as vLLM's lazy offload does (a second turn in vLLM's LRU). Head:
    the held blocks that were in the window go back to the head in their order, so the copied
    document leaves vLLM's blocks next; the root, held from deeper in the queue, stays at the
    tail where `free_blocks` puts it."""
    check_eviction_window_hooks(back_to_head=True)
    pool, ids = _pool_with_request(8, used=4)
    window = EvictionWindow(
        window_blocks=3, block_size=BLOCK, page_size=PAGE, back_to_head=back_to_head
    )
    window.take_lease(HostLease(epoch=1, version=0, applied=0, slots=tuple(range(8))))
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    assert _head(pool, 4) == [ids[3], ids[2], ids[1], ids[0]]
    assert _ahead(window, pool)
    window.on_report({7, 8}, pool)
    order = _head(pool, 4)
    if back_to_head:
        assert order == [ids[2], ids[1], ids[3], ids[0]]  # window blocks first, in order
    else:
        assert order[0] == ids[3] and set(order[1:]) == {ids[0], ids[1], ids[2]}
    assert pool.get_num_free_blocks() == 4


def test_a_copy_the_tree_has_not_applied_is_loaded_not_computed_nor_copied_again() -> None:
    """A plan made before the tree heard of a copy keeps (computes) the document; the engine
    loads it from its own copy instead, and records it as copied when it finishes."""
    from types import SimpleNamespace

    from ragcache_core.engine.connector import ConnectorResult
    from ragcache_core.engine.connector.config import RESULT_KEY
    from ragcache_core.plan import PLAN_KEY, Plan

    side, pool, ids = _side()
    window = side.window
    assert window is not None
    lease = HostLease(epoch=5, version=1, applied=0, slots=tuple(range(8)))
    window.take_lease(lease)
    window.record(KEEP, ids, pool, epoch=5, version=1)
    _finish(pool, ids)
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)
    writes = _ahead(window, pool)
    window.on_report({7, 8}, pool)
    copies = {w.key: w.slots for w in writes}
    # The next plan (same tree, same lease: it has not applied the copies) computes both.
    plan = Plan(page_size=PAGE, keep=KEEP, lease=lease)
    assert side.track_and_count_loads("r", {PLAN_KEY: plan.to_json()}, 15, 0) == 12
    side.after_alloc("r", 12)
    new = SimpleNamespace(req_id="r", block_ids=[[0, 1, 2, 3]], num_computed_tokens=0)
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )
    out = SimpleNamespace(
        num_scheduled_tokens={"r": 3}, scheduled_new_reqs=[new], scheduled_cached_reqs=cached
    )
    (ops,) = side.build_step(out).requests
    assert [(s.slots, s.token_start) for s in ops.load] == [(copies[7], 0), (copies[8], 6)]
    assert (ops.load_lo, ops.load_hi) == (0, 12)
    result = ConnectorResult.from_json(side.finished("r")[RESULT_KEY])  # type: ignore[index]
    assert result.loaded_tokens == 12
    # Recorded again at its finish as copied: the window never copies it twice.
    assert 8 in window._records and window._records[8].copied == 2
    assert 8 not in {k for keys in window._by_block.values() for k in keys}
    # Once the tree applied them, they are its own to plan: nothing past the plan's loads.
    window.take_lease(HostLease(epoch=5, version=2, applied=2, slots=()))
    assert window.copied_loads(Plan(page_size=PAGE, keep=KEEP, lease=lease), 0) == ()


def test_a_copy_at_hand_out_never_takes_a_slot_a_load_of_the_step_reads() -> None:
    """Found by the host tier fuzz: a load accepted early in a step reads a copy the tree has
    not applied (`copied_loads`); a newer lease taken later in the same step acknowledges that
    copy, so its slots are free lent ones again; a copy at hand-out, which runs before the
    step's loads, must not take them."""
    pool, ids = _pool_with_request(8, used=4)
    window = _window(lease=6, window=0)
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _finish(pool, ids)
    reading = frozenset({0, 1, 2})  # say, a copied load's slots just freed by a newer lease
    pool.get_new_blocks(pool.get_num_free_blocks() - 2)
    handout, _ = window.step_writes(pool, reading)
    assert handout == [] and len(window._lease) == 6  # 6 needed, 3 not read: refused
    pool2, ids2 = _pool_with_request(8, used=4)
    window2 = _window(lease=9, window=0)
    window2.record(KEEP, ids2, pool2, epoch=1, version=1)
    _finish(pool2, ids2)
    pool2.get_new_blocks(pool2.get_num_free_blocks() - 2)
    handout, _ = window2.step_writes(pool2, reading)
    assert [w.key for w in handout] == [7, 8]
    assert not reading & {s for w in handout for s in w.slots}


def test_a_kv_cache_vllm_zeroes_on_hand_out_is_refused_for_copies_at_hand_out() -> None:
    """vLLM zeroes newly allocated blocks before the step's connector loads when the KV cache
    has Mamba layers or mixed precisions: a copy at hand-out would read zeros."""
    from types import SimpleNamespace

    from ragcache_core.engine.compat import check_handout_copies
    from ragcache_core.errors import ConfigError

    check_handout_copies(SimpleNamespace(needs_kv_cache_zeroing=False))
    with pytest.raises(ConfigError, match="zeroes the blocks"):
        check_handout_copies(SimpleNamespace(needs_kv_cache_zeroing=True))
