"""Admission scheduling: FCFS and cache-aware reordering (DESIGN.md 2.4)."""

from __future__ import annotations

from ragcache_core.scheduler.queue import (
    QUEUES,
    CacheAwareQueue,
    FCFSQueue,
    RequestQueue,
    make_queue,
    order_priority,
)

__all__ = [
    "QUEUES",
    "CacheAwareQueue",
    "FCFSQueue",
    "RequestQueue",
    "make_queue",
    "order_priority",
]
