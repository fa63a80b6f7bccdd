"""The prefix structure of the knowledge tree: a forest of roots (one per root key), nodes
linked root -> documents, and an index from document id to its nodes.

It owns the links (`parent.children`, `Node.attached`) and the index, and nothing else: it
never allocates or frees slots. Whoever detaches nodes (`Placement.remove`) owns their copies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ragcache_core.plan import Tier
from ragcache_core.policy.base import NodeStats
from ragcache_core.tree.integrity import fail
from ragcache_core.tree.keys import DocKey, RootKey
from ragcache_core.tree.match import MatchResult, TierHit
from ragcache_core.tree.node import Node


def readable_prefix(path: Sequence[Node]) -> list[tuple[Node, Tier]]:
    """The leading nodes of `path` with a confirmed copy in a slot tier, each with the tier to
    read it from; stops at the first node without one. Does not modify anything."""
    hits: list[tuple[Node, Tier]] = []
    for node in path:
        tier = node.readable_tier()
        if tier is None:
            break
        hits.append((node, tier))
    return hits


def match_result(path: Sequence[Node], hits: Sequence[tuple[Node, Tier]]) -> MatchResult:
    """The typed view of a walked `path` and its readable prefix `hits` (`readable_prefix`)."""
    return MatchResult(
        hits=tuple(TierHit(node.key, node.num_tokens, tier) for node, tier in hits),
        in_flight=sum(1 for node in path[len(hits) :] if not node.resident),
        vllm_tokens=_resident_tokens(path[len(hits) :]),
    )


def _resident_tokens(rest: Sequence[Node]) -> int:
    """Tokens of the leading nodes of `rest` that vLLM's blocks hold (`Node.resident`)."""
    total = 0
    for node in rest:
        if not node.resident:
            break
        total += node.num_tokens
    return total


class PrefixTree:
    """Nodes addressed by their path (root key, then document keys in prompt order): a forest
    with one root per root key (docs/design.md 2.1).

    Every root in `roots` holds a copy, except for the moment between `attach` and its first
    copy; a root left without a copy leaves with `detach` like any other node. `root_key` is
    the default root's key (the one a request names when it names none).
    """

    __slots__ = ("_doc_index", "num_doc_nodes", "root_key", "roots")

    def __init__(self, root_key: RootKey) -> None:
        self.root_key = root_key
        self.roots: dict[RootKey, Node] = {}
        self._doc_index: dict[str, set[Node]] = {}
        self.num_doc_nodes = 0
        """Attached document nodes (the roots excluded)."""

    # ------------------------------------------------------------------ queries (no mutation)

    def walk(self, keys: Sequence[DocKey], root_key: RootKey | None = None) -> list[Node]:
        """The existing nodes along root, keys[0], keys[1], ... (root first; stops at the
        first absent one; empty when that root is absent or holds no copy). Does not modify
        the tree. O(h)."""
        node = self.roots.get(root_key or self.root_key)
        if node is None or not node.has_copy:
            return []
        path = [node]
        children = node.children
        for key in keys:
            child = children.get(key)
            if child is None:
                break
            path.append(child)
            children = child.children
        return path

    @property
    def root(self) -> Node | None:
        """The default root's node (None when it is not cached)."""
        return self.roots.get(self.root_key)

    @property
    def num_roots(self) -> int:
        """Roots in the forest (each holds a copy; safe to read from another thread)."""
        return len(self.roots)

    @property
    def num_nodes(self) -> int:
        """Nodes holding a copy (ready or in flight), the roots included."""
        return self.num_doc_nodes + self.num_roots

    def nodes_of(self, doc_id: str) -> list[Node]:
        """Every attached node of document `doc_id` (any content hash, any prefix, any root)."""
        return list(self._doc_index.get(doc_id, ()))

    def iter_nodes(self) -> Iterator[Node]:
        """Every attached node that holds a copy (or vLLM's blocks do), parents before children."""
        stack = [node for node in self.roots.values() if node.has_copy]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ mutation

    def attach(
        self, key: DocKey | RootKey, parent: Node | None, num_tokens: int, stats: NodeStats
    ) -> Node:
        """Link a new node for `key` below `parent` and index it; with `parent` None, a new
        root for root key `key`. The caller gives the node a copy before anyone can see it (a
        node without a copy cannot stay)."""
        if parent is None:
            assert isinstance(key, RootKey) and key not in self.roots
            node = Node(key, None, num_tokens, stats)
            self.roots[key] = node
            return node
        assert isinstance(key, DocKey)
        node = Node(key, parent, num_tokens, stats)
        parent.children[key] = node
        self._doc_index.setdefault(key.doc_id, set()).add(node)
        self.num_doc_nodes += 1
        return node

    def detach(self, top: Node) -> list[Node]:
        """Unlink node `top` (a root: from the forest; a document node: from its parent) and
        mark it and its subtree detached and unindexed. Returns the detached nodes, `top`
        first (the caller frees or keeps their copies). Counters of the parent
        (`tier_children`) are the caller's."""
        parent = top.parent
        assert top.attached
        if parent is None:
            assert isinstance(top.key, RootKey) and self.roots.get(top.key) is top
            del self.roots[top.key]
        else:
            del parent.children[top.key]  # type: ignore[arg-type]
        detached: list[Node] = []
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.attached = False
            if node.parent is not None:
                self.num_doc_nodes -= 1
            self._unindex(node)
            detached.append(node)
        return detached

    def _unindex(self, node: Node) -> None:
        if isinstance(node.key, DocKey):
            nodes = self._doc_index.get(node.key.doc_id)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self._doc_index[node.key.doc_id]

    # ------------------------------------------------------------------ invariants

    def all_nodes(self) -> list[Node]:
        """Every attached node, roots first (for the checks)."""
        nodes = []
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check(self) -> None:
        """Links, attachment, the document index and the node count. Raises `IntegrityError`."""
        doc_nodes = 0
        stack: list[Node] = []
        for root_key, root in self.roots.items():
            if root.parent is not None or not root.attached or root.key != root_key:
                fail(f"root {root!r} must be attached, parentless and under its own key")
            stack.append(root)
        while stack:
            node = stack.pop()
            if not node.attached:
                fail(f"{node!r} is reachable from a root but marked detached")
            for key, child in node.children.items():
                if child.key != key or child.parent is not node or child.depth != node.depth + 1:
                    fail(f"{child!r}: inconsistent link to its parent {node!r}")
                stack.append(child)
            if node.parent is None:
                continue
            doc_nodes += 1
            doc_key = node.key
            if not isinstance(doc_key, DocKey) or node not in self._doc_index.get(
                doc_key.doc_id, ()
            ):
                fail(f"{node!r} is missing from the document index")
        if doc_nodes != self.num_doc_nodes:
            fail(f"node count {self.num_doc_nodes} != {doc_nodes} document nodes in the tree")
        indexed = sum(len(v) for v in self._doc_index.values())
        if indexed != doc_nodes:
            fail(f"document index holds {indexed} nodes, the tree {doc_nodes}")
