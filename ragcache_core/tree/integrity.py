"""`KnowledgeCache.check_integrity`: every invariant of the tree and both pools, checked.

O(nodes + slots); meant for tests (called after every step) and for debugging.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ragcache_core.errors import RAGCacheError
from ragcache_core.plan import Tier
from ragcache_core.tree.capacity import slots_for_tokens
from ragcache_core.tree.keys import DocKey
from ragcache_core.tree.node import Node

if TYPE_CHECKING:
    from ragcache_core.tree.cache import KnowledgeCache


class IntegrityError(RAGCacheError):
    """An invariant of the knowledge cache does not hold (a bug, never user input)."""


def _fail(message: str) -> None:
    raise IntegrityError(message)


def _all_attached(cache: KnowledgeCache) -> list[Node]:
    root = cache._root
    nodes = []
    stack = [root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        for key, child in node.children.items():
            if child.key != key or child.parent is not node or child.depth != node.depth + 1:
                _fail(f"{child!r}: inconsistent link to its parent {node!r}")
            stack.append(child)
    return nodes


def check_integrity(cache: KnowledgeCache) -> None:
    """Raise `IntegrityError` naming the first invariant that does not hold."""
    root = cache._root
    if root.parent is not None or not root.attached:
        _fail("the root must be attached and have no parent")
    nodes = _all_attached(cache)
    owners: dict[Tier, dict[int, Node]] = {Tier.GPU: {}, Tier.HOST: {}}
    expected_pins: Counter[int] = Counter()
    pending: set[tuple[int, Tier]] = set()
    reusable: list[int] = []
    for handle in cache._open.values():
        for node in handle._pins:
            expected_pins[id(node)] += 1
        for node, tier in handle._pending:
            pending.add((id(node), tier))
        reusable.extend(handle._reusable_gpu)

    doc_nodes = 0
    for node in nodes:
        if not node.attached:
            _fail(f"{node!r} is reachable from the root but marked detached")
        is_root = node is root
        if not is_root:
            doc_nodes += 1
            parent = node.parent
            assert parent is not None
            if not node.slots:
                _fail(f"{node!r} is in the tree without any copy")
            if not parent.slots:
                _fail(f"{node!r} holds a copy below a freed parent")
            if Tier.GPU in node.slots and Tier.GPU not in parent.slots:
                _fail(f"{node!r} is on GPU but its parent {parent!r} is not")
            if cache.max_depth is not None and node.depth > cache.max_depth:
                _fail(f"{node!r} is deeper than max_depth={cache.max_depth}")
            if not isinstance(node.key, DocKey) or node not in cache._doc_index.get(
                node.key.doc_id, ()
            ):
                _fail(f"{node!r} is missing from the document index")
        elif not node.slots and node.children:
            _fail("the root holds no copy but has children")
        for tier in Tier:
            actual = sum(1 for c in node.children.values() if tier in c.slots)
            if node.tier_children[tier] != actual:
                _fail(
                    f"{node!r}: tier_children[{tier}]={node.tier_children[tier]}, actual {actual}"
                )
        if not node.ready <= set(node.slots):
            _fail(f"{node!r}: a ready tier without slots")
        for tier in node.slots:
            if tier not in node.ready and (id(node), tier) not in pending:
                _fail(f"{node!r}: unconfirmed {tier} copy not written by any open request")
        if node.pins != expected_pins[id(node)]:
            _fail(f"{node!r}: pins={node.pins}, open requests hold {expected_pins[id(node)]}")
    if doc_nodes != cache._num_doc_nodes:
        _fail(f"node count {cache._num_doc_nodes} != {doc_nodes} document nodes in the tree")
    indexed = sum(len(v) for v in cache._doc_index.values())
    if indexed != doc_nodes:
        _fail(f"document index holds {indexed} nodes, the tree {doc_nodes}")

    for node in cache._detached_pinned:
        if node.attached or node.pins <= 0:
            _fail(f"{node!r} is listed as detached and pinned but is not")
        if node.pins != expected_pins[id(node)]:
            _fail(f"{node!r}: pins={node.pins}, open requests hold {expected_pins[id(node)]}")

    for tier, pool in cache._pools.items():
        pinned = 0
        for node in [*nodes, *cache._detached_pinned]:
            if tier not in node.slots:
                continue
            slots = node.slots[tier]
            if len(slots) != slots_for_tokens(node.num_tokens, cache.page_size):
                _fail(f"{node!r}: {len(slots)} {tier} slots for {node.num_tokens} tokens")
            if node.pins:
                pinned += len(slots)
            for slot in slots:
                if slot in owners[tier]:
                    _fail(f"{tier} slot {slot} owned by {owners[tier][slot]!r} and {node!r}")
                if pool.allocator.is_free(slot):
                    _fail(f"{tier} slot {slot} owned by {node!r} but also free")
                owners[tier][slot] = node
        held = reusable if tier is Tier.GPU else []
        for slot in held:
            if slot in owners[tier] or pool.allocator.is_free(slot):
                _fail(f"{tier} slot {slot} held for reuse but also owned or free")
        if len(set(held)) != len(held):
            _fail(f"{tier}: a slot is held for reuse twice")
        if pool.quarantined != len(held):
            _fail(f"{tier}: quarantined={pool.quarantined}, open requests hold {len(held)}")
        if pool.pinned_slots != pinned:
            _fail(f"{tier}: pinned_slots={pool.pinned_slots}, pinned nodes own {pinned}")
        total = len(owners[tier]) + len(held) + pool.allocator.num_free
        if total != pool.allocator.num_slots:
            _fail(
                f"{tier}: {len(owners[tier])} owned + {len(held)} held + "
                f"{pool.allocator.num_free} free != capacity {pool.allocator.num_slots}"
            )
