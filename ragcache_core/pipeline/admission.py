"""Admission: at most `capacity` requests in prefill at once; the rest wait in a reordering
queue (DESIGN.md 2.4) whose priorities are computed when a slot frees, against the tree as it is
then. A request leaves prefill when its first token arrives.

Runs on the controller's loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ragcache_core.scheduler.queue import RequestQueue, make_queue


@dataclass
class Ticket:
    """A request waiting for (or holding) a prefill slot."""

    score: Callable[[], tuple[int, int]]
    """(cached tokens, tokens to compute) as of now."""
    future: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0

    @property
    def wait_s(self) -> float:
        return max(0.0, self.admitted_at - self.enqueued_at)


class Slot:
    """A held prefill slot. `release()` is idempotent, so every path that may end a request
    (first token, failure, cancellation, even a task cancelled before it ever ran) can call it."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._admission.release()


class Admission:
    def __init__(self, capacity: int, queue: str, window: int) -> None:
        self.capacity = capacity
        self.in_prefill = 0
        self._queue: RequestQueue[Ticket] = make_queue(
            queue, score=lambda t: t.score(), window=window
        )

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def has_room(self) -> bool:
        return self.in_prefill < self.capacity and not self._queue

    def try_acquire(self) -> Slot | None:
        """Take a slot only if one is free now and nobody waits (speculation uses this)."""
        if not self.has_room():
            return None
        self.in_prefill += 1
        return Slot(self)

    async def acquire(self, ticket: Ticket) -> Slot:
        """Wait for a prefill slot. Cancelling the wait leaves the queue consistent."""
        if self.has_room():
            self.in_prefill += 1
            ticket.admitted_at = time.perf_counter()
            return Slot(self)
        self._queue.push(ticket)
        try:
            await ticket.future
        except asyncio.CancelledError:
            if ticket.future.done() and not ticket.future.cancelled():
                self.release()  # admitted just as we were cancelled: give the slot back
            ticket.future.cancel()
            raise
        return Slot(self)

    def release(self) -> None:
        """A request left prefill (first token, failure or abort): admit the best waiter.
        Call it through `Slot.release`, which makes it idempotent."""
        self.in_prefill -= 1
        while self.in_prefill < self.capacity and self._queue:
            ticket = self._queue.pop()
            if ticket.future.done():  # cancelled while waiting
                continue
            self.in_prefill += 1
            ticket.admitted_at = time.perf_counter()
            ticket.future.set_result(None)
