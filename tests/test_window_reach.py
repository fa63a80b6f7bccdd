"""The eviction window's size under load (`engine/connector/take.py`): it grows to the recent
steps' reach into vLLM's free queue, over vLLM's real `BlockPool`."""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from ragcache_core.engine.connector.take import RECENT_STEPS, StepTake
from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.plan import HostLease, KeepSpan, WindowLosses

BLOCK = 4
PAGE = 2


def test_the_reach_is_what_a_step_took_from_the_head() -> None:
    pool = BlockPool(128, enable_caching=True, hash_block_size=BLOCK)
    take = StepTake(floor=4, horizon=32)
    assert take.window == 4
    take.mark(pool.free_block_queue)
    pool.get_new_blocks(10)  # one step took 10 blocks
    take.measure(pool.free_block_queue)
    assert take.window == 10
    take.mark(pool.free_block_queue)
    held = pool.get_new_blocks(3)
    pool.free_blocks(held)  # blocks freed go to the tail: no reach
    take.measure(pool.free_block_queue)
    assert take.window == 10  # the largest recent reach
    for _ in range(RECENT_STEPS):
        take.mark(pool.free_block_queue)
        pool.get_new_blocks(2)
        take.measure(pool.free_block_queue)
    assert take.window == 4  # the busy step is no longer recent: the floor
    take.mark(pool.free_block_queue)
    pool.get_new_blocks(pool.get_num_free_blocks())  # beyond the horizon
    take.measure(pool.free_block_queue)
    assert take.window == 32
    take.reset()
    assert take.window == 4


def _recorded(horizon: int) -> tuple[BlockPool, EvictionWindow]:
    """A document of 4 blocks recorded, freed, then 10 blocks deep in the queue."""
    pool = BlockPool(40, enable_caching=True, hash_block_size=BLOCK)
    window = EvictionWindow(window_blocks=4, block_size=BLOCK, page_size=PAGE, horizon=horizon)
    window.take_lease(HostLease(epoch=1, version=0, applied=0, slots=tuple(range(32))))
    blocks = pool.get_new_blocks(14)  # the document's 4, then 10 cached blocks of others
    for i, block in enumerate(blocks):
        key = make_block_hash_with_group_id(f"d{i}".encode(), 0)
        block.set_block_hash(key, BLOCK)
        pool.cached_block_hash_to_block.insert(key, block)
    blocks, behind = blocks[:4], blocks[4:]
    ids = [b.block_id for b in blocks]
    window.record((KeepSpan(1, None, 0, 16),), ids, pool, epoch=1, version=1)
    pool.free_blocks(reversed(blocks))
    pool.free_blocks(behind)
    pool.get_new_blocks(pool.get_num_free_blocks() - 24)  # 10 blocks before it, 10 behind
    return pool, window


def test_after_deep_steps_the_window_sees_what_a_step_of_one_budget_would_miss() -> None:
    for horizon, copied in ((0, False), (32, True)):
        pool, window = _recorded(horizon)
        assert window.scan(pool) == []  # marks the head (the document is 10 blocks deep)
        pool.get_new_blocks(6)  # a busy step (it loaded host copies too) took 6 blocks
        # The document is 4 blocks deep: outside the window of 4, inside the recent reach.
        writes = window.scan(pool)
        pool.get_new_blocks(6)  # the next busy step: it cannot take held blocks
        window.on_report({w.key for w in writes}, pool)
        pool.get_new_blocks(pool.get_num_free_blocks())
        window.take_changes()
        assert bool(writes) is copied
        assert window.take_losses() == (WindowLosses() if copied else WindowLosses(missed=1))
