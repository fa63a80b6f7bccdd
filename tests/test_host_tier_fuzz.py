"""A wrong KV is never served by the host tier written at eviction (docs/design.md 2.2): seeded
random interleavings of plans, vLLM steps, window copies, reports delivered late, out of order
or never, preemptions, aborts, `invalidate`, `clear` and engine restarts, every host load
checked against what the engine wrote (tests/_host_tier_model.py)."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.plan import Tier
from ragcache_core.tree import KnowledgeTree
from tests._host_tier_model import Counts, Scenario, Violation
from tests._tree_helpers import ROOT, doc


def _ahead(window: Any, pool: Any) -> list[Any]:
    """The step's eviction-time copies (at hand-out, then the look-ahead's)."""
    handout, lookahead = window.step_writes(pool)
    return [*handout, *lookahead]


SEEDS = 200


def test_no_interleaving_serves_a_wrong_kv_from_the_host_tier() -> None:
    total = Counts()
    for seed in range(SEEDS):
        total.add(Scenario(seed).run())
    print(f"\nhost tier fuzz: {total}")
    # Each part of the rule was exercised (a change that stops one is seen here).
    assert total.host_loads and total.copied_loads and total.victim_loads
    assert total.overwrites and total.refused_tokens and total.failed_copies
    assert total.late_reports and total.lost_reports and total.aborts
    assert total.preemptions and total.restarts and total.invalidations and total.clears
    assert total.after_restart  # a dead engine's reports reached the app after its restart


def test_the_harness_catches_a_load_past_an_overwritten_victim(monkeypatch: Any) -> None:
    """The check can fail: with `load_limit` answering "no limit", a plan made before the tree
    heard of an overwrite reads the new copy in its victim's slots, and a scenario says so."""
    monkeypatch.setattr(EvictionWindow, "load_limit", lambda self, plan: None)
    for seed in range(SEEDS):
        try:
            Scenario(seed).run()
        except Violation as violation:
            assert "from host slot" in str(violation)
            return
    raise AssertionError("no scenario loaded from an overwritten victim")


def test_a_dead_engines_late_report_never_names_slots_the_new_engine_wrote() -> None:
    """Found by this fuzz (with a dead engine's reports allowed after the restart; they are
    now always): the dead engine's late report would attach x on lent slots the new engine
    had since filled with y. The tree ignores a report of a lost engine."""
    page = block = 4
    tree = KnowledgeTree(
        ROOT, host_slots=32, page_size=page, host_write="eviction", host_lease_slots=8
    )
    first = tree.begin_request(4, [doc("x", 8)], 3)
    tree.confirm(first)
    assert first.plan.lease is not None
    root, x = first.plan.keep
    # The first engine copied the root and x into the lease's first slots (copies 1 and 2);
    # the report carrying them is late. The engine dies; a new one starts.
    slots = first.plan.lease.slots
    late = [(1, root.key, slots[:1]), (2, x.key, slots[1:3])]
    tree.drop_tier(Tier.GPU)
    # The new engine gets the same lease and copies the root and y into the same slots.
    second = tree.begin_request(4, [doc("y", 8)], 3)
    tree.confirm(second)
    lease = second.plan.lease
    assert lease is not None and lease.slots[:3] == slots[:3]
    pool = BlockPool(16, enable_caching=True, hash_block_size=block)
    blocks = pool.get_new_blocks(4)
    for i, held in enumerate(blocks[:3]):  # the root's block, y's two; the question's is partial
        key = make_block_hash_with_group_id(f"y{i}".encode(), 0)
        held.set_block_hash(key, block)
        pool.cached_block_hash_to_block.insert(key, held)
    window = EvictionWindow(window_blocks=4, block_size=block, page_size=page)
    window.take_lease(lease)
    ids = [b.block_id for b in blocks]
    window.record(second.plan.keep, ids, pool, epoch=lease.epoch, version=lease.version)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)  # the request's blocks are leaving
    writes = _ahead(window, pool)
    window.on_report({w.key for w in writes}, pool)
    written = {slot for w in writes for slot in w.slots}
    assert written == set(slots[:3])  # y is in x's slots now
    # The late report of the dead engine, applied as `Lifecycle.settle` applies it: with the
    # generation its request was planned in, since lost.
    tree.apply_host_writes(late, [], engine_generation=first.engine_generation)
    assert tree.host_writes is not None and tree.host_writes.stale_reports == 1
    reader = tree.begin_request(4, [doc("x", 8)], 3)
    x_loads = [span for span in reader.plan.load if span.token_start == 4]
    limit = window.load_limit(reader.plan)
    # Either the tree does not read x from those slots, or the engine refuses the load.
    assert all(not set(s.slots) & written for s in x_loads) or (limit is not None and limit <= 4)
