"""A node of the knowledge tree: one document's KV computed after exactly its path's prefix."""

from __future__ import annotations

from ragcache_core.plan import SLOT_TIERS, Tier
from ragcache_core.policy.base import NodeStats, Priority
from ragcache_core.tree.keys import DocKey, RootKey


class Node:
    """Mutable tree node, internal to `ragcache_core.tree` (never crosses the API boundary).

    - `slots[tier]`: the slots of the node's copy in that slot tier (`SLOT_TIERS`: pages of
      that tier's storage pool). A copy exists from allocation on; it is *readable* only once
      in `ready` (its writer's request confirmed, or the engine reported its copy done).
    - `tier_children[tier]`: how many children have a copy in that slot tier (O(1) leaf test).
    - `pins`: in-flight requests that read or write this node; a pinned node is never evicted.
    - `attached`: False once removed from the tree (invalidated, cleared, freed); a detached
      node that is still pinned keeps its slots until its last pin is released.
    - `resident`: vLLM's own blocks hold the node's KV, as far as the tree last heard (the
      engine with eviction-time host writes, docs/design.md 2.2): a request that computed it
      confirmed, and the engine has not reported its blocks gone. No slots of the tree's: vLLM's
      prefix cache serves it by itself, so it is never loaded; a node stays in the tree while a
      copy or this holds it. `resident_version` is the plan (lease version) that last said so:
      a report about an older recording of the same path does not undo it.
    - `lent`: the id under which the tree lent the node's host copy to the engine as a lease
      victim (0: not lent; docs/design.md 2.2, "The lease of victims"): still served, but the
      engine may overwrite it, so it is no eviction candidate any more, and its slots go back
      to the lease, not to the allocator, when it leaves the host tier.
    """

    __slots__ = (
        "attached",
        "children",
        "depth",
        "heap_seq",
        "key",
        "lent",
        "num_tokens",
        "parent",
        "pins",
        "priority",
        "ready",
        "resident",
        "resident_version",
        "slots",
        "stats",
        "tier_children",
    )

    def __init__(
        self,
        key: DocKey | RootKey,
        parent: Node | None,
        num_tokens: int,
        stats: NodeStats,
    ) -> None:
        self.key = key
        self.parent = parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.num_tokens = num_tokens
        self.children: dict[DocKey, Node] = {}
        self.slots: dict[Tier, tuple[int, ...]] = {}
        self.ready: set[Tier] = set()
        self.tier_children: dict[Tier, int] = dict.fromkeys(SLOT_TIERS, 0)
        self.pins = 0
        self.stats = stats
        self.priority: dict[Tier, Priority] = {}
        self.heap_seq: dict[Tier, int] = {}
        self.attached = True
        self.resident = False
        self.resident_version = 0
        self.lent = 0

    @property
    def has_copy(self) -> bool:
        """Something holds the node: a copy in a tier (ready or in flight), or vLLM's blocks."""
        return bool(self.slots) or self.resident

    @property
    def cached(self) -> bool:
        """A request would find it cached now: a ready copy, or vLLM's blocks (resident)."""
        return bool(self.ready) or self.resident

    def readable_tier(self) -> Tier | None:
        """The slot tier a reader loads from (the highest with a ready copy), or None while
        no copy is ready."""
        for tier in SLOT_TIERS:
            if tier in self.ready:
                return tier
        return None

    def path_key(self) -> tuple[DocKey | RootKey, ...]:
        """The keys from the root down to this node: the same for a node removed and stored
        again at the same prefix (what a policy's ghost lists remember)."""
        keys: list[DocKey | RootKey] = []
        node: Node | None = self
        while node is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(reversed(keys))

    def is_candidate(self, tier: Tier) -> bool:
        """Evictable from `tier` now: has a copy there that holds slots (a root of no
        tokens holds none: evicting it, or lending it as a victim, would free nothing and
        drop what hangs below it), no child has one, not pinned, not lent to the engine as a
        victim."""
        return (
            self.attached
            and self.pins == 0
            and bool(self.slots.get(tier))
            and self.tier_children[tier] == 0
            and not (self.lent and tier is Tier.HOST)
        )

    def __repr__(self) -> str:
        name = self.key.doc_id if isinstance(self.key, DocKey) else "<root>"
        tiers = ",".join(f"{t}{'' if t in self.ready else '?'}" for t in self.slots)
        if self.resident:
            tiers = f"{tiers},vllm" if tiers else "vllm"
        return f"Node({name}, depth={self.depth}, tokens={self.num_tokens}, [{tiers}])"
