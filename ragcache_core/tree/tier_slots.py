"""One slot tier's bookkeeping: which slots are free, and which nodes to evict first.

Not to be confused with the *pools* of `ragcache_core.storage`, the tensors those slots index:
this is pure bookkeeping in the application process.
"""

from __future__ import annotations

import heapq

from ragcache_core.plan import Tier
from ragcache_core.policy.base import Priority
from ragcache_core.tree.allocator import SlotAllocator
from ragcache_core.tree.node import Node


class TierSlots:
    """Allocator + eviction-candidate heap of one slot tier. Mutated only by `Placement`.

    Heap entries are (priority, seq, node); an entry is live only while `node.heap_seq[tier]`
    still equals its seq and the node is still a candidate, so refreshing a priority is one
    push and stale entries are skipped on pop (lazy deletion, rebuilt when mostly stale).
    `pinned_slots` counts slots of this tier owned by pinned nodes (held while read or
    written: never evicted). With `lanes`, candidates go to one heap per lane (their
    priority's first element) and a victim is popped from the first lane of the order the
    policy gives (ARC's T1 and T2).
    """

    __slots__ = ("_heaps", "_lanes", "_seq", "allocator", "pinned_slots", "tier")

    def __init__(self, tier: Tier, num_slots: int, page_size: int, *, lanes: bool = False) -> None:
        self.tier = tier
        self.allocator = SlotAllocator(num_slots, page_size)
        self._lanes = lanes
        self._heaps: dict[float, list[tuple[Priority, int, Node]]] = {}
        self._seq = 0
        self.pinned_slots = 0

    def push(self, node: Node) -> None:
        """(Re)offer `node` as a candidate with its current `priority[tier]`."""
        if not node.is_candidate(self.tier):
            return
        self._seq += 1
        node.heap_seq[self.tier] = self._seq
        priority = node.priority[self.tier]
        heap = self._heaps.setdefault(priority[0] if self._lanes else 0.0, [])
        heapq.heappush(heap, (priority, self._seq, node))

    def pop_victim(self, lane_order: tuple[float, ...] = ()) -> Node | None:
        """Remove and return the lowest-priority live candidate (with lanes: of the first lane
        in `lane_order` that has one), or None if there is none."""
        tier = self.tier
        for lane in lane_order if self._lanes else (0.0,):
            heap = self._heaps.get(lane, [])
            while heap:
                _, seq, node = heapq.heappop(heap)
                if node.heap_seq.get(tier) == seq and node.is_candidate(tier):
                    del node.heap_seq[tier]
                    return node
        return None

    def evictable_bound(self) -> int:
        """Upper bound on slots that evictions could free (used minus pinned)."""
        return self.allocator.num_used - self.pinned_slots

    def maybe_compact(self, live_nodes: int) -> None:
        """Drop stale heap entries when they dominate (keeps memory O(nodes))."""
        if sum(len(heap) for heap in self._heaps.values()) > 4 * live_nodes + 1024:
            tier = self.tier
            for lane, heap in self._heaps.items():
                live = [
                    e for e in heap if e[2].heap_seq.get(tier) == e[1] and e[2].is_candidate(tier)
                ]
                heapq.heapify(live)
                self._heaps[lane] = live

    def clear_heap(self) -> None:
        self._heaps = {}
