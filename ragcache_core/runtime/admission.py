"""Admission: requests enter prefill while a budget of tokens to compute has room (vLLM's
per-step token budget by default, so what is admitted fits the engine's next steps), and at
most `capacity` at once; the rest wait in a reordering queue (docs/design.md 2.4) whose priorities
are computed when room frees, against the tree as it is then. A request leaves prefill when its
first token arrives. A request larger than the whole budget is admitted alone.

A request whose next document is being computed right now by a request already in prefill
(its node is in flight) is *deferred*: it waits outside the queue until that request's first
token makes the node readable (or its failure removes it), then queues with a hit instead of
computing the same document a second time beside it (what vLLM's own prefix caching gets by
scheduling the second request after the first one's blocks are computed). Nothing waits on a
request that is not in prefill, so a deferral lasts at most one prefill.

Runs on the controller's loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ragcache_core.runtime.reorder import RequestQueue, make_queue


@dataclass
class Ticket:
    """A request waiting for (or holding) a place in prefill (a `PrefillLease`)."""

    score: Callable[[], tuple[int, int]]
    """(cached tokens, tokens to compute) as of now."""
    blocked: Callable[[], bool] = lambda: False
    """Whether a document the request could read is being written by a request in prefill
    right now (it becomes readable at that request's first token)."""
    tokens: int = 0
    """Tokens to compute, as of admission (what the request takes from the budget)."""
    future: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    enqueued_at: float = field(default_factory=time.perf_counter)
    admitted_at: float = 0.0

    @property
    def wait_s(self) -> float:
        return max(0.0, self.admitted_at - self.enqueued_at)


class PrefillLease:
    """A held place in prefill (`tokens` of the budget). `release()` is idempotent, so every
    path that may end a request (first token, failure, cancellation, even a task cancelled
    before it ever ran) can call it."""

    def __init__(self, admission: Admission, tokens: int = 0) -> None:
        self._admission = admission
        self.tokens = tokens
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._admission.release(self.tokens)


class Admission:
    """`capacity`: requests in prefill at most; `token_budget`: tokens to compute in prefill
    at most (None: no token limit)."""

    def __init__(
        self, capacity: int, queue: str, window: int, token_budget: int | None = None
    ) -> None:
        self.capacity = capacity
        self.token_budget = token_budget
        self.in_prefill = 0
        self.prefill_tokens = 0
        self.deferrals = 0
        """Requests deferred so far (each waited for a document another request computed)."""
        self._queue: RequestQueue[Ticket] = make_queue(
            queue, score=lambda t: t.score(), window=window
        )
        self._deferred: list[Ticket] = []

    @property
    def waiting(self) -> int:
        """Requests waiting for prefill (queued or deferred)."""
        return len(self._queue) + len(self._deferred)

    def fits(self, tokens: int) -> bool:
        """Whether a request computing `tokens` may enter prefill now (ignoring the queue)."""
        if self.in_prefill == 0:
            return True  # even a request larger than the budget runs, alone
        if self.in_prefill >= self.capacity:
            return False
        return self.token_budget is None or self.prefill_tokens + tokens <= self.token_budget

    def has_room(self, tokens: int = 0) -> bool:
        """Whether a request computing `tokens` may enter prefill now: nobody is queued
        before it and it fits (deferred requests wait for a document, not for room)."""
        return not self._queue and self.fits(tokens)

    def try_acquire(self, tokens: int = 0) -> PrefillLease | None:
        """Take room for `tokens` only if it is free now and nobody waits, not even a
        deferred request (speculation only uses capacity the final requests leave idle)."""
        if self.waiting or not self.fits(tokens):
            return None
        return self._admit(tokens)

    async def acquire(self, ticket: Ticket) -> PrefillLease:
        """Wait for room in prefill. Cancelling the wait leaves the queue consistent."""
        if self.in_prefill and ticket.blocked():
            self.deferrals += 1
            self._deferred.append(ticket)
        else:
            ticket.tokens = ticket.score()[1]
            if self.has_room(ticket.tokens):
                ticket.admitted_at = time.perf_counter()
                return self._admit(ticket.tokens)
            self._queue.push(ticket)
        try:
            await ticket.future
        except asyncio.CancelledError:
            if ticket.future.done() and not ticket.future.cancelled():
                self.release(ticket.tokens)  # admitted just as we were cancelled: give it back
            ticket.future.cancel()
            raise
        return PrefillLease(self, ticket.tokens)

    def release(self, tokens: int = 0) -> None:
        """A request left prefill (first token, failure or abort): queue the deferred
        requests it unblocked, then admit the best waiters while they fit. Call it through
        `PrefillLease.release`, which makes it idempotent, and only after the request's copies were
        confirmed or aborted in the tree (so the deferred see what it wrote)."""
        self.in_prefill -= 1
        self.prefill_tokens -= tokens
        self._undefer()
        while self._queue:
            ticket = self._queue.peek()
            if ticket.future.done():  # cancelled while waiting
                self._queue.pop()
                continue
            ticket.tokens = ticket.score()[1]  # the tree may have cached more since it queued
            if not self.fits(ticket.tokens):
                break
            self._queue.pop()
            self.in_prefill += 1
            self.prefill_tokens += ticket.tokens
            ticket.admitted_at = time.perf_counter()
            ticket.future.set_result(None)

    def _undefer(self) -> None:
        """Move deferred requests that are no longer blocked to the queue (all of them when
        nothing is in prefill: nobody is left to unblock them)."""
        if not self._deferred:
            return
        still: list[Ticket] = []
        for ticket in self._deferred:
            if ticket.future.done():  # cancelled while deferred
                continue
            if self.in_prefill and ticket.blocked():
                still.append(ticket)
            else:
                self._queue.push(ticket)
        self._deferred = still

    def _admit(self, tokens: int) -> PrefillLease:
        self.in_prefill += 1
        self.prefill_tokens += tokens
        return PrefillLease(self, tokens)
