"""The protected set: the documents the policy keeps on the GPU tier (docs/design.md 2.2).

The GPU tier is vLLM's own block pool with its prefix caching on; left alone, vLLM evicts
its cached blocks in LRU order. The protected set is the policy's say over it: the documents
PGDSF ranks highest, up to `budget_tokens`, whose blocks the scheduler-side connector holds a
reference on (`BlockPool.touch`), so vLLM cannot evict them; every other cached block stays
vLLM's LRU victim cache. Not to be confused with a request's *pins* (the nodes its plan reads
or writes, held while it runs, `Placement.pin`): protection outlives requests.

The tree decides, the engine holds, and plans carry the changes:

    plan(handle)       the request's path nodes not yet protected, root first, while the
                       budget has room or lower-ranked protected leaves can be let go of
                       (never a parent before its children: the set stays prefix-closed);
                       `ProtectSpan`s for them, and every entry waiting to be released
    settle(h, report)  entries the engine reports held are held; the others leave (with
                       their protected descendants); reported releases are done, and an
                       entry the engine let go of by itself (memory pressure) leaves
    abandon(handle)    no report (aborted, cancelled, a stop string): the entries may or
                       may not be held, so they are released by the next plan
    sweep()            entries of nodes that left the tree are released
    reset()            the engine died: it holds nothing

An entry's tokens are whole blocks: those whose last token lies in the document's span
(`protected_blocks`), so a block across a seam belongs to the later document. Entries being
released still hold their blocks until a plan carrying the release reaches the engine; that
plan releases them before it protects anything, so the engine holds at most `budget_tokens`
of entries at any time (`check`).

Pure bookkeeping in the app process; not thread-safe (the tree's caller's thread only).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ragcache_core.plan import ProtectSpan, Tier, protected_blocks
from ragcache_core.policy import EvictionPolicy
from ragcache_core.policy.base import Priority
from ragcache_core.tree.integrity import fail
from ragcache_core.tree.node import Node
from ragcache_core.tree.request import RequestHandle


@dataclass(slots=True)
class _Entry:
    key: int
    tokens: int
    held: bool
    """The engine reported it held (False: a plan asked for it; no report yet)."""


class ProtectedSet:
    """Which nodes the engine keeps on GPU, under `budget_tokens` (0: none; vLLM's LRU alone).
    `block_size` is vLLM's; the policy's GPU-tier priority ranks the entries."""

    def __init__(self, budget_tokens: int, block_size: int, policy: EvictionPolicy) -> None:
        if budget_tokens < 0:
            raise ValueError(f"the protected set's budget cannot be negative: {budget_tokens}")
        self.budget_tokens = budget_tokens
        self.block_size = block_size
        self._policy = policy
        self._members: dict[Node, _Entry] = {}
        self._releasing: dict[int, int] = {}
        """Entries to release: key -> tokens (held by the engine until a release reaches it)."""
        self._keys = itertools.count()
        self.releases = 0
        """Entries let go of to make room for higher-ranked documents (counter)."""
        self.pressure_releases = 0
        """Entries the engine let go of under memory pressure (counter)."""

    # ------------------------------------------------------------------ reads

    @property
    def protected_tokens(self) -> int:
        """Tokens of the entries held or asked for."""
        return sum(entry.tokens for entry in self._members.values())

    @property
    def releasing_tokens(self) -> int:
        return sum(self._releasing.values())

    def is_protected(self, node: Node) -> bool:
        entry = self._members.get(node)
        return entry is not None and entry.held

    def __len__(self) -> int:
        return len(self._members)

    # ------------------------------------------------------------------ changes

    def plan(self, handle: RequestHandle) -> tuple[tuple[ProtectSpan, ...], tuple[int, ...]]:
        """The protect spans and releases for `handle`'s plan (its ledger's path: the root,
        then its documents in prompt order). Records the spans as the handle's."""
        self.sweep()
        protect: list[ProtectSpan] = []
        path = handle.ledger.path if self.budget_tokens else []  # 0: no protection at all
        start = 0
        for node in path:
            span_start, start = start, start + node.num_tokens
            if node in self._members:
                continue
            if not node.attached:
                break
            tokens = len(protected_blocks(span_start, node.num_tokens, self.block_size))
            tokens *= self.block_size
            rank = self._policy.priority(node.stats, Tier.GPU)
            if not self._make_room(tokens, rank, path):
                break  # its children cannot be protected without it
            entry = _Entry(next(self._keys), tokens, held=False)
            self._members[node] = entry
            protect.append(ProtectSpan(entry.key, span_start, node.num_tokens, rank[0]))
        handle.ledger.protecting = tuple(span.key for span in protect)
        return tuple(protect), tuple(sorted(self._releasing))

    def settle(
        self, handle: RequestHandle, protected: tuple[int, ...], released: tuple[int, ...]
    ) -> None:
        """The connector's report on `handle`: of its entries, those in `protected` are held,
        the rest leave; `released` entries (any request's) are gone from the engine."""
        self.released_by_engine(released)
        asked, handle.ledger.protecting = handle.ledger.protecting, ()
        held = set(protected)
        by_key = {entry.key: node for node, entry in self._members.items()}
        for key in asked:
            node = by_key.get(key)
            if node is None:
                if key in held:  # left the tree meanwhile: the engine holds it for nothing
                    self._releasing.setdefault(key, 0)
                continue
            if key in held:
                self._members[node].held = True
            else:
                del self._members[node]
        self._close_prefixes()

    def released_by_engine(self, released: tuple[int, ...]) -> None:
        """The engine let go of `released`: the releases asked for are done, and an entry it
        let go of by itself (under memory pressure) leaves the set, with its descendants."""
        keys = set(released)
        for key in keys:
            self._releasing.pop(key, None)
        gone = [node for node, entry in self._members.items() if entry.key in keys]
        for node in gone:
            del self._members[node]
            self.pressure_releases += 1
        if gone:
            self._close_prefixes()

    def abandon(self, handle: RequestHandle) -> None:
        """`handle` ended without a report: its entries are released by the next plan."""
        asked, handle.ledger.protecting = handle.ledger.protecting, ()
        keys = set(asked)
        for node, entry in list(self._members.items()):
            if entry.key in keys:
                self._release(node)
        self._close_prefixes()

    def sweep(self) -> None:
        """Release the entries of nodes that left the tree (and their protected children)."""
        for node in [node for node in self._members if not node.attached]:
            self._release(node)
        self._close_prefixes()

    def release_all(self) -> None:
        """Every entry is to be released (`clear()`); `forget_engine` once the engine did."""
        for node in list(self._members):
            self._release(node)

    def forget_engine(self) -> None:
        """The engine holds nothing any more (it died, or released everything): forget every
        entry, held or being released."""
        self._members.clear()
        self._releasing.clear()

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Raises `IntegrityError` unless: every entry's node is in the tree; the set is
        prefix-closed; the entries fit the budget; keys are unique and none is both held and
        being released."""
        keys = [entry.key for entry in self._members.values()]
        if len(set(keys)) != len(keys):
            fail("the protected set repeats an entry key")
        if set(keys) & set(self._releasing):
            fail("a protected-set entry is both held and being released")
        for node in self._members:
            if not node.attached:
                fail(f"{node!r} is protected but left the tree")
            if node.parent is not None and node.parent not in self._members:
                fail(f"{node!r} is protected but its parent is not (the set is not prefix-closed)")
        if self.protected_tokens > self.budget_tokens:
            fail(
                f"the protected set holds {self.protected_tokens} tokens, over its budget of "
                f"{self.budget_tokens}"
            )

    # ------------------------------------------------------------------ internals

    def _make_room(self, tokens: int, rank: Priority, path: list[Node]) -> bool:
        """Whether `tokens` more fit the budget, letting go of protected leaves off `path`
        that rank below `rank` (lowest first, PGDSF's GPU-tier priority)."""
        if tokens > self.budget_tokens:
            return False
        on_path = set(path)
        while self.protected_tokens + tokens > self.budget_tokens:
            victim = self._lowest_leaf(on_path)
            if victim is None or victim[0] >= rank:
                return False
            self._policy.on_evict(Tier.GPU, victim[0])
            self._release(victim[1])
            self.releases += 1
        return True

    def _lowest_leaf(self, exclude: set[Node]) -> tuple[Priority, Node] | None:
        parents = {node.parent for node in self._members}
        leaves = [
            (self._policy.priority(node.stats, Tier.GPU), node)
            for node, entry in self._members.items()
            if entry.held and node not in parents and node not in exclude
        ]
        return min(leaves, key=lambda pair: pair[0], default=None)

    def _release(self, node: Node) -> None:
        entry = self._members.pop(node)
        self._releasing[entry.key] = entry.tokens

    def _close_prefixes(self) -> None:
        """Release entries whose parent is no longer protected (deepest last, repeatedly)."""
        changed = True
        while changed:
            changed = False
            for node in list(self._members):
                if node.parent is not None and node.parent not in self._members:
                    self._release(node)
                    changed = True
