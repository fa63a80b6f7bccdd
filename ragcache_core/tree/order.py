"""Document order that follows the cache (issue 40, `document_order="cache"`).

The tree reuses only a prefix, so with top-k > 1 a request that retrieves [B, A] while the tree
holds A -> B hits nothing (and stores B -> A beside it). `cache_order` picks, for one request, the
order of its documents that walks the cached path as far as it goes, as a pure function of the
document set and the tree state when the prompt is built:

- start at the request's root (never another root: ordering never crosses a tenant or template);
- at each step take the remaining document whose node continues the cached path (a ready copy,
  or vLLM's blocks: `Node.cached`),
  preferring the most cached tokens along the path it opens, ties by retrieval rank;
- when none does (or `max_depth` documents are placed: nothing is cached deeper), the rest keep
  retrieval order.

It reads the tree and changes nothing (no policy touch, no pin), so the reordering queue can
score with it at every pick and a speculative request can order itself when it is built.
"""

from __future__ import annotations

from collections.abc import Sequence

from ragcache_core.tree.keys import DocSpec, RootKey
from ragcache_core.tree.node import Node
from ragcache_core.tree.prefix import PrefixTree


def cache_order(
    prefixes: PrefixTree,
    docs: Sequence[DocSpec | str],
    root_key: RootKey | None = None,
    max_depth: int | None = None,
) -> tuple[int, ...]:
    """The served order of `docs` (given in retrieval order) as retrieval ranks (0-based
    indices into `docs`): a permutation of range(len(docs)). Does not modify the tree.

    A `DocSpec` continues a node through its exact key; a bare document id through any child
    of that id (the runtime orders before it builds: a node's ids depend on what precedes it,
    so the keys are known only once the order is; a child whose text changed then simply
    misses when the built prompt is matched).

    Each step takes the remaining document whose node continues the readable cached path with
    the most cached tokens *along the rest of the path through it* (not just its own node:
    with root -> A(5) -> B(10) and root -> B(10) cached, [A, B] beats [B, A]), so the served
    order never hits less than retrieval order. Ties go to the lower retrieval rank. The
    search visits only cached nodes (each once), so it costs O(n * k) for the n cached nodes
    that are paths of the request's k documents (k is a top-k: small)."""
    return ordered_hits(prefixes, docs, root_key, max_depth)[0]


def ordered_hits(
    prefixes: PrefixTree,
    docs: Sequence[DocSpec | str],
    root_key: RootKey | None = None,
    max_depth: int | None = None,
) -> tuple[tuple[int, ...], int]:
    """`cache_order`'s order and the cached tokens it reads (the root's included): what the
    reordering queue scores a `document_order="cache"` request by. Does not modify the tree."""
    root = prefixes.roots.get(root_key or prefixes.root_key)
    # Only a readable node is a hit (an in-flight one is not, and nothing is stored below it).
    if root is None or not root.cached:
        return tuple(range(len(docs))), 0
    limit = len(docs) if max_depth is None else min(len(docs), max_depth)
    tokens, path = _best_path(prefixes, root, docs, tuple(range(len(docs))), limit)
    placed = set(path)
    order = path + tuple(rank for rank in range(len(docs)) if rank not in placed)
    return order, root.num_tokens + tokens


def _child(prefixes: PrefixTree, node: Node, doc: DocSpec | str) -> Node | None:
    """The readable child of `node` for `doc` (a bare id: the one of most tokens, then of the
    lowest content hash, so the choice is deterministic), or None."""
    if isinstance(doc, DocSpec):
        child = node.children.get(doc.key)
        return child if child is not None and child.cached else None
    found = [n for n in prefixes.nodes_of(doc) if n.parent is node and n.cached]
    if not found:
        return None
    return min(found, key=lambda n: (-n.num_tokens, n.key.content_hash))  # type: ignore[union-attr]


def _best_path(
    prefixes: PrefixTree,
    node: Node,
    docs: Sequence[DocSpec | str],
    remaining: tuple[int, ...],
    depth_left: int,
) -> tuple[int, tuple[int, ...]]:
    """(cached tokens, ranks) of the readable path below `node` over `remaining` with the most
    tokens; among equals the lexicographically lowest ranks (so ties go by retrieval rank)."""
    best_tokens = 0
    best_path: tuple[int, ...] = ()
    if depth_left == 0:
        return best_tokens, best_path
    for position, rank in enumerate(remaining):
        child = _child(prefixes, node, docs[rank])
        if child is None:
            continue
        rest = remaining[:position] + remaining[position + 1 :]
        tokens, path = _best_path(prefixes, child, docs, rest, depth_left - 1)
        tokens += child.num_tokens
        # `remaining` is in rank order, so only strictly more tokens replaces an earlier rank.
        if tokens > best_tokens or not best_path:
            best_tokens, best_path = tokens, (rank, *path)
    return best_tokens, best_path
