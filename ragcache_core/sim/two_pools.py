"""The paper's two-pool model: a GPU slot pool of the tree's own above the host tier.

The engine has no such pool (its GPU tier is vLLM's own blocks, docs/design.md 3.1); the
simulator (`Simulator`, `ragcache simulate` without `--engine`) models the paper with one:

    tree = KnowledgeTree(root, host_slots=M, page_size=P, gpu_pool=TwoPools(N))

Computed documents are then stored on the GPU pool; a GPU victim is swapped out to the host
once (its first GPU eviction with host room; later ones just free its GPU copy); a host hit is
promoted to the GPU pool while room can be made. The slots a swap-out frees are held for the
request that evicted them until it completes (only its plan may reuse them). Bookkeeping only:
no bytes move in the simulator, so no copy is planned.
"""

from __future__ import annotations

from ragcache_core.errors import RAGCacheError
from ragcache_core.plan import Tier
from ragcache_core.tree.node import Node
from ragcache_core.tree.placement import Placement
from ragcache_core.tree.request import RequestHandle


class TwoPools:
    """The GPU pool of `slots` slots of one tree (`KnowledgeTree(gpu_pool=...)` binds it).

    Called by the tree's placement (GPU victims) and planner (host hits); it mutates the
    placement's tiers and nodes as `Placement` documents, under the same pins. Counts its GPU
    victims (`evictions`), the swap-outs among them (`swap_outs`) and its promotions of host
    hits (`promotions`) until the tree's `clear()`. Raises `RAGCacheError` when bound to a
    second tree.
    """

    __slots__ = ("_placement", "evictions", "promotions", "slots", "swap_outs")

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.evictions = 0
        self.swap_outs = 0
        self.promotions = 0
        self._placement: Placement | None = None

    def bind(self, placement: Placement) -> None:
        """Serve `placement` (once: a pool belongs to one tree)."""
        if self._placement is not None:
            raise RAGCacheError("a TwoPools serves one tree")
        self._placement = placement

    @property
    def placement(self) -> Placement:
        assert self._placement is not None, "TwoPools used before the tree bound it"
        return self._placement

    @property
    def used_slots(self) -> int:
        """GPU slots owned by copies or held for a request now."""
        return self.placement.tiers[Tier.GPU].allocator.num_used

    def evict(self, node: Node, handle: RequestHandle) -> None:
        """GPU victim `node` (no host copy) leaves the GPU pool: swapped out to the host
        within `handle`'s plan when host room can be made (its GPU slots stay held for
        `handle`), else it leaves the tree with its subtree."""
        placement = self.placement
        self.evictions += 1
        gpu_slots = node.slots[Tier.GPU]
        if placement.make_room(Tier.HOST, len(gpu_slots), handle):
            placement.write_copy(node, Tier.HOST, len(gpu_slots), handle)
            placement.drop_copy(node, Tier.GPU, hold_for=handle, evicted=True)
            placement.pin(node, handle)
            placement.set_priority(node, Tier.HOST)
            self.swap_outs += 1
        else:
            placement.drop_copy(node, Tier.GPU, evicted=True)
            placement.remove(node)

    def zero_copy_eviction(self) -> None:
        """A GPU victim with a host copy already was freed without a copy."""
        self.evictions += 1

    def promote(self, node: Node, handle: RequestHandle) -> bool:
        """Copy host hit `node` to the GPU pool for `handle` if its parent is on GPU and room
        can be made. Returns whether it did (then the plan reads it from GPU)."""
        placement = self.placement
        parent_on_gpu = node.parent is None or placement.gpu_usable(node.parent, handle)
        count = len(node.slots[Tier.HOST])
        if not (parent_on_gpu and placement.make_room(Tier.GPU, count, handle)):
            return False
        placement.write_copy(node, Tier.GPU, count, handle)
        placement.refresh(node)
        self.promotions += 1
        return True

    def reset_counters(self) -> None:
        self.evictions = 0
        self.swap_outs = 0
        self.promotions = 0
