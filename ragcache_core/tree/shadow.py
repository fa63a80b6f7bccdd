"""A path the tree wants on the host tier before it is there (eviction-time host writes).

`HostWrites` (host_writes.py) makes and keeps them; a request's ledger lists the ones its plan
kept (`RequestLedger.keeps`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragcache_core.policy import NodeStats
from ragcache_core.tree.keys import DocKey, RootKey


@dataclass(slots=True)
class Shadow:
    """A path the tree wants on the host tier, before it is there: its key in plans, its
    root and documents, its size and the access statistics its node will have."""

    key: int
    root_key: RootKey
    docs: tuple[DocKey, ...]
    num_tokens: int
    stats: NodeStats
