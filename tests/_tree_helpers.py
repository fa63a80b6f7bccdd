"""Small builders shared by the control-plane tests."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ragcache_core.plan import Tier
from ragcache_core.tree import DocKey, DocSpec, KnowledgeTree, RootKey
from ragcache_core.tree.node import Node
from ragcache_core.tree.placement import Placement

ROOT = RootKey("model", "tokenizer", "template", "float16")


def make(host: int = 100, page: int = 4, **kw: object) -> KnowledgeTree:
    """The engine's tree with a host tier of `host` slots of `page` tokens (written at
    compute unless `host_write` says otherwise)."""
    return KnowledgeTree(ROOT, host_slots=host, page_size=page, **kw)  # type: ignore[arg-type]


def doc(name: str, tokens: int = 10) -> DocSpec:
    return DocSpec(DocKey(name, f"h-{name}"), tokens)


def run(cache: KnowledgeTree, *docs: DocSpec, root: int = 0, question: int = 0) -> None:
    """One request that completes normally."""
    cache.confirm(cache.begin_request(root, list(docs), question))
    cache.check_integrity()


def cached_paths(cache: KnowledgeTree) -> dict[tuple[str, ...], set[str]]:
    """Every node as its document-id path -> the tiers holding a copy ("vllm": vLLM's blocks
    hold it, `Node.resident`)."""
    return {
        node_path(node): {str(t) for t in node.slots} | ({"vllm"} if node.resident else set())
        for node in cache.iter_nodes()
    }


def evicted_in_order(cache: KnowledgeTree, names: list[str]) -> list[str]:
    """Insert one new 10-token document per name; return which document each one evicted."""
    order = []
    for name in names:
        before = set(cached_paths(cache))
        run(cache, doc(name))
        gone = before - set(cached_paths(cache))
        assert len(gone) == 1, gone
        order.append(gone.pop()[-1])
    return order


class PrefixCost:
    """T(alpha, beta) = beta * (1 + alpha / 100): computing after a long cached prefix is
    costlier per token (attention), which only the prefix-aware policy sees."""

    def prefill_time(self, cached_tokens: int, new_tokens: int) -> float:
        return new_tokens * (1 + cached_tokens / 100)


PREFIX_COST_TOKENS = 1000 + 10 + 10 + 10
"""The tier `prefix_cost_victim` fills: two prefixes and two leaves."""


def prefix_cost_victim(cache: KnowledgeTree) -> str:
    """Two leaves of equal size and frequency: x computed after a 1,000-token cached prefix
    (cost/token 11 under `PrefixCost`), y after a 10-token one (1.1), x older; then a third
    leaf needs one's room. Which leaf it evicted (`cache`: `PREFIX_COST_TOKENS`, `PrefixCost`)."""
    run(cache, doc("long", 1000))
    run(cache, doc("long", 1000), doc("x"))
    run(cache, doc("short", 10))
    run(cache, doc("short", 10), doc("y"))
    before = set(cached_paths(cache))
    run(cache, doc("short", 10), doc("z"))  # needs 10 tokens: evicts one leaf
    gone = before - set(cached_paths(cache))
    assert len(gone) == 1, gone
    return gone.pop()[-1]


def node_path(node: Node) -> tuple[str, ...]:
    """A node's document-id path from the root (the root: ())."""
    path: list[str] = []
    cur = node
    while cur.parent is not None:
        path.append(cur.key.doc_id)  # type: ignore[union-attr]
        cur = cur.parent
    return tuple(reversed(path))


@dataclass(frozen=True)
class Eviction:
    """One eviction as the placement made it, seen just before it ran."""

    path: tuple[str, ...]
    tier: Tier
    children_in_tier: tuple[tuple[str, ...], ...]
    """The victim's children that held a copy in `tier` at that moment (a leaf: none)."""
    pinned: bool


def record_evictions(monkeypatch: pytest.MonkeyPatch) -> list[Eviction]:
    """Every eviction any tree makes from now on (in order), observed at `Placement._evict`,
    independently of the tree's own bookkeeping (its children are looked at, not counted)."""
    log: list[Eviction] = []
    evict = Placement._evict

    def spy(placement: Placement, node: Node, tier: Tier, *rest: object) -> None:
        children = sorted(node_path(c) for c in node.children.values() if tier in c.slots)
        log.append(Eviction(node_path(node), tier, tuple(children), node.pins > 0))
        evict(placement, node, tier, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(Placement, "_evict", spy)
    return log


def host_used(cache: KnowledgeTree) -> int:
    """Host slots holding a node's copy."""
    return cache.stats().host_used_slots
