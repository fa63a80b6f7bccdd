"""The lease of victims (docs/design.md 2.2): the host lease is topped up with the host tier's
least-wanted copies, still served, which the engine overwrites only when its free lent slots
run out. The tree's side (lending, an overwrite applied before the copy onto its slots, the
victim's host children, invalidation, a lost engine), the window's (overwrites in order, a
restated lease, refusals) and the scheduler side's refusal of a load from an overwritten
victim by a plan made before the tree heard of it. On the real engine:
tests/test_exact_eviction.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.engine.connector.config import RESULT_KEY
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.spans import plan_problems
from ragcache_core.engine.connector.window import EvictionWindow
from ragcache_core.plan import PLAN_KEY, HostLease, KeepSpan, LoadSpan, Plan, Tier
from ragcache_core.storage.pool_layout import PoolLayout
from ragcache_core.tree import KnowledgeTree, RootKey
from ragcache_core.tree.node import Node
from tests._tree_helpers import ROOT, cached_paths, doc, node_path


def _ahead(window: Any, pool: Any) -> list[Any]:
    """The step's eviction-time copies (at hand-out, then the look-ahead's)."""
    handout, lookahead = window.step_writes(pool)
    return [*handout, *lookahead]


PAGE = 4


def _tree(host_slots: int, lease: int) -> KnowledgeTree:
    return KnowledgeTree(
        ROOT, host_slots=host_slots, page_size=PAGE, host_write="eviction", host_lease_slots=lease
    )


class _Engine:
    """Plays the engine's copies: each keep span into the first lent slots no copy took."""

    def __init__(self, tree: KnowledgeTree) -> None:
        self.tree = tree
        self.seq = 0
        self.taken: set[int] = set()

    def copy(self, plan: Plan, span: KeepSpan, slots: tuple[int, ...] | None = None) -> None:
        assert plan.lease is not None
        if slots is None:
            count = -(-span.num_tokens // PAGE)
            slots = tuple(s for s in plan.lease.slots if s not in self.taken)[:count]
        self.taken.update(slots)
        self.seq += 1
        self.tree.apply_host_writes([(self.seq, span.key, slots)], [])

    def serve(self, *names: str) -> Plan:
        """One request of documents `names` (8 tokens each, a 4-token root), confirmed, its
        kept paths copied."""
        handle = self.tree.begin_request(4, [doc(n, 8) for n in names], 3)
        self.tree.confirm(handle)
        for span in handle.plan.keep:
            self.copy(handle.plan, span)
        return handle.plan


def _a_lent() -> tuple[KnowledgeTree, _Engine, Node, int]:
    """A tree whose host holds the root and document a, with a lent as the only victim."""
    tree = _tree(host_slots=32, lease=8)
    engine = _Engine(tree)
    engine.serve("a")
    assert tree._placement.lend_victims(1) == 2  # the only host leaf: a
    ((vid, a),) = tree._placement.host_victims.items()
    return tree, engine, a, vid


def _on_host(tree: KnowledgeTree) -> set[tuple[str, ...]]:
    return {p for p, tiers in cached_paths(tree).items() if "host" in tiers}


def _node(tree: KnowledgeTree, slots: tuple[int, ...]) -> Node:
    (node,) = [n for n in tree.iter_nodes() if n.slots.get(Tier.HOST) == slots]
    return node


def test_the_lease_is_topped_up_with_victims_that_stay_readable() -> None:
    tree = _tree(host_slots=10, lease=5)
    engine = _Engine(tree)
    for name in "abc":  # the root (1 slot), then a, b and c (2 slots each)
        engine.serve(name)
    assert _on_host(tree) == {(), ("a",), ("b",), ("c",)}
    # 7 slots owned, 3 lent and free, none free in the tier: the lease is topped up to 5 by
    # lending a leaf, not by evicting it.
    handle = tree.begin_request(4, [doc("d", 8)], 3)
    lease = handle.plan.lease
    assert lease is not None and len(lease.slots) == 3 and len(lease.victims) == 1
    vid, victim_slots = lease.victims[0]
    victim = _node(tree, victim_slots)
    assert node_path(victim) in {("a",), ("b",), ("c",)} and victim.lent == vid
    assert _on_host(tree) == {(), ("a",), ("b",), ("c",)}  # nothing evicted
    assert plan_problems(handle.plan, prompt_len=15, page_size=PAGE, host_slots=10) == []
    tree.confirm(handle)
    tree.check_integrity()
    # Still served: a plan reads it from the host, and the next lease lends it again.
    reader = tree.begin_request(4, [doc(victim.key.doc_id, 8)], 3)  # type: ignore[union-attr]
    assert [s.slots for s in reader.plan.load][-1] == victim_slots
    assert reader.plan.lease is not None and reader.plan.lease.victims == lease.victims
    tree.confirm(reader)
    # The engine overwrites it with d's copy: the overwrite (numbered first) makes its slots
    # the lease's, then the copy lands on them.
    (d_span,) = handle.plan.keep
    engine.seq += 1
    tree.apply_host_writes(
        [(engine.seq + 1, d_span.key, victim_slots)], [], overwritten=[(engine.seq, vid)]
    )
    assert _on_host(tree) == {(), ("a",), ("b",), ("c",), ("d",)} - {node_path(victim)}
    assert cached_paths(tree)[node_path(victim)] == {"vllm"}  # vLLM's blocks still hold it
    assert victim.lent == 0 and tree.host_writes is not None
    assert tree.host_writes.overwritten == 1
    nxt = tree.begin_request(4, [doc("e", 8)], 3)
    assert nxt.plan.lease is not None and vid not in dict(nxt.plan.lease.victims)
    tree.confirm(nxt)
    tree.check_integrity()


def test_an_overwritten_victims_host_children_leave_with_it() -> None:
    tree, engine, a, vid = _a_lent()
    placement = tree._placement
    assert node_path(a) == ("a",)
    a_slots = a.slots[Tier.HOST]
    engine.serve("a", "b")  # reads a from the host; b's copy lands below it
    assert _on_host(tree) == {(), ("a",), ("a", "b")}
    tree.check_integrity()
    engine.seq += 1
    tree.apply_host_writes([], [], overwritten=[(engine.seq, vid)])
    assert _on_host(tree) == {()}
    assert ("a", "b") not in cached_paths(tree)  # a host copy needs its parent's
    assert set(a_slots) <= placement.host_lease  # lent now, free for the engine's copies
    tree.check_integrity()


def test_a_victim_invalidated_gives_its_slots_to_the_lease_and_a_late_overwrite_is_moot() -> None:
    tree, engine, a, vid = _a_lent()
    placement = tree._placement
    slots = a.slots[Tier.HOST]
    free = placement.tiers[Tier.HOST].allocator.num_free
    tree.invalidate("a")
    assert set(slots) <= placement.host_lease and not placement.host_victims
    assert placement.tiers[Tier.HOST].allocator.num_free == free  # not given to anything else
    tree.check_integrity()
    engine.seq += 1
    tree.apply_host_writes([], [], overwritten=[(engine.seq, vid)])  # it had overwritten it
    tree.check_integrity()


def test_a_lost_engine_takes_every_lent_victim_with_it() -> None:
    tree, *_ = _a_lent()
    tree.drop_tier(Tier.GPU)
    assert _on_host(tree) == {()} and not tree._placement.host_victims
    tree.check_integrity()


def test_a_root_of_no_tokens_is_never_lent_as_a_victim() -> None:
    """A prompt with nothing before its first document has a root of no tokens, whose host
    copy holds no slot. Lent as a victim it would give the engine nothing, and its overwrite
    would drop every host copy below it (review 52): it is no eviction candidate at all."""
    tree = _tree(host_slots=8, lease=4)
    engine = _Engine(tree)
    engine.serve("x")  # the root (1 slot) and x (2)
    engine.serve("y")  # y (2): 1 slot left free
    bare = RootKey("model", "tokenizer", "no-text-before-the-documents", "float16")
    handle = tree.begin_request(0, [doc("a", 8)], 3, root_key=bare)
    tree.confirm(handle)
    (a_span,) = handle.plan.keep  # the bare root's copy of no slot is planned ready
    assert handle.plan.lease is not None
    free = [s for s in handle.plan.lease.slots if s in tree._placement.host_lease][:2]
    engine.seq += 1
    tree.apply_host_writes([(engine.seq, a_span.key, tuple(free))], [])
    assert ("a",) in _on_host(tree)
    reader = tree.begin_request(0, [doc("a", 8)], 3, root_key=bare)  # tops the lease up
    assert reader.plan.lease is not None and reader.plan.lease.victims
    assert all(slots for _, slots in reader.plan.lease.victims)
    tree.confirm(reader)
    tree.check_integrity()


def test_a_lost_engines_late_report_is_ignored() -> None:
    """A report the lost engine made, applied after the loss (its request's settle ran after
    the supervisor's restart dropped the GPU tier), is ignored and counted: its numbers would
    otherwise hide the new engine's copies, numbered from 1 again (review 52)."""
    tree = _tree(host_slots=32, lease=8)
    old = _Engine(tree)
    old.serve("x")  # the root and x: copies 1 and 2
    handle = tree.begin_request(4, [doc("x", 8), doc("y", 8)], 3)
    tree.confirm(handle)
    assert handle.plan.lease is not None
    (y_span,) = handle.plan.keep
    lent = tuple(s for s in handle.plan.lease.slots if s in tree._placement.host_lease)
    tree.drop_tier(Tier.GPU)  # the engine died; the supervisor restarts it
    tree.apply_host_writes(
        [(3, y_span.key, lent[:2])], [], engine_generation=handle.engine_generation
    )
    assert tree.host_writes is not None and tree.host_writes.stale_reports == 1
    assert ("x", "y") not in _on_host(tree)
    new = _Engine(tree)  # numbers from 1
    plan = new.serve("z")
    assert plan.lease is not None and ("z",) in _on_host(tree)
    tree.check_integrity()


# ---------------------------------------------------------------------- the engine's side

BLOCK = 4
WINDOW_PAGE = 2
KEEP = (KeepSpan(7, None, 0, 6), KeepSpan(8, 7, 6, 6))  # 3 + 3 slots


def _leaving(num_blocks: int = 16) -> tuple[BlockPool, list[int]]:
    """A pool whose finished request's 4 cached blocks (12 kept tokens and a question block)
    are at the head of the free queue, about to be evicted."""
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BLOCK)
    blocks = pool.get_new_blocks(4)
    for i, block in enumerate(blocks):
        key = make_block_hash_with_group_id(f"v{i}".encode(), 0)
        block.set_block_hash(key, BLOCK)
        pool.cached_block_hash_to_block.insert(key, block)
    ids = [b.block_id for b in blocks]
    return pool, ids


def _push(pool: BlockPool, ids: list[int]) -> None:
    pool.free_blocks(reversed([pool.blocks[i] for i in ids]))
    pool.get_new_blocks(pool.get_num_free_blocks() - 4)


VICTIMS = ((5, (10, 11)), (6, (12, 13, 14, 15)))


def test_the_window_overwrites_victims_least_wanted_first_only_when_free_slots_run_out() -> None:
    pool, ids = _leaving()
    window = EvictionWindow(window_blocks=3, block_size=BLOCK, page_size=WINDOW_PAGE)
    window.take_lease(HostLease(1, 1, 0, slots=(0, 1), victims=VICTIMS))
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _push(pool, ids)
    writes = _ahead(window, pool)
    assert [w.key for w in writes] == [7, 8]
    assert [w.slots for w in writes] == [(0, 1, 10), (11, 12, 13)]
    assert window.take_overwritten() == ((1, 5), (2, 6))  # both were needed, in lease order
    window.on_report({7, 8}, pool)
    copied, _, _ = window.take_changes()
    assert [(seq, key) for seq, key, _ in copied] == [(3, 7), (4, 8)]
    # The lease restated before the tree applied any of it: the overwritten victims are not
    # victims any more, and their slots the copies did not take are free.
    window.take_lease(HostLease(1, 2, 0, slots=(0, 1), victims=VICTIMS))
    assert len(window._lease) == 2  # 14 and 15
    # A plan made before the tree heard of the overwrites must not load from their slots;
    # one made after may (the slots hold the new copies then).
    reads = (LoadSpan(Tier.HOST, (20,), 0, 2), LoadSpan(Tier.HOST, (12, 13), 2, 4))
    stale = Plan(page_size=WINDOW_PAGE, load=reads, lease=HostLease(1, 2, 0, ()))
    assert window.load_limit(stale) == 2
    fresh = Plan(page_size=WINDOW_PAGE, load=reads, lease=HostLease(1, 3, 2, ()))
    assert window.load_limit(fresh) is None


def test_a_lease_with_a_victim_of_no_slots_is_refused() -> None:
    """The tree lends none (above); a plan that did would be refused whole by the engine."""
    lease = HostLease(1, 1, 0, slots=(0, 1), victims=((4, ()), *VICTIMS))
    problems = plan_problems(
        Plan(page_size=PAGE, lease=lease), prompt_len=8, page_size=PAGE, host_slots=32
    )
    assert problems == ["the lease lends a victim of no slots (its overwrite frees nothing)"]


def test_without_room_even_with_every_victim_nothing_is_overwritten() -> None:
    pool, ids = _leaving()
    window = EvictionWindow(window_blocks=3, block_size=BLOCK, page_size=WINDOW_PAGE)
    window.take_lease(HostLease(1, 1, 0, slots=(0,), victims=((5, (10,)),)))  # 2 of 3 and 6
    window.record(KEEP, ids, pool, epoch=1, version=1)
    _push(pool, ids)
    assert _ahead(window, pool) == [] and window.take_overwritten() == ()


def test_the_scheduler_side_answers_fewer_tokens_past_an_overwritten_victim() -> None:
    layout = PoolLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float32", page_size=2)
    config = ConnectorConfig(
        layout=layout, host_slots=32, host_pool_name="x", host_write="eviction", window_blocks=3
    )
    side = SchedulerSide(config, BLOCK)
    pool, ids = _leaving()
    side.bind_block_pool(pool)
    lease = HostLease(epoch=1, version=1, applied=0, slots=(0, 1), victims=VICTIMS)
    writer = Plan(page_size=2, keep=KEEP, lease=lease)
    assert side.track_and_count_loads("w", {PLAN_KEY: writer.to_json()}, 15, 0) == 0
    side.after_alloc("w", 0)
    cached = SimpleNamespace(
        req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]
    )

    def step(new: list[Any], scheduled: dict[str, int]) -> Any:
        out = SimpleNamespace(
            num_scheduled_tokens=scheduled, scheduled_new_reqs=new, scheduled_cached_reqs=cached
        )
        return side.build_step(out)

    step([SimpleNamespace(req_id="w", block_ids=[ids], num_computed_tokens=0)], {"w": 15})
    side.finished("w")
    _push(pool, ids)
    assert len(step([], {}).host_writes) == 2  # victims 5 and 6 overwritten
    # A plan made while the tree still served victim 6 reads it: the connector loads the
    # tokens before it and refuses the rest (vLLM computes them).
    reads = (LoadSpan(Tier.HOST, (2, 3), 0, 4), LoadSpan(Tier.HOST, (12, 13), 4, 4))
    reader = Plan(page_size=2, load=reads, lease=HostLease(1, 1, 0, (0, 1), VICTIMS))
    assert side.track_and_count_loads("r", {PLAN_KEY: reader.to_json()}, 12, 0) == 4
    side.after_alloc("r", 4)
    result = ConnectorResult.from_json(side.finished("r")[RESULT_KEY])  # type: ignore[index]
    assert result.overwritten_tokens == 4 and result.loaded_tokens == 4
    assert [vid for _, vid in result.host_overwritten] == [5, 6]
    # Once the tree applied the overwrites (applied >= 2), a plan reading those slots loads.
    later = Plan(page_size=2, load=reads, lease=HostLease(1, 2, 4, (0, 1)))
    assert side.track_and_count_loads("s", {PLAN_KEY: later.to_json()}, 12, 0) == 8


def test_a_lost_overwrite_report_is_healed_by_the_copy_onto_its_slots() -> None:
    tree, engine, a, vid = _a_lent()
    placement = tree._placement
    a_slots = a.slots[Tier.HOST]
    handle = tree.begin_request(4, [doc("d", 8)], 3)
    tree.confirm(handle)
    # The engine overwrote a (its report lost) and copied d onto its slots (reported).
    engine.seq += 2
    tree.apply_host_writes([(engine.seq, handle.plan.keep[0].key, a_slots)], [])
    assert _on_host(tree) == {(), ("d",)} and vid not in placement.host_victims
    assert tree.host_writes is not None and tree.host_writes.overwritten == 1
    tree.check_integrity()


def test_a_detached_pinned_victim_with_a_pinned_host_child_is_overwritten_cleanly() -> None:
    tree, engine, _, vid = _a_lent()
    placement = tree._placement
    engine.serve("a", "b")
    reader = tree.begin_request(4, [doc("a", 8), doc("b", 8)], 3)  # pins a and b
    assert len(reader.plan.load) == 3
    tree.invalidate("a")  # both detached, kept for the reader
    engine.seq += 1
    tree.apply_host_writes([], [], overwritten=[(engine.seq, vid)])
    assert not placement.host_victims
    tree.check_integrity()
    tree.confirm(reader)
    tree.check_integrity()


def test_a_failed_copy_onto_victims_tears_them_and_a_lost_report_never_makes_them_readable() -> (
    None
):
    pool, ids = _leaving()
    window = EvictionWindow(window_blocks=3, block_size=BLOCK, page_size=WINDOW_PAGE)
    window.take_lease(HostLease(1, 1, 0, slots=(), victims=VICTIMS))
    window.record(KEEP, ids, pool, epoch=1, version=1, fail=True)
    _push(pool, ids)
    assert len(_ahead(window, pool)) == 2
    window.on_report(set(), pool)  # the copies failed: the victims are torn all the same
    assert window.take_overwritten() == ((1, 5), (2, 6))  # and this report is lost
    # The tree applied a later number from elsewhere; its next lease still lends 5 and 6.
    window.take_lease(HostLease(1, 2, 2, slots=(), victims=VICTIMS))
    assert not window._victims and len(window._lease) == 6  # free lent slots, not victims
    reads = (LoadSpan(Tier.HOST, (20,), 0, 2), LoadSpan(Tier.HOST, (10, 11), 2, 4))
    stale = Plan(page_size=WINDOW_PAGE, load=reads, lease=HostLease(1, 2, 2, (), VICTIMS))
    assert window.load_limit(stale) == 2  # applied is past 1, but it still lends victim 5
