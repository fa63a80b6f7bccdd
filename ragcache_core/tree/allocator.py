"""Slot allocator of one tier: which page indices are free.

Pure bookkeeping; the tensors live in the data plane. Slots are reused LIFO, which keeps the
working set of a mostly-idle tier small.
"""

from __future__ import annotations

from collections.abc import Iterable

from ragcache_core.errors import ConfigError, RAGCacheError


class SlotAllocator:
    """Free list over slots 0..num_slots-1 of one tier.

    Memory is O(slots ever used), not O(capacity): slots above a high-water mark are free
    without being listed, so an "infinite" capacity costs nothing. Mutates only itself.
    Raises `RAGCacheError` on a double free or a free of a slot out of range (both are bugs
    of the caller, never user input).
    """

    __slots__ = ("_free", "_free_set", "_high", "num_slots", "page_size")

    def __init__(self, num_slots: int, page_size: int) -> None:
        if num_slots < 0:
            raise ConfigError(f"num_slots cannot be negative, got {num_slots}")
        if page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        self._high = 0  # slots >= _high have never been handed out
        self._free: list[int] = []  # returned slots below _high, reused LIFO
        self._free_set: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free) + self.num_slots - self._high

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def allocate(self, count: int) -> tuple[int, ...]:
        """Take `count` free slots. Raises `RAGCacheError` if fewer are free (check first)."""
        if count > self.num_free:
            raise RAGCacheError(f"allocator: asked for {count} slots, {self.num_free} free")
        reused = min(count, len(self._free))
        taken = self._free[len(self._free) - reused :]
        del self._free[len(self._free) - reused :]
        self._free_set.difference_update(taken)
        fresh = range(self._high, self._high + count - reused)
        self._high += count - reused
        return (*taken, *fresh)

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the free list."""
        for slot in slots:
            if not 0 <= slot < self.num_slots:
                raise RAGCacheError(f"allocator: slot {slot} out of range 0..{self.num_slots}")
            if slot >= self._high or slot in self._free_set:
                raise RAGCacheError(f"allocator: slot {slot} freed twice")
            self._free_set.add(slot)
            self._free.append(slot)

    def is_free(self, slot: int) -> bool:
        return slot >= self._high or slot in self._free_set

    def reset(self) -> None:
        """Mark every slot free (the tier's contents are gone)."""
        self._high = 0
        self._free = []
        self._free_set = set()
