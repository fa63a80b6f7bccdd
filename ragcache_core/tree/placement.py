"""Placement over the slot tiers: which slots hold each node's copies, pins, eviction.

The tier model (docs/design.md 2.2): vLLM's blocks on top, held and evicted by vLLM and known
to the tree only as `Node.resident` (no slots here), and the tree's own slot tiers below them
(`SLOT_TIERS`: the host tier today), one `TierSlots` each. A slot tier has a write rule (the
host tier: at compute, a plan's stores, or at eviction, `HostWrites`) and holds the slots a
request reads or writes while it runs (pins). Rules it keeps (checked by `check`):
  * any node with a copy has a parent with a copy (never below a freed parent);
  * eviction candidates of a tier are its unpinned leaves (no child with a copy in the tier);
  * a victim loses its copy in that tier, and leaves the tree with its subtree once nothing
    holds it (no copy, not in vLLM's blocks);
  * a host copy lent to the engine as a victim (`lend_victims`, eviction-time host writes)
    is no candidate; it leaves when the engine reports it overwritten (`overwrite`), and its
    slots go to the host lease, not the allocator, whenever it leaves.
"""

from __future__ import annotations

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.plan import Tier
from ragcache_core.policy import EvictionPolicy
from ragcache_core.tree.integrity import OpenHoldings, fail
from ragcache_core.tree.node import Node
from ragcache_core.tree.prefix import PrefixTree
from ragcache_core.tree.request import RequestHandle
from ragcache_core.tree.stats import TreeCounters
from ragcache_core.tree.tier_slots import TierSlots


class Placement:
    """The copies of the nodes of `tree` over the slot tiers (the host tier's `host_slots`),
    and their eviction.

    Mutates the tiers' slots, nodes' `slots`/`ready`/`pins`/`priority`/`tier_children`, the
    policy's state (on evictions) and, when a node is left without a copy, the tree (the node
    leaves it with its subtree). A `handle` argument is the request on whose behalf slots are
    taken. Raises nothing but `RAGCacheError` from the allocator on a bookkeeping bug.

    What the caller must hold: `make_room` evicts any unpinned leaf, so a planner pins every
    node its plan reads or writes (`pin`) before it makes room for the next copy; a pin lasts
    until `release(handle)`.
    """

    __slots__ = (
        "_host_evictions",
        "_host_written",
        "_next_victim",
        "_prefixes",
        "detached_pinned",
        "host_lease",
        "host_victims",
        "page_size",
        "policy",
        "tiers",
    )

    def __init__(
        self,
        prefixes: PrefixTree,
        policy: EvictionPolicy,
        *,
        host_slots: int,
        page_size: int,
    ) -> None:
        self._prefixes = prefixes
        self.policy = policy
        self.page_size = page_size
        self.tiers = {Tier.HOST: TierSlots(Tier.HOST, host_slots, page_size, lanes=policy.lanes)}
        """The slot tiers (`SLOT_TIERS`), each its allocator and eviction candidates."""
        self.detached_pinned: set[Node] = set()
        """Removed nodes still pinned by a request: they keep their slots until unpinned."""
        self.host_lease: set[int] = set()
        """Host slots lent to the engine for eviction-time copies (`tree/host_writes.py`):
        taken from the allocator, owned by no node until a copy is reported onto them."""
        self.host_victims: dict[int, Node] = {}
        """Host copies lent to the engine as victims (`lend_victims`), by victim id, least
        wanted first: their nodes own and serve them until the engine reports one overwritten
        (`overwrite`); one that leaves the host tier otherwise gives its slots to the lease."""
        self._next_victim = 1
        self._host_evictions = 0
        self._host_written = 0

    # ------------------------------------------------------------------ queries (no mutation)

    @staticmethod
    def usable(node: Node, tier: Tier, handle: RequestHandle) -> bool:
        """May `handle` put a `tier` copy below `node`? Only if node's copy there is confirmed
        or written by `handle` itself: another request's unconfirmed copy may still be
        aborted, which would leave the new copy below a parent without one."""
        return tier in node.ready or (node, tier) in handle.ledger.pending

    def available(self, tier: Tier) -> int:
        """Slots of `tier` free now (taken without evicting)."""
        return self.tiers[tier].allocator.num_free

    def pinned_nodes(self) -> int:
        return sum(1 for n in self._prefixes.iter_nodes() if n.pins) + len(self.detached_pinned)

    @property
    def counters(self) -> TreeCounters:
        return TreeCounters(
            evictions_host=self._host_evictions,
            host_slots_written=self._host_written,
        )

    # ------------------------------------------------------------------ copies and pins

    def write_copy(
        self, node: Node, tier: Tier, count: int, handle: RequestHandle
    ) -> tuple[int, ...]:
        """Give `node` a new copy of `count` slots in `tier`, written by `handle` (readable
        once it confirms). The caller has made room (`make_room`). Returns the slots."""
        slots = self.tiers[tier].allocator.allocate(count)
        self._add_copy(node, tier, slots)
        handle.ledger.pending.append((node, tier))
        return slots

    def adopt_copy(self, node: Node, tier: Tier, slots: tuple[int, ...]) -> None:
        """Give `node` a ready copy in `tier` on `slots`, already taken from the allocator and
        already written (an eviction-time copy the engine reported done)."""
        self._add_copy(node, tier, slots)
        node.ready.add(tier)
        self.set_priority(node, tier)
        self.tiers[tier].push(node)

    def drop_copy(self, node: Node, tier: Tier, *, evicted: bool = False) -> None:
        """Remove `node`'s copy in `tier`; its slots go back to the allocator (or the host
        lease). The caller removes the node if it is left without a copy. `evicted`: by the
        policy's choice."""
        slots = node.slots.pop(tier)
        self._left(node, tier, evicted=evicted)
        node.ready.discard(tier)
        if node.pins:
            self.tiers[tier].pinned_slots -= len(slots)
        self._free(node, tier, slots)
        if node.parent is not None and node.attached:
            self._child_left_tier(node.parent, tier)

    def pin(self, node: Node, handle: RequestHandle) -> None:
        """`handle` reads or writes `node`: it is no eviction candidate until unpinned."""
        if node.pins == 0:
            for tier, slots in node.slots.items():
                self.tiers[tier].pinned_slots += len(slots)
        node.pins += 1
        handle.ledger.pins.append(node)

    def publish(self, handle: RequestHandle) -> None:
        """`handle`'s copies are complete: those still in place become readable."""
        for node, tier in handle.ledger.pending:
            if tier is Tier.HOST and tier in node.slots:
                self._host_written += len(node.slots[tier])
            if node.attached and tier in node.slots:
                node.ready.add(tier)

    def discard_written(self, handle: RequestHandle) -> None:
        """`handle`'s copies will never be complete: drop them (nodes left without a copy
        leave the tree with their subtrees)."""
        for node, tier in reversed(handle.ledger.pending):
            if tier not in node.slots:
                continue
            self.drop_copy(node, tier)
            if node.attached and not node.has_copy:
                self.remove(node)

    def release(self, handle: RequestHandle) -> None:
        """`handle` completed: release its pins (unpinned detached nodes free their slots
        now)."""
        ledger = handle.ledger
        for node in ledger.pins:
            self._unpin(node)
        ledger.pins = []

    def set_priority(self, node: Node, tier: Tier) -> None:
        """Snapshot `node`'s priority in `tier` from the policy (as it enters the tier)."""
        node.priority[tier] = self.policy.priority(node.stats, tier)

    def refresh(self, node: Node) -> None:
        """Recompute `node`'s priorities (its statistics changed) and re-offer it."""
        for tier in node.slots:
            self.set_priority(node, tier)
            self.tiers[tier].push(node)

    # ------------------------------------------------------------------ eviction

    def make_room(self, tier: Tier, count: int) -> bool:
        """Evict from `tier` until `count` slots are free. Returns False (having evicted what
        it could) if pinned nodes leave too little room; evicts nothing when even every
        unpinned slot could not suffice."""
        tier_slots = self.tiers[tier]
        if self.available(tier) >= count:
            return True
        if self.available(tier) + tier_slots.evictable_bound() < count:
            return False
        while self.available(tier) < count:
            victim = tier_slots.pop_victim(self.policy.lane_order(tier))
            if victim is None:
                return False
            self._evict(victim, tier)
        return True

    def lend_victims(self, count: int) -> int:
        """Lend the engine at least `count` host slots of the host tier's least-wanted
        eviction candidates (in the policy's order), as victims it may overwrite; they stay
        readable until it reports one overwritten. Returns the slots lent (fewer when the
        candidates run out)."""
        tier_slots = self.tiers[Tier.HOST]
        lent = 0
        while lent < count:
            node = tier_slots.pop_victim(self.policy.lane_order(Tier.HOST))
            if node is None:
                break
            node.lent, self._next_victim = self._next_victim, self._next_victim + 1
            self.host_victims[node.lent] = node
            lent += len(node.slots[Tier.HOST])
        return lent

    def victims_on(self, slots: tuple[int, ...]) -> list[int]:
        """The lent victims owning any of `slots`."""
        wanted = set(slots)
        return [
            vid
            for vid, node in self.host_victims.items()
            if not wanted.isdisjoint(node.slots[Tier.HOST])
        ]

    @property
    def victim_slots(self) -> int:
        """Host slots lent as victims now."""
        return sum(len(node.slots[Tier.HOST]) for node in self.host_victims.values())

    def overwrite(self, vid: int) -> bool:
        """The engine overwrote victim `vid`: its node loses its host copy (an eviction by the
        policy's choice, made at lending) and its slots are the lease's; the children holding
        host copies leave the tree with their subtrees (a host copy needs its parent's), and
        the node too if nothing else holds it. False when the victim had already left the host
        tier (its slots went to the lease then)."""
        node = self.host_victims.get(vid)
        if node is None:
            return False
        if node.attached:  # a detached one's children left the tree with it
            for child in [c for c in node.children.values() if Tier.HOST in c.slots]:
                self.remove(child)
        if Tier.HOST in node.priority:
            self.policy.on_evict(Tier.HOST, node.priority[Tier.HOST])
        self._host_evictions += 1
        self.drop_copy(node, Tier.HOST, evicted=True)
        if node.attached and not node.has_copy:
            self.remove(node)
        return True

    def _evict(self, node: Node, tier: Tier) -> None:
        """Evict candidate `node` (its lowest-priority unpinned leaf) from `tier`."""
        self.policy.on_evict(tier, node.priority[tier])
        if tier is Tier.HOST:
            self._host_evictions += 1
        self.drop_copy(node, tier, evicted=True)
        if not node.has_copy:
            self.remove(node)

    # ------------------------------------------------------------------ removal

    def remove(self, top: Node) -> None:
        """Remove `top` and its subtree from the tree (a node without a copy cannot stay, nor
        can anything below it; a root leaves the forest). Unpinned copies are freed now; a
        pinned node keeps its slots, detached and unmatchable, until its last pin is
        released."""
        parent = top.parent
        if parent is not None:
            for tier in top.slots:
                self._child_left_tier(parent, tier)
        for node in self._prefixes.detach(top):
            self._keep_or_free(node)

    def clear(self) -> None:
        """Remove every root with its subtree (pinned nodes are freed when unpinned); the
        policy's state is kept."""
        for root in list(self._prefixes.roots.values()):
            self.remove(root)
        for tier_slots in self.tiers.values():
            tier_slots.clear_heap()

    def drop_tier(self, tier: Tier) -> None:
        """Every copy in `tier` is gone (GPU: vLLM's blocks, `Node.resident`; a slot tier: its
        copies): drop them; nodes left without a copy leave the tree with their subtrees. The
        caller aborts the requests that wrote or read them first."""
        stack = list(self._prefixes.roots.values())
        while stack:
            node = stack.pop()
            if tier in node.slots:
                self.drop_copy(node, tier)
            if tier is Tier.GPU:
                node.resident = False
            if node.has_copy:
                stack.extend(node.children.values())
            else:
                self.remove(node)

    def set_resident(self, node: Node, resident: bool, version: int) -> None:
        """vLLM's blocks hold `node` (`resident`) or let it go, as plan `version` or a report on
        its recording says; a report older than the plan that last made it resident changes
        nothing. A node left without a copy leaves the tree with its subtree (nothing below it
        can be read without it)."""
        if resident:
            node.resident, node.resident_version = True, max(node.resident_version, version)
            return
        if not node.resident or version < node.resident_version:
            return
        node.resident = False
        if node.attached and not node.slots:
            self.remove(node)

    def reset_counters(self) -> None:
        self._host_evictions = 0
        self._host_written = 0

    def count_host_written(self, slots: int) -> None:
        """The engine wrote `slots` host slots outside a plan's stores (an eviction-time copy)."""
        self._host_written += slots

    def compact(self) -> None:
        """Bound the candidate heaps' stale entries (call once per request)."""
        for tier_slots in self.tiers.values():
            tier_slots.maybe_compact(self._prefixes.num_nodes)

    # ------------------------------------------------------------------ internals

    def _add_copy(self, node: Node, tier: Tier, slots: tuple[int, ...]) -> None:
        node.slots[tier] = slots
        if self.policy.tracks_residency:
            self.policy.on_enter(tier, node.path_key(), node.stats)
        if node.parent is not None:
            node.parent.tier_children[tier] += 1
        if node.pins:
            self.tiers[tier].pinned_slots += len(slots)

    def _left(self, node: Node, tier: Tier, *, evicted: bool) -> None:
        """Tell a policy that tracks residency (ARC) that `node`'s copy left `tier`."""
        if self.policy.tracks_residency:
            self.policy.on_leave(tier, node.path_key(), node.stats, evicted=evicted)

    def _release_copy(self, node: Node, tier: Tier) -> None:
        """Free a removed node's copy now if unpinned; a pinned node keeps it until unpinned."""
        if node.pins:
            return
        self._free(node, tier, node.slots.pop(tier))
        node.ready.discard(tier)
        self._left(node, tier, evicted=False)

    def _free(self, node: Node, tier: Tier, slots: tuple[int, ...]) -> None:
        """`node`'s copy left `tier`: its slots go back to the allocator, or to the host lease
        when they were lent as a victim (the engine may be writing them)."""
        if tier is Tier.HOST and node.lent:
            del self.host_victims[node.lent]
            node.lent = 0
            self.host_lease.update(slots)
        else:
            self.tiers[tier].allocator.free(slots)

    def _keep_or_free(self, node: Node) -> None:
        """A node just detached: a pinned one waits for its last pin, the rest is freed."""
        if node.pins:
            self.detached_pinned.add(node)
        else:
            for tier in list(node.slots):
                self._release_copy(node, tier)

    def _unpin(self, node: Node) -> None:
        node.pins -= 1
        if node.pins:
            return
        for tier, slots in node.slots.items():
            self.tiers[tier].pinned_slots -= len(slots)
        if not node.attached:
            self.detached_pinned.discard(node)
            for tier in list(node.slots):
                self._release_copy(node, tier)
            return
        for tier in node.slots:
            self.tiers[tier].push(node)

    def _child_left_tier(self, parent: Node, tier: Tier) -> None:
        parent.tier_children[tier] -= 1
        if parent.tier_children[tier] == 0 and tier in parent.slots:
            self.tiers[tier].push(parent)

    # ------------------------------------------------------------------ invariants

    def check(self, holdings: OpenHoldings) -> None:
        """Every node's copies, pins and the slot accounting of each tier against what the
        open requests hold. Raises `IntegrityError` naming the first violation."""
        nodes = self._prefixes.all_nodes()
        for node in nodes:
            self._check_node(node, holdings)
        for node in self.detached_pinned:
            if node.attached or node.pins <= 0:
                fail(f"{node!r} is listed as detached and pinned but is not")
            if node.pins != holdings.pins[id(node)]:
                fail(f"{node!r}: pins={node.pins}, open requests hold {holdings.pins[id(node)]}")
        for tier in self.tiers:
            self._check_tier(tier, [*nodes, *self.detached_pinned])
        lent = [n for n in [*nodes, *self.detached_pinned] if n.lent]
        if len(lent) != len(self.host_victims) or any(
            self.host_victims.get(n.lent) is not n or Tier.HOST not in n.slots for n in lent
        ):
            fail(f"host victims {sorted(self.host_victims)} do not match the lent nodes {lent}")

    def _check_node(self, node: Node, holdings: OpenHoldings) -> None:
        """The copy rules of one attached node (parent rule, readiness, pins)."""
        parent = node.parent
        if parent is None:
            if not node.has_copy:
                fail(f"root {node!r} is in the forest without any copy")
        elif not node.has_copy:
            fail(f"{node!r} is in the tree without any copy")
        elif not parent.has_copy:
            fail(f"{node!r} holds a copy below a freed parent")
        for tier in self.tiers:
            actual = sum(1 for c in node.children.values() if tier in c.slots)
            if node.tier_children[tier] != actual:
                fail(f"{node!r}: tier_children[{tier}]={node.tier_children[tier]}, actual {actual}")
        if not node.ready <= set(node.slots):
            fail(f"{node!r}: a ready tier without slots")
        for tier in node.slots:
            if tier not in node.ready and (id(node), tier) not in holdings.pending:
                fail(f"{node!r}: unconfirmed {tier} copy not written by any open request")
        if node.pins != holdings.pins[id(node)]:
            fail(f"{node!r}: pins={node.pins}, open requests hold {holdings.pins[id(node)]}")

    def _check_tier(self, tier: Tier, nodes: list[Node]) -> None:
        """owned + leased + free == capacity; no slot owned twice or also free; a copy of n
        tokens owns ceil(n / page_size) slots; the pinned counter matches."""
        allocator = self.tiers[tier].allocator
        owners: dict[int, Node] = {}
        pinned = 0
        for node in nodes:
            slots = node.slots.get(tier)
            if slots is None:
                continue
            if len(slots) != slots_for_tokens(node.num_tokens, self.page_size):
                fail(f"{node!r}: {len(slots)} {tier} slots for {node.num_tokens} tokens")
            if node.pins:
                pinned += len(slots)
            for slot in slots:
                if slot in owners:
                    fail(f"{tier} slot {slot} owned by {owners[slot]!r} and {node!r}")
                if allocator.is_free(slot):
                    fail(f"{tier} slot {slot} owned by {node!r} but also free")
                owners[slot] = node
        leased = tuple(self.host_lease) if tier is Tier.HOST else ()
        for slot in leased:
            if slot in owners or allocator.is_free(slot):
                fail(f"{tier} slot {slot} leased to the engine but also owned or free")
        tier_slots = self.tiers[tier]
        if tier_slots.pinned_slots != pinned:
            fail(f"{tier}: pinned_slots={tier_slots.pinned_slots}, pinned nodes own {pinned}")
        if len(owners) + len(leased) + allocator.num_free != allocator.num_slots:
            fail(
                f"{tier}: {len(owners)} owned + {len(leased)} leased + "
                f"{allocator.num_free} free != capacity {allocator.num_slots}"
            )
