"""Eviction-time host writes, the tree's side (`tree/host_writes.py`): keep spans and the lease
in plans, copies applied once, hierarchy, clear/invalidate/engine loss, and the integrity
check. The engine's side is tests/test_eviction_window.py; on the real engine,
tests/test_exact_eviction.py."""

from __future__ import annotations

import pytest

from ragcache_core.engine.connector.spans import plan_problems
from ragcache_core.errors import ConfigError
from ragcache_core.plan import KeepSpan, Plan, Tier, WindowLosses
from ragcache_core.tree import KnowledgeTree
from ragcache_core.tree.integrity import IntegrityError
from tests._tree_helpers import ROOT, cached_paths, doc

PAGE = 4


def _tree(host_slots: int = 32, lease: int = 8, **kwargs: object) -> KnowledgeTree:
    return KnowledgeTree(
        ROOT,
        host_slots=host_slots,
        page_size=PAGE,
        host_write="eviction",
        host_lease_slots=lease,
        **kwargs,  # type: ignore[arg-type]
    )


def _copy(tree: KnowledgeTree, plan: Plan, seq: int, span: KeepSpan) -> tuple[int, ...]:
    """Play the engine: copy `span` into the first free slots of the plan's lease."""
    assert plan.lease is not None
    count = -(-span.num_tokens // PAGE)
    slots = tuple(s for s in plan.lease.slots if s not in _TAKEN)[:count]
    _TAKEN.update(slots)
    tree.apply_host_writes([(seq, span.key, slots)], [])
    return slots


_TAKEN: set[int] = set()


@pytest.fixture(autouse=True)
def _fresh() -> None:
    _TAKEN.clear()


def test_a_plan_keeps_the_path_and_lends_a_lease_instead_of_storing() -> None:
    tree = _tree(host_slots=64)
    handle = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3)
    plan = handle.plan
    # The lease: every free slot, up to half the tier (nothing else takes free host slots).
    assert plan.store == () and plan.lease is not None and len(plan.lease.slots) == 32
    # Its target, what victims would make up for in a full tier: a step's budget (8 slots),
    # what its prefill makes vLLM hand out (22 tokens: 6 slots) and what the plan keeps
    # (2 + 2 + 2 slots: a block handed out can start the copy of a document with its uncopied
    # ancestors).
    assert tree.host_writes is not None and tree.host_writes.lease_target() == 8 + 6 + 6
    assert [(k.token_start, k.num_tokens) for k in plan.keep] == [(0, 5), (5, 8), (13, 6)]
    assert plan.keep[0].parent is None
    assert plan.keep[1].parent == plan.keep[0].key and plan.keep[2].parent == plan.keep[1].key
    assert plan_problems(plan, prompt_len=22, page_size=PAGE, host_slots=64) == []
    tree.confirm(handle)
    # Nothing on the host until the engine copies it; vLLM's blocks hold the path now.
    assert cached_paths(tree) == {(): {"vllm"}, ("a",): {"vllm"}, ("a", "b"): {"vllm"}}
    tree.check_integrity()  # the lease is counted: owned + leased + free == capacity
    # The same path in a later plan has the same keys (the engine's records are per key).
    again = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3)
    assert [k.key for k in again.plan.keep] == [k.key for k in plan.keep]
    assert again.plan.lease is not None and again.plan.lease.version > plan.lease.version
    tree.confirm(again)


def test_copies_become_host_hits_root_first_and_each_is_applied_once() -> None:
    tree = _tree(host_slots=64)
    handle = tree.begin_request(5, [doc("a", 8)], 3)
    tree.confirm(handle)
    root_span, a_span = handle.plan.keep
    _copy(tree, handle.plan, 1, root_span)
    _copy(tree, handle.plan, 2, a_span)
    assert cached_paths(tree) == {(): {"host", "vllm"}, ("a",): {"host", "vllm"}}
    tree.apply_host_writes([(2, a_span.key, (30, 31))], [])  # seen already: ignored
    tree.check_integrity()
    nxt = tree.begin_request(5, [doc("a", 8), doc("b", 4)], 3)
    assert [(s.token_start, s.num_tokens) for s in nxt.plan.load] == [(0, 5), (5, 8)]
    assert [(k.token_start, k.num_tokens, k.parent) for k in nxt.plan.keep] == [(13, 4, None)]
    assert nxt.plan.lease is not None and nxt.plan.lease.applied == 2
    # Topped up again with free room, to half the tier; its target: the budget (8), what its
    # prefill makes vLLM hand out (13 tokens loaded and 7 computed: 5 slots), the most a plan
    # kept (the first: root and a, 2 + 2).
    assert len(nxt.plan.lease.slots) == 32
    assert tree.host_writes is not None and tree.host_writes.lease_target() == 8 + 5 + 4
    tree.confirm(nxt)
    tree.check_integrity()


def test_a_copy_whose_parent_is_not_on_the_host_frees_its_slots() -> None:
    tree = _tree()
    handle = tree.begin_request(5, [doc("a", 8)], 3)
    tree.confirm(handle)
    free = tree._placement.tiers[Tier.HOST].allocator.num_free
    _copy(tree, handle.plan, 1, handle.plan.keep[1])  # the document without its root
    assert cached_paths(tree) == {(): {"vllm"}, ("a",): {"vllm"}}
    assert tree._placement.tiers[Tier.HOST].allocator.num_free == free + 2
    assert tree.host_writes is not None and tree.host_writes.wasted == 1
    tree.check_integrity()


def test_clear_and_invalidate_make_later_copies_land_nowhere() -> None:
    tree = _tree()
    handle = tree.begin_request(5, [doc("a", 8)], 3)
    tree.confirm(handle)
    root_span, a_span = handle.plan.keep
    tree.invalidate("a")
    _copy(tree, handle.plan, 1, root_span)
    _copy(tree, handle.plan, 2, a_span)
    assert cached_paths(tree) == {(): {"host", "vllm"}}  # the invalidated one never lands
    tree.check_integrity()
    other = tree.begin_request(5, [doc("c", 8)], 3)
    tree.confirm(other)
    tree.clear()
    _copy(tree, other.plan, 3, other.plan.keep[0])
    assert cached_paths(tree) == {}
    tree.check_integrity()


def test_a_lost_engine_numbers_copies_from_one_again() -> None:
    tree = _tree()
    handle = tree.begin_request(5, [doc("a", 8)], 3)
    tree.confirm(handle)
    _copy(tree, handle.plan, 1, handle.plan.keep[0])
    tree.drop_tier(Tier.GPU)
    assert cached_paths(tree) == {(): {"host"}}  # vLLM's blocks went with the engine
    second = tree.begin_request(5, [doc("a", 8)], 3)
    assert second.plan.lease is not None and second.plan.lease.applied == 0
    tree.confirm(second)
    _copy(tree, second.plan, 1, second.plan.keep[0])  # the new engine's first copy
    assert cached_paths(tree) == {(): {"host"}, ("a",): {"host", "vllm"}}
    tree.check_integrity()


def test_without_victims_the_lease_is_made_by_evicting_host_leaves_by_the_policy() -> None:
    tree = _tree(host_slots=10, lease=5, host_lease_victims=False)
    seq = 0
    for name in "abc":  # the root (1 slot), then a, b and c (2 slots each) copied
        handle = tree.begin_request(4, [doc(name, 8)], 3)
        tree.confirm(handle)
        for span in handle.plan.keep:
            seq += 1
            _copy(tree, handle.plan, seq, span)
    on_host = {p for p, tiers in cached_paths(tree).items() if "host" in tiers}
    assert on_host == {(), ("a",), ("b",), ("c",)}
    # 7 slots owned, 3 still leased, 0 free: topping the lease up to 5 evicts one leaf from
    # the host; vLLM's blocks still hold it, so it stays a node.
    nxt = tree.begin_request(4, [doc("d", 8)], 3)
    tree.confirm(nxt)
    assert nxt.plan.lease is not None and len(nxt.plan.lease.slots) == 5
    paths = cached_paths(tree)
    assert [p for p in (("a",), ("b",), ("c",)) if paths[p] == {"vllm"}] != []
    assert sum(1 for tiers in paths.values() if "host" in tiers) == 3
    tree.check_integrity()


def test_the_lease_is_at_most_half_the_host_tier() -> None:
    tree = _tree(host_slots=10, lease=8)
    handle = tree.begin_request(4, [doc("a", 8)], 3)
    assert handle.plan.lease is not None and len(handle.plan.lease.slots) == 5
    tree.confirm(handle)
    tree.check_integrity()


def test_a_tier_with_room_lends_it_all_and_a_full_one_lends_victims_up_to_the_target() -> None:
    """Free host slots cost nothing lent (only copies take them): all of them, up to half the
    tier, so no kept document waits on a late report while the tier has room. A full tier
    lends its least-wanted copies as victims, up to the target: what a step and the open
    requests can make vLLM hand out."""
    tree = _tree(host_slots=24, lease=2)
    writes = tree.host_writes
    assert writes is not None
    first = tree.begin_request(4, [doc("a", 8)], 3)
    tree.confirm(first)
    assert first.plan.lease is not None and len(first.plan.lease.slots) == 12
    assert first.plan.lease.victims == ()
    # Copies fill the tier: every document the engine reports copied takes lent slots.
    seq, used = 0, set()
    for i in range(8):
        handle = tree.begin_request(4, [doc(f"d{i}", 8)], 3)
        tree.confirm(handle)
        assert handle.plan.lease is not None
        for span in handle.plan.keep:
            count = -(-span.num_tokens // PAGE)
            slots = tuple(s for s in handle.plan.lease.slots if s not in used)[:count]
            if len(slots) < count:
                break
            seq += 1
            used.update(slots)
            tree.apply_host_writes([(seq, span.key, slots)], [])
        tree.check_integrity()
    last = tree.begin_request(4, [doc("z", 8)], 3)
    assert last.plan.lease is not None
    lent = len(last.plan.lease.slots) + sum(len(v) for _, v in last.plan.lease.victims)
    assert last.plan.lease.victims and lent >= writes.lease_target()
    tree.confirm(last)
    tree.check_integrity()


def test_the_lease_grows_while_copies_outrun_it_and_shrinks_back_while_it_idles() -> None:
    """The lease of empty room (`host_lease_victims=False`) is its target exactly: its budget
    part adapts to the reports."""
    tree = _tree(host_slots=64, lease=4, host_lease_victims=False)
    writes = tree.host_writes
    assert writes is not None and writes.max_lease_slots == 16

    def lease_of_next_plan() -> int:
        handle = tree.begin_request(4, [doc(f"d{lease_of_next_plan.n}", 8)], 3)
        lease_of_next_plan.n += 1
        tree.confirm(handle)
        assert handle.plan.lease is not None
        return len(handle.plan.lease.slots)

    lease_of_next_plan.n = 0  # type: ignore[attr-defined]
    # Part of every lease: what each plan's prefill makes vLLM hand out (the first's 15
    # tokens, 4 slots; later ones find the root in vLLM's blocks: 11 tokens, 3 slots) and
    # the most a plan keeps (root 1 slot, its document 2).
    longest = 3 + 3
    assert lease_of_next_plan() == 4 + 4 + 3
    # Each report of a refusal doubles its budget part, up to 4 times its start; lent slots
    # stay lent.
    for expected in (8, 16, 16):
        tree.apply_host_writes([], [], lost=WindowLosses(no_lease=1))
        assert writes.lease_slots == expected and lease_of_next_plan() == expected + longest
    assert writes.lease_peak == 16 + longest
    # Reports without refusals, the lease unused: a quarter of its growth back each time, and
    # never below its start; the lent slots are not taken back (only the top-ups stop).
    sizes = []
    for _ in range(12):
        tree.apply_host_writes([], [])
        sizes.append(writes.lease_slots)
    assert sizes[:3] == [13, 11, 10] and sizes[-1] == 4 and sorted(sizes, reverse=True) == sizes
    assert lease_of_next_plan() == 16 + longest  # nothing freed
    tree.clear()
    assert writes.lease_slots == 4 and writes.lease_peak == 4
    tree.check_integrity()


def test_a_lease_in_use_does_not_shrink() -> None:
    """A report without refusals but with most of the lease used up keeps its size."""
    tree = _tree(host_slots=64, lease=4, host_lease_max_slots=8, host_lease_victims=False)
    writes = tree.host_writes
    assert writes is not None
    tree.apply_host_writes([], [], lost=WindowLosses(no_lease=2))
    handle = tree.begin_request(4, [doc("a", 28), doc("b", 28), doc("c", 28)], 3)
    tree.confirm(handle)
    # Its budget part (8), its prefill (91 tokens: 23 slots) and what it keeps (1 + 3 x 7),
    # at most half the host tier.
    assert handle.plan.lease is not None and len(handle.plan.lease.slots) == 32
    lent = list(handle.plan.lease.slots)
    copies = []  # one report: the root (1 slot), a, b and c (7 each): 22 of the 32 used
    for seq, span in enumerate(handle.plan.keep, start=1):
        count = -(-span.num_tokens // PAGE)
        copies.append((seq, span.key, tuple(lent[:count])))
        del lent[:count]
    tree.apply_host_writes(copies, [])
    assert len(writes.lease) == 10 and writes.lease_slots == 8
    tree.apply_host_writes([], [])  # 10 unused, less than half of 8 + 22: still in use
    assert writes.lease_slots == 8
    tree.check_integrity()


def test_an_engine_report_of_stranded_blocks_fails_the_integrity_check() -> None:
    tree = _tree()
    tree.apply_host_writes([], [], stranded_blocks=3)
    with pytest.raises(IntegrityError, match="3 blocks held"):
        tree.check_integrity()


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="host_write"):
        _tree().__class__(ROOT, host_slots=8, page_size=PAGE, host_write="lazy")
    with pytest.raises(ConfigError, match="host_lease_max_slots"):
        _tree(lease=8, host_lease_max_slots=4)


def test_keep_spans_are_checked_by_the_connector() -> None:
    bad = Plan(page_size=PAGE, keep=(KeepSpan(1, 0, 0, 4), KeepSpan(1, None, 2, 0)))
    problems = plan_problems(bad, prompt_len=10, page_size=PAGE, host_slots=8)
    assert any("not an earlier keep span" in p for p in problems)
    assert any("repeat a key" in p for p in problems)
    assert any("keep[1]" in p for p in problems)


# ---------------------------------------------------------------------- both tiers


def test_a_path_in_vllms_blocks_alone_is_a_node_hit_ordered_and_invalidated() -> None:
    tree = _tree()
    first = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3)
    tree.confirm(first)
    match = tree.match([doc("a", 8), doc("b", 6)])
    assert match.hits == () and match.in_flight == 0  # nothing to load, nothing blocks
    assert match.vllm_tokens == 5 + 8 + 6
    assert tree.cached_tokens([doc("a", 8), doc("b", 6)]) == 19
    assert tree.cache_order(["b", "a"]) == (1, 0)  # follows the path vLLM's blocks hold
    again = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3)
    assert again.cached_tokens == 19 and again.plan.load == ()  # vLLM serves it by itself
    assert [k.key for k in again.plan.keep] == [k.key for k in first.plan.keep]
    tree.confirm(again)
    assert tree.stats().nodes == 3
    assert tree.invalidate("a") == 2  # the document and the one computed after it
    assert cached_paths(tree) == {(): {"vllm"}}
    tree.check_integrity()


def test_one_access_is_counted_once_on_a_node_and_its_shadow() -> None:
    tree = _tree()
    tree.confirm(tree.begin_request(5, [doc("a", 8)], 3))
    node = next(n for n in tree.iter_nodes() if n.parent is not None)
    before = (node.stats.frequency, node.stats.accesses, node.stats.num_computed)
    assert before == (1, 1, 1)
    tree.confirm(tree.begin_request(5, [doc("a", 8)], 3))
    # One more retrieval, and a hit (vLLM's blocks served it): no cost sample.
    assert (node.stats.frequency, node.stats.accesses, node.stats.num_computed) == (2, 2, 1)
    assert tree.host_writes is not None
    shadow = tree.host_writes.shadow(ROOT, (doc("a", 8).key,), 8, node.stats)
    assert shadow.stats is node.stats


def test_a_path_gone_from_vllms_blocks_leaves_unless_the_host_holds_it() -> None:
    tree = _tree()
    handle = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3)
    tree.confirm(handle)
    assert handle.plan.lease is not None
    version = handle.plan.lease.version
    root_span, a_span, b_span = handle.plan.keep
    _copy(tree, handle.plan, 1, root_span)
    tree.apply_host_writes([], [], gone=[(a_span.key, version - 1)])  # an older recording
    assert ("a",) in cached_paths(tree)
    tree.apply_host_writes([], [], gone=[(root_span.key, version), (a_span.key, version)])
    # The root keeps its host copy; "a" had none: it leaves with "b" below it.
    assert cached_paths(tree) == {(): {"host"}}
    tree.check_integrity()
    later = tree.begin_request(5, [doc("a", 8), doc("b", 6)], 3)
    assert later.cached_tokens == 5 and [k.key for k in later.plan.keep] == [
        a_span.key,
        b_span.key,
    ]
    tree.abort(later)
    assert cached_paths(tree) == {(): {"host"}}  # an aborted request computed nothing
    tree.check_integrity()
