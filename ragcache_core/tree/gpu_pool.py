"""The hook through which a GPU slot pool of the tree's own joins it (`GpuPool`).

The engine's tree has none: its GPU tier is vLLM's own blocks, which vLLM's LRU evicts
(docs/design.md 3.1). The paper's two pools are the simulator's (`sim/two_pools.py`,
`TwoPools`), handed to the tree as `KnowledgeTree(gpu_pool=...)`; `tree/` never imports `sim/`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ragcache_core.tree.node import Node
    from ragcache_core.tree.placement import Placement
    from ragcache_core.tree.request import RequestHandle


class GpuPool(Protocol):
    """A GPU pool of `slots` slots. With one, the tree stores computed documents on it
    (`Tier.GPU`), and the placement and the planner call it for what only it decides. Each
    call mutates the placement's tiers and nodes as `Placement` documents, under the pins the
    planner holds; none raises but on a bookkeeping bug."""

    slots: int

    def bind(self, placement: Placement) -> None:
        """Serve `placement` (the tree's, once, at construction)."""

    def evict(self, node: Node, handle: RequestHandle) -> None:
        """GPU victim `node`, with no host copy, leaves the pool for `handle`'s plan."""

    def zero_copy_eviction(self) -> None:
        """A GPU victim with a host copy was freed (no copy)."""

    def promote(self, node: Node, handle: RequestHandle) -> bool:
        """Copy host hit `node` to the pool for `handle` if it can; return whether it did."""

    def reset_counters(self) -> None:
        """The tree's `clear()`: zero the pool's counters."""
