"""The protected set without an engine: the tree's bookkeeping (`tree/protected.py`: budget,
PGDSF ranking, prefix closure, releases until the engine confirms them) and the scheduler
side's references on vLLM's blocks (`SchedulerSide._protect`), over a block pool that counts
references the way vLLM's does. The same code runs in the real engine in
tests/test_ragcache_protected.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ragcache_core.engine.connector import ConnectorConfig, ConnectorResult
from ragcache_core.engine.connector.scheduler_side import SchedulerSide
from ragcache_core.engine.connector.spans import plan_problems
from ragcache_core.plan import PLAN_KEY, Plan, ProtectSpan, Tier, protected_blocks
from ragcache_core.storage.pool_layout import PoolLayout
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RootKey
from ragcache_core.tree.integrity import IntegrityError

PAGE = BLOCK = 4
ROOT = RootKey("model", "tokenizer", "template", "float16")


def _tree(budget: int) -> KnowledgeTree:
    return KnowledgeTree(ROOT, gpu_slots=0, host_slots=64, page_size=PAGE, protected_tokens=budget)


def _doc(name: str, tokens: int = 8) -> DocSpec:
    return DocSpec(DocKey(name, name), tokens)


def _run(
    tree: KnowledgeTree, docs: list[DocSpec], held: bool = True
) -> tuple[Plan, tuple[int, ...]]:
    """One request: plan, confirm, and the engine's report (every protect entry held, or
    none, and every release done)."""
    handle = tree.begin_request(4, docs, 2)
    plan = handle.plan
    tree.confirm(handle)
    protected = tuple(span.key for span in plan.protect) if held else ()
    tree.settle_protection(handle, protected, plan.release)
    tree.check_integrity()
    return plan, protected


def test_blocks_of_a_span_are_those_whose_last_token_lies_in_it() -> None:
    assert protected_blocks(0, 8, 4) == range(0, 2)
    assert protected_blocks(6, 8, 4) == range(1, 3)  # the seam block 1 goes to the later span
    assert protected_blocks(5, 2, 4) == range(1, 1)  # inside one block: nothing of its own


def test_protect_spans_follow_the_path_and_fit_the_budget() -> None:
    tree = _tree(budget=12)
    plan, held = _run(tree, [_doc("a"), _doc("b")])
    # root (4 tokens, 1 block) and a (8 tokens, 2 blocks) fit; b would need 8 more.
    assert [(s.token_start, s.num_tokens) for s in plan.protect] == [(0, 4), (4, 8)]
    assert tree.protected.protected_tokens == 12 and len(held) == 2
    again, _ = _run(tree, [_doc("a"), _doc("b")])
    assert again.protect == ()  # held already; b still does not fit beside them


def test_a_higher_ranked_document_takes_a_lower_ranked_leafs_place() -> None:
    tree = _tree(budget=12)
    _run(tree, [_doc("a")])
    for _ in range(3):  # b becomes the more frequent document
        _run(tree, [_doc("b")])
    nodes = {n.key.doc_id: n for n in tree.iter_nodes() if isinstance(n.key, DocKey)}
    assert tree.protected.is_protected(nodes["b"]) and not tree.protected.is_protected(nodes["a"])
    assert tree.protected.releases >= 1


def test_releases_are_sent_until_the_engine_confirms_them() -> None:
    tree = _tree(budget=64)
    first, _ = _run(tree, [_doc("a"), _doc("b")])
    tree.invalidate("b")
    handle = tree.begin_request(4, [_doc("c")], 2)
    b_key = first.protect[-1].key
    assert b_key in handle.plan.release
    tree.confirm(handle)
    tree.settle_protection(handle, (), ())  # a report without the release: sent again
    again = tree.begin_request(4, [_doc("c")], 2)
    assert b_key in again.plan.release
    tree.confirm(again)
    tree.settle_protection(again, (), (b_key,))
    assert tree.protected.releasing_tokens == 0
    tree.check_integrity()


def test_an_entry_the_engine_did_not_hold_leaves_with_its_descendants() -> None:
    tree = _tree(budget=64)
    handle = tree.begin_request(4, [_doc("a"), _doc("b")], 2)
    root_key = handle.plan.protect[0].key
    tree.confirm(handle)
    # The engine held the root only (a's blocks were not all cached): a and b leave; b is
    # released (the engine may hold it if a later report says so) to keep the set closed.
    tree.settle_protection(handle, (root_key,), ())
    assert len(tree.protected) == 1
    tree.check_integrity()


def test_a_request_ended_without_a_report_releases_its_entries() -> None:
    tree = _tree(budget=64)
    handle = tree.begin_request(4, [_doc("a")], 2)
    keys = [span.key for span in handle.plan.protect]
    tree.abort(handle)
    tree.abandon_protection(handle)
    assert len(tree.protected) == 0
    assert tree.protected.releasing_tokens == 4 + 8
    nxt = tree.begin_request(4, [_doc("a")], 2)
    assert set(keys) <= set(nxt.plan.release)
    tree.abort(nxt)
    tree.abandon_protection(nxt)


def test_clear_and_engine_loss_empty_the_set() -> None:
    tree = _tree(budget=64)
    _run(tree, [_doc("a")])
    tree.clear()
    assert len(tree.protected) == 0 and tree.protected.releasing_tokens > 0
    tree.protected.forget_engine()
    _run(tree, [_doc("a")])
    tree.drop_tier(Tier.GPU)
    assert len(tree.protected) == 0 and tree.protected.releasing_tokens == 0
    tree.check_integrity()


def test_integrity_names_a_set_that_is_not_prefix_closed() -> None:
    tree = _tree(budget=64)
    _run(tree, [_doc("a"), _doc("b")])
    members = tree.protected._members
    a_node = next(n for n in members if isinstance(n.key, DocKey) and n.key.doc_id == "a")
    del members[a_node]
    with pytest.raises(IntegrityError, match="prefix-closed"):
        tree.check_integrity()


def test_a_zero_budget_protects_nothing() -> None:
    tree = _tree(budget=0)
    plan, _ = _run(tree, [_doc("a")])
    assert plan.protect == () and plan.release == ()


# ---------------------------------------------------------------- the scheduler side


class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = b"h%d" % block_id


class _RefCountingPool:
    """vLLM's `BlockPool` reference counting (`touch` / `free_blocks`), nothing else."""

    def __init__(self, n: int) -> None:
        self.blocks = [_Block(i) for i in range(n)]

    def touch(self, blocks: list[_Block]) -> None:
        for block in blocks:
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[_Block]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0
            block.ref_cnt -= 1

    def get_num_free_blocks(self) -> int:
        return sum(block.ref_cnt == 0 for block in self.blocks)

    def evict_blocks(self, block_ids: set[int]) -> None:
        for i in block_ids:
            self.blocks[i].block_hash = None


LAYOUT = PoolLayout(num_layers=1, num_kv_heads=1, head_size=4, page_size=PAGE, dtype="float32")
CONFIG = ConnectorConfig(layout=LAYOUT, host_slots=0, host_pool_name="")


def _scheduled(side: SchedulerSide, req_id: str, plan: Plan, prompt_len: int) -> None:
    """Track `req_id` and schedule its whole prompt in one step on blocks 0.. ."""
    side.track_and_count_loads(req_id, {PLAN_KEY: plan.to_json()}, prompt_len, 0)
    side.after_alloc(req_id, 0)
    blocks = list(range(-(-prompt_len // BLOCK)))
    side.build_step(
        SimpleNamespace(
            scheduled_new_reqs=[
                SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=0)
            ],
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
            ),
            num_scheduled_tokens={req_id: prompt_len},
        )
    )


def _side() -> tuple[SchedulerSide, _RefCountingPool]:
    side = SchedulerSide(CONFIG, BLOCK)
    pool = _RefCountingPool(16)
    side.bind_block_pool(pool)
    return side, pool


PROTECT = Plan(page_size=PAGE, protect=(ProtectSpan(7, 0, 4), ProtectSpan(8, 4, 6)))


def test_a_finished_request_holds_its_blocks_until_released() -> None:
    side, pool = _side()
    _scheduled(side, "a", PROTECT, 14)
    result = ConnectorResult.from_transfer_params(side.finished("a"))
    assert result.protected == (7, 8)
    assert [b.ref_cnt for b in pool.blocks[:4]] == [1, 1, 0, 0]  # block 2 is past span 8
    assert side.protected_blocks == 2
    _scheduled(side, "b", Plan(page_size=PAGE, release=(8, 99)), 4)
    assert [b.ref_cnt for b in pool.blocks[:2]] == [1, 0]
    assert ConnectorResult.from_transfer_params(side.finished("b")).released == (8, 99)
    assert side.release_all() and pool.blocks[0].ref_cnt == 0


def test_an_aborted_request_protects_nothing() -> None:
    side, pool = _side()
    _scheduled(side, "a", PROTECT, 14)
    result = ConnectorResult.from_transfer_params(side.finished("a", aborted=True))
    assert result.protected == () and all(b.ref_cnt == 0 for b in pool.blocks)


def test_an_uncached_block_stops_protection_there() -> None:
    side, pool = _side()
    pool.blocks[1].block_hash = None  # e.g. a failed load's hash, evicted
    _scheduled(side, "a", PROTECT, 14)
    result = ConnectorResult.from_transfer_params(side.finished("a"))
    assert result.protected == (7,)
    assert [b.ref_cnt for b in pool.blocks[:2]] == [1, 0]


def test_memory_pressure_releases_the_lowest_ranked_entries_first() -> None:
    side, pool = _side()
    ranked = Plan(
        page_size=PAGE, protect=(ProtectSpan(1, 0, 4, rank=5.0), ProtectSpan(2, 4, 4, rank=1.0))
    )
    _scheduled(side, "a", ranked, 10)
    side.finished("a")
    assert side.protected_blocks == 2 and pool.get_num_free_blocks() == 14
    # A step with requests that may take 13 blocks next: 14 free is enough, nothing goes.
    side.relieve(SimpleNamespace(num_scheduled_tokens={"x": 4 * 11, "y": 0}))
    assert side.protected_blocks == 2
    # 15 blocks needed: the lower-ranked entry 2 goes, entry 1 stays.
    side.relieve(SimpleNamespace(num_scheduled_tokens={"x": 4 * 13, "y": 0}))
    assert side.protected_blocks == 1 and pool.blocks[1].ref_cnt == 0
    _scheduled(side, "b", Plan(page_size=PAGE), 4)
    assert ConnectorResult.from_transfer_params(side.finished("b")).released == (2,)


def test_memory_pressure_keeps_an_entry_whose_release_would_free_nothing() -> None:
    side, pool = _side()
    ranked = Plan(
        page_size=PAGE, protect=(ProtectSpan(1, 0, 4, rank=5.0), ProtectSpan(2, 4, 4, rank=1.0))
    )
    _scheduled(side, "a", ranked, 10)
    side.finished("a")
    pool.touch([pool.blocks[1]])  # a running request reads entry 2's block too
    # 16 blocks needed, 14 free: entry 2 ranks lowest, but letting go of it frees nothing;
    # entry 1 frees one. Then nothing can free more: entry 2 stays.
    side.relieve(SimpleNamespace(num_scheduled_tokens={"x": 4 * 15}))
    assert side.protected_blocks == 1 and pool.blocks[0].ref_cnt == 0
    assert pool.blocks[1].ref_cnt == 2
    _scheduled(side, "b", Plan(page_size=PAGE), 4)
    assert ConnectorResult.from_transfer_params(side.finished("b")).released == (1,)


def test_an_entry_the_engine_let_go_of_leaves_the_tree_set() -> None:
    tree = _tree(budget=64)
    plan, _ = _run(tree, [_doc("a"), _doc("b")])
    a_key = plan.protect[1].key
    handle = tree.begin_request(4, [_doc("c")], 2)
    tree.confirm(handle)
    tree.settle_protection(handle, (), (a_key,))  # released under pressure: a and b leave
    assert len(tree.protected) == 1 and tree.protected.pressure_releases == 1
    tree.check_integrity()


def test_the_automatic_budget_leaves_two_max_length_requests_beside_it() -> None:
    from ragcache_core.config import CacheConfig
    from ragcache_core.runtime.assembly import protected_budget

    token_bytes = LAYOUT.token_bytes
    settings = SimpleNamespace(
        kv_cache_space_gib=8192 * token_bytes / 2**30, max_model_len=1024, block_size=32
    )
    auto = CacheConfig(protected_gpu_tokens=None)
    assert protected_budget(CacheConfig(), CONFIG, settings) == 0  # type: ignore[arg-type]
    half = protected_budget(auto, CONFIG, settings)  # type: ignore[arg-type]
    assert half == 4096  # half of 8,192 tokens: two 1,024-token requests fit beside it
    settings.max_model_len = 3000
    assert protected_budget(auto, CONFIG, settings) == 2176  # 8,192 - 2 x 3,000, in blocks
    settings.kv_cache_space_gib = None  # vLLM sizes its cache itself (CUDA)
    assert protected_budget(auto, CONFIG, settings) == 0
    chosen = CacheConfig(protected_gpu_tokens=100)
    assert protected_budget(chosen, CONFIG, settings) == 100


def test_plan_problems_name_bad_protect_spans() -> None:
    bad = Plan(page_size=PAGE, protect=(ProtectSpan(1, 4, 4), ProtectSpan(1, 0, 4)))
    problems = plan_problems(bad, prompt_len=6, page_size=PAGE, host_slots=0)
    assert any("protect[0]" in p for p in problems)  # past the prompt's end
    assert any("protect[1]" in p for p in problems)  # out of order
    assert any("repeat" in p for p in problems)
    assert Plan.from_json(PROTECT.to_json()) == PROTECT
