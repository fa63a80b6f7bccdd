"""Eviction-time host writes, the tree's side (`host_write="eviction"`, docs/design.md 2.2).

The host tier is written as a document leaves vLLM's blocks, not as it is computed. The tree
decides which documents it wants there and lends the engine host slots for the copies; the
engine's window copies and reports; the tree then holds the copies:

    plan(handle, ...)   keep spans for the request's path past the host-readable prefix (a key
                        per path, stable across requests), and the lease topped up to its size
                        from free host slots, then with victims: the host tier's least-wanted
                        leaves, in the policy's order, which stay readable until the engine
                        overwrites one (with `victims=False`: host leaves evicted by the policy
                        to make empty room), stated whole. Its size covers what the requests
                        in prefill make vLLM hand out of its blocks before their reports can
                        give the tree the copies back (the engine copies a kept document when
                        vLLM hands one of its blocks out): a step's token budget
                        (`lease_slots`, for the decoding requests' blocks), every token the
                        open requests load or compute, and the most one plan kept (the
                        document a run of blocks ends inside is copied whole, with its
                        uncopied ancestors). The budget part
                        adapts: it doubles (up to `LEASE_GROWTH` times) on a report of kept
                        documents refused for lack of lease room, and gives back a quarter of
                        its growth on a report without refusals that finds at least half of
                        the lease unused; the lease is never shrunk by freeing lent slots (the
                        engine may be copying into them), only by not topping it up
    settle(handle)      the request confirmed (its first token: its prompt is in vLLM's
                        blocks): its kept paths are nodes held by vLLM's blocks
                        (`Node.resident`), attached if absent, so the tree knows both tiers
    apply(report)       each victim reported overwritten leaves the host tier (its slots are the
                        lease's); each copy reported done, once (by sequence number, in one
                        order with the overwrites): the node gets a
                        ready host copy on its leased slots (attached if absent) if its parent
                        holds one (else the slots are freed); the lease shrinks by those slots.
                        Each path reported gone from vLLM's blocks stops being resident: a node
                        without a host copy leaves the tree with its subtree
    engine_lost()       a new engine numbers copies from 1 again; every lent victim is dropped
                        (the dead engine may have been writing it, unreported)

A path not yet in the tree keeps its access statistics here (a *shadow*), so the node it becomes
has the frequency and cost the policy would have given it. Shadows are bounded (`SHADOW_LIMIT`,
the oldest forgotten) and forgotten at `clear()`; a report naming a forgotten key only frees its
slots. Pure bookkeeping; not thread-safe (the tree's caller's thread only).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

from ragcache_core.capacity import slots_for_tokens
from ragcache_core.plan import NO_LOSSES, HostLease, Tier, WindowLosses
from ragcache_core.policy import NodeStats
from ragcache_core.tree.integrity import fail
from ragcache_core.tree.keys import DocKey, RootKey
from ragcache_core.tree.node import Node
from ragcache_core.tree.placement import Placement
from ragcache_core.tree.prefix import PrefixTree
from ragcache_core.tree.request import RequestHandle
from ragcache_core.tree.shadow import Shadow

SHADOW_LIMIT = 1 << 16
LEASE_GROWTH = 4
"""The most the lease grows to, in multiples of its starting size (one window's take):
at 4 the long-shuffled refusals measured at 6.64/s were gone with three windows' worth
(docs/benchmarks.md, "The lease that grows")."""


class HostWrites:
    """Shadows, the lease and what the engine reported (see the module docstring).
    `lease_slots`: the lease's starting size in host slots; `max_lease_slots`: the most it
    grows to (default `LEASE_GROWTH` times the start; never more than half the host tier)."""

    def __init__(
        self,
        prefixes: PrefixTree,
        placement: Placement,
        *,
        lease_slots: int,
        max_lease_slots: int | None = None,
        victims: bool = True,
    ) -> None:
        self._prefixes = prefixes
        self._placement = placement
        self.victims = victims
        """Top the lease up with victims (host copies still served until overwritten) rather
        than with room emptied by evictions."""
        self.overwritten = 0
        """Victims the engine reported overwritten (counter, since the last `reset_counters`)."""
        self.base_lease_slots = lease_slots
        self.max_lease_slots = (
            LEASE_GROWTH * lease_slots if max_lease_slots is None else max_lease_slots
        )
        self.lease_slots = lease_slots
        """The lease's size now (adapted by the reports: `_adapt_lease`)."""
        self.lease_peak = lease_slots
        """The largest lease target (`lease_target`) since the last `reset_counters`."""
        self._keys: dict[tuple[RootKey, tuple[DocKey, ...]], int] = {}
        self._shadows: OrderedDict[int, Shadow] = OrderedDict()
        self._next_key = 0
        self._version = 0
        self.epoch = secrets.randbits(62)
        """This tree's name in its leases (another tree on the same engine has another)."""
        self.applied = 0
        """The highest copy sequence number applied (this engine's)."""
        self.stale_reports = 0
        """Reports of a lost engine that came after the loss, ignored
        (`KnowledgeTree.apply_host_writes`)."""
        self.reports = 0
        """Engine reports applied (`apply`; never reset): how the report probe sees that one
        came (`runtime/report_probe.py`)."""
        self.copies = 0
        """Copies attached as host copies (counter)."""
        self.wasted = 0
        """Copies whose slots were freed (parent gone, node there already, key forgotten)."""
        self.dropped = 0
        """Keep keys the engine let go of without a copy (counter)."""
        self.stranded_blocks = 0
        """What the engine last reported held without a copy in flight (0 unless a bug)."""
        self.lost = WindowLosses()
        """Kept documents that left vLLM's cache uncopied, by cause, as the engine reported
        them (since the last `reset_counters`)."""
        self.concurrent_computes = 0
        """Kept documents a plan computes while another open request computes them too (no
        node is in flight for admission to defer on: the path is a node only from its
        computing request's first token), since the last `reset_counters`."""
        self._computing: dict[int, int] = {}
        """Shadow key -> open requests computing it."""
        self._allocating: dict[int, int] = {}
        """Open request id -> the tokens its prefill makes vLLM hand out (those it loads or
        computes: every one past vLLM's own hit), in host slots."""
        self.longest_keep_slots = 0
        """The most host slots one plan kept (its documents, root first: the copies one
        handed-out block can start), since the last `reset_counters`."""

    @property
    def lease(self) -> frozenset[int]:
        return frozenset(self._placement.host_lease)

    def shadow(
        self, root_key: RootKey, docs: tuple[DocKey, ...], num_tokens: int, stats: NodeStats
    ) -> Shadow:
        """The shadow of a path (made with `stats` if new), refreshed as the newest."""
        key = self._keys.get((root_key, docs))
        if key is not None:
            self._shadows.move_to_end(key)
            return self._shadows[key]
        key, self._next_key = self._next_key, self._next_key + 1
        shadow = Shadow(key, root_key, docs, num_tokens, stats)
        self._keys[(root_key, docs)] = key
        self._shadows[key] = shadow
        while len(self._shadows) > SHADOW_LIMIT:
            _, old = self._shadows.popitem(last=False)
            del self._keys[(old.root_key, old.docs)]
        return shadow

    def lease_for(
        self,
        handle: RequestHandle,
        *,
        may_evict: bool,
        allocating_slots: int = 0,
        keep_slots: tuple[int, ...] = (),
    ) -> HostLease:
        """The lease to send with `handle`'s plan (whose prefill makes vLLM hand out blocks
        for `allocating_slots` host slots' worth of tokens, and which keeps documents of
        `keep_slots` slots each). With victims: every free host slot (up to half the tier:
        nothing else takes free host slots when the host tier is written at eviction, so the
        engine never lets a kept document go while the tier has room, however late the
        reports that give the tree its copies come), then, when `may_evict` and that falls
        short of `lease_target`, victims up to it (host leaves lent in the policy's order,
        still served). With `victims=False`: topped up to `lease_target` by evicting host
        leaves (the caller pinned what the plan reads)."""
        placement = self._placement
        allocator = placement.tiers[Tier.HOST].allocator
        lease = placement.host_lease
        self._allocating[handle.request_id] = allocating_slots
        self.longest_keep_slots = max(self.longest_keep_slots, sum(keep_slots))
        target = self.lease_target()
        self.lease_peak = max(self.lease_peak, target)
        if self.victims:
            room = allocator.num_slots // 2 - len(lease)
            lease.update(allocator.allocate(max(0, min(room, allocator.num_free))))
            missing = target - len(lease) - placement.victim_slots
            if missing > 0 and may_evict:
                placement.lend_victims(missing)
        else:
            missing = target - len(lease)
            if missing > 0:
                if allocator.num_free < missing and may_evict:
                    placement.make_room(Tier.HOST, missing)
                lease.update(allocator.allocate(min(missing, allocator.num_free)))
        self._version += 1
        victims = tuple(
            (vid, node.slots[Tier.HOST]) for vid, node in placement.host_victims.items()
        )
        return HostLease(self.epoch, self._version, self.applied, tuple(sorted(lease)), victims)

    def lease_target(self) -> int:
        """The lease's size now: a step's budget (`lease_slots`, adapted), what the open
        requests' prefills make vLLM hand out, and the most one plan kept (a block handed out
        starts the copy of its document with its uncopied ancestors); at most half the host
        tier (a lease the size of the tier would leave no room for the copies it makes)."""
        wanted = self.lease_slots + sum(self._allocating.values()) + self.longest_keep_slots
        return min(wanted, self._placement.tiers[Tier.HOST].allocator.num_slots // 2)

    def computes(self, shadow: Shadow, handle: RequestHandle) -> None:
        """`handle`'s plan computes `shadow`'s path (vLLM's blocks do not hold it, as last
        heard): counted in `concurrent_computes` if another open request computes it too."""
        count = self._computing.get(shadow.key, 0)
        if count:
            self.concurrent_computes += 1
        self._computing[shadow.key] = count + 1
        handle.ledger.computing.append(shadow.key)

    def end(self, handle: RequestHandle) -> None:
        """`handle` ended (confirmed or aborted): it computes and loads nothing any more."""
        self._allocating.pop(handle.request_id, None)
        for key in handle.ledger.computing:
            count = self._computing.pop(key) - 1
            if count:
                self._computing[key] = count
        handle.ledger.computing.clear()

    def reset_counters(self) -> None:
        """`clear()`: the loss counters restart (`copies`, `wasted`, `dropped` do not)."""
        self.lost = WindowLosses()
        self.concurrent_computes = 0
        self.overwritten = 0
        self.lease_slots = self.lease_peak = self.base_lease_slots
        self.longest_keep_slots = 0

    def settle(self, handle: RequestHandle) -> None:
        """`handle` confirmed: vLLM's blocks hold the paths its plan kept (root first). Each
        becomes a resident node, attached below its parent if absent; a path whose parent
        left the tree meanwhile (invalidated, cleared) and those after it are skipped."""
        lease = handle.plan.lease
        version = lease.version if lease is not None else 0
        prefixes = self._prefixes
        for shadow in handle.ledger.keeps:
            if shadow.key not in self._shadows:  # forgotten (invalidated, cleared)
                return
            node = self.node_of(shadow)
            if node is None:
                if shadow.docs:
                    path = prefixes.walk(list(shadow.docs[:-1]), shadow.root_key)
                    if len(path) != len(shadow.docs):
                        return
                    node = prefixes.attach(
                        shadow.docs[-1], path[-1], shadow.num_tokens, shadow.stats
                    )
                else:
                    node = prefixes.attach(shadow.root_key, None, shadow.num_tokens, shadow.stats)
            self._placement.set_resident(node, True, version)

    def apply(
        self,
        copied: tuple[tuple[int, int, tuple[int, ...]], ...],
        dropped: tuple[int, ...],
        stranded_blocks: int,
        gone: tuple[tuple[int, int], ...] = (),
        lost: WindowLosses = NO_LOSSES,
        overwritten: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """One report's host writes (any request's; each copy and overwrite once, by sequence
        number, in that order: a victim leaves before a copy onto its slots lands), then the
        paths it reports gone from vLLM's blocks (`gone`: key and plan version); `lost`: the
        report's count of kept documents that left uncopied (added up)."""
        self.reports += 1
        self.stranded_blocks = max(self.stranded_blocks, stranded_blocks)
        self.lost += lost
        self.dropped += len(dropped)
        placement = self._placement
        events: list[tuple[int, int, tuple[int, ...] | None]] = [
            *((seq, key, slots) for seq, key, slots in copied),
            *((seq, vid, None) for seq, vid in overwritten),
        ]
        for seq, key, copy_slots in sorted(events, key=lambda event: event[0]):
            if seq <= self.applied:
                continue
            self.applied = seq
            if copy_slots is None:
                self.overwritten += 1
                placement.overwrite(key)
                continue
            slots = copy_slots
            if not placement.host_lease.issuperset(slots):
                # A copy onto a victim whose overwrite this tree never applied (its report was
                # lost, or comes late): the copy says it was overwritten.
                for vid in placement.victims_on(slots):
                    self.overwritten += 1
                    placement.overwrite(vid)
                if not placement.host_lease.issuperset(slots):  # not lent: never attached
                    self.wasted += 1
                    continue
            placement.host_lease.difference_update(slots)
            placement.count_host_written(len(slots))
            shadow = self._shadows.get(key)
            if shadow is None or not self._attach(shadow, slots):
                placement.tiers[Tier.HOST].allocator.free(slots)
                self.wasted += 1
        for key, version in gone:
            shadow = self._shadows.get(key)
            node = self.node_of(shadow) if shadow is not None else None
            if node is not None:
                placement.set_resident(node, False, version)
        self._adapt_lease(lost.no_lease)

    def _adapt_lease(self, refused: int) -> None:
        """Grow the lease while copies outrun it, shrink it back while it idles: `refused`
        kept documents (this report's) found no lease room, so it doubles (up to
        `max_lease_slots`); none did and at least half the lease is unused (the tree's lease
        less the copies applied: what the engine has not used), so a quarter of its growth goes.
        Only the next top-ups see it: lent slots are never taken back."""
        if refused:
            self.lease_slots = min(2 * self.lease_slots, self.max_lease_slots)
        elif (
            self.lease_slots > self.base_lease_slots
            and 2 * len(self._placement.host_lease) >= self.lease_target()
        ):
            self.lease_slots -= max(1, (self.lease_slots - self.base_lease_slots) // 4)

    def forget(self, doc_id: str | None = None) -> None:
        """Forget the shadows of paths through `doc_id` (None: all, at `clear()`): a copy
        reported later for them only frees its slots."""
        for key, shadow in list(self._shadows.items()):
            if doc_id is None or any(d.doc_id == doc_id for d in shadow.docs):
                del self._shadows[key]
                del self._keys[(shadow.root_key, shadow.docs)]

    def engine_lost(self) -> None:
        """The engine died: copies it made and did not report are lost (their slots stay in
        the lease, which the next engine gets), and so is every lent victim (it may have
        overwritten one unreported: their slots join the lease); it numbers copies from 1
        again."""
        self.applied = 0
        for vid in list(self._placement.host_victims):
            self._placement.overwrite(vid)

    def check(self) -> None:
        """Raises `IntegrityError` if the engine reported blocks held with no copy in flight."""
        if self.stranded_blocks:
            fail(
                f"the engine found {self.stranded_blocks} blocks held for host writes with no "
                "copy in flight"
            )

    def node_of(self, shadow: Shadow) -> Node | None:
        """The attached node of `shadow`'s path, if any."""
        if not shadow.docs:
            return self._prefixes.roots.get(shadow.root_key)
        path = self._prefixes.walk(list(shadow.docs), shadow.root_key)
        return path[-1] if len(path) == len(shadow.docs) + 1 else None

    def _attach(self, shadow: Shadow, slots: tuple[int, ...]) -> bool:
        """Give `shadow`'s node a ready host copy on `slots` (attached if absent), if its
        parent holds a ready host copy (a root needs none) and the node holds none yet."""
        if len(slots) != slots_for_tokens(shadow.num_tokens, self._placement.page_size):
            return False
        node = self.node_of(shadow)
        parent: Node | None
        if node is not None:
            if Tier.HOST in node.slots or node.num_tokens != shadow.num_tokens:
                return False
            parent = node.parent
        elif shadow.docs:
            path = self._prefixes.walk(list(shadow.docs[:-1]), shadow.root_key)
            if len(path) != len(shadow.docs):  # its parent is not in the tree
                return False
            parent = path[-1]
        else:
            parent = None
        if parent is not None and Tier.HOST not in parent.ready:
            return False
        if node is None:
            key: DocKey | RootKey = shadow.docs[-1] if shadow.docs else shadow.root_key
            node = self._prefixes.attach(key, parent, shadow.num_tokens, shadow.stats)
        self._placement.adopt_copy(node, Tier.HOST, slots)
        self.copies += 1
        return True
