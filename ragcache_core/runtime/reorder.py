"""Admission queues: which waiting request is prefilled next (docs/design.md 2.4).

    push(r) ... pop() -> r        FCFSQueue: arrival order
                                  CacheAwareQueue: highest CachedLength / ComputationLength
                                  first, but no request is overtaken more than `window` times

Priorities are computed at pop time, against the cache as it is then: a request's cached
length grows when an earlier request stores the documents it needs (this is what turns the
paper's alternating D1/D2 stream from 0% into ~66% hits).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ragcache_core.errors import ConfigError, RAGCacheError

T = TypeVar("T")

ScoreFn = Callable[[T], tuple[int, int]]
"""(cached tokens, tokens to compute) of a waiting request, as of now."""


def order_priority(cached: int, compute: int) -> float:
    """OrderPriority = CachedLength / ComputationLength (infinite when nothing to compute)."""
    return cached / compute if compute > 0 else float("inf")


class RequestQueue(ABC, Generic[T]):
    """A queue of waiting requests. `pop` raises `RAGCacheError` when empty."""

    name: str

    @abstractmethod
    def push(self, item: T) -> None: ...

    @abstractmethod
    def pop(self) -> T: ...

    @abstractmethod
    def peek(self) -> T:
        """The item `pop` would return now, without removing it or counting overtakes."""

    @abstractmethod
    def __len__(self) -> int: ...


class FCFSQueue(RequestQueue[T]):
    """First come, first served: the baseline."""

    name = "fcfs"

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def push(self, item: T) -> None:
        self._items.append(item)

    def pop(self) -> T:
        if not self._items:
            raise RAGCacheError("pop from an empty request queue")
        return self._items.popleft()

    def peek(self) -> T:
        if not self._items:
            raise RAGCacheError("peek into an empty request queue")
        return self._items[0]

    def __len__(self) -> int:
        return len(self._items)


class CacheAwareQueue(RequestQueue[T]):
    """Cache-aware reordering with a starvation window counted in overtakes.

    `pop` serves the request with the highest `order_priority` (ties: oldest first), except
    that a request already overtaken `window` times (served-after-it requests that arrived
    after it) is served first. Only the oldest waiting request can hold the largest overtake
    count, so the check is O(1); choosing the best is O(queue length).
    """

    name = "cache_aware"

    def __init__(self, score: ScoreFn[T], window: int) -> None:
        if window < 0:
            raise ConfigError(f"reordering window cannot be negative, got {window}")
        self._score = score
        self.window = window
        self._items: dict[int, T] = {}
        self._overtaken: dict[int, int] = {}
        self._seq = 0

    def push(self, item: T) -> None:
        self._items[self._seq] = item
        self._overtaken[self._seq] = 0
        self._seq += 1

    def pop(self) -> T:
        best = self._choose("pop from")
        for seq in self._items:
            if seq >= best:
                break
            self._overtaken[seq] += 1
        return self._take(best)

    def peek(self) -> T:
        return self._items[self._choose("peek into")]

    def _choose(self, what: str) -> int:
        if not self._items:
            raise RAGCacheError(f"{what} an empty request queue")
        oldest = next(iter(self._items))
        if self._overtaken[oldest] >= self.window:
            return oldest
        best, best_priority = oldest, -1.0
        for seq, item in self._items.items():
            priority = order_priority(*self._score(item))
            if priority > best_priority:
                best, best_priority = seq, priority
        return best

    def _take(self, seq: int) -> T:
        del self._overtaken[seq]
        return self._items.pop(seq)

    def __len__(self) -> int:
        return len(self._items)


def _fcfs(score: ScoreFn[Any], window: int) -> RequestQueue[Any]:
    return FCFSQueue()


QUEUES: dict[str, Callable[[ScoreFn[Any], int], RequestQueue[Any]]] = {
    "fcfs": _fcfs,
    "cache_aware": CacheAwareQueue,
}
"""Queue factories by name; each takes (score, window). Adding a queue = one entry."""


def make_queue(name: str, *, score: ScoreFn[T], window: int) -> RequestQueue[T]:
    """A queue by name. Raises `ConfigError` for an unknown name or a negative window."""
    try:
        factory = QUEUES[name]
    except KeyError:
        raise ConfigError(
            f"unknown request queue {name!r}; choose one of {', '.join(QUEUES)}"
        ) from None
    return factory(score, window)
