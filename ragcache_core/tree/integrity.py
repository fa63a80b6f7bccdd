"""What `KnowledgeTree.check_integrity` shares between the parts: the error it raises and a
summary of what the open requests hold, against which the parts check their own counters.

Each part checks its own invariants (`PrefixTree.check`, `Placement.check`, `Planner.check`);
all are O(nodes + slots) and meant for tests (called after every step) and for debugging.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

from ragcache_core.errors import RAGCacheError
from ragcache_core.plan import Tier
from ragcache_core.tree.request import RequestHandle


class IntegrityError(RAGCacheError):
    """An invariant of the knowledge cache does not hold (a bug, never user input)."""


def fail(message: str) -> NoReturn:
    """Raise `IntegrityError(message)` (the checks build messages only when they fail)."""
    raise IntegrityError(message)


@dataclass(frozen=True, slots=True)
class OpenHoldings:
    """What the open requests hold, summed from their ledgers (nodes by identity).

    `pins[id(node)]`: pins held on the node; `pending`: (id(node), tier) copies being written.
    """

    pins: Counter[int]
    pending: frozenset[tuple[int, Tier]]

    @classmethod
    def of(cls, handles: Iterable[RequestHandle]) -> OpenHoldings:
        pins: Counter[int] = Counter()
        pending: set[tuple[int, Tier]] = set()
        for handle in handles:
            ledger = handle.ledger
            pins.update(id(node) for node in ledger.pins)
            pending.update((id(node), tier) for node, tier in ledger.pending)
        return cls(pins, frozenset(pending))
