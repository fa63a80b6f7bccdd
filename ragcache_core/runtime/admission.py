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

Runs on RAGCache's own loop only (`loop.LoopThread`; not thread-safe).
"""

from __future__ import annotations

import asyncio
import time

from ragcache_core.runtime.attempt import Attempt
from ragcache_core.runtime.reorder import RequestQueue, make_queue


class Admission:
    """`capacity`: requests in prefill at most; `token_budget`: tokens to compute in prefill
    at most (None: no token limit). What waits is a request's try (`Attempt`): admission reads
    its request's `score` and `blocked` and keeps the try's place in prefill on it
    (`in_prefill`, `prefill_tokens`)."""

    def __init__(
        self, capacity: int, queue: str, window: int, token_budget: int | None = None
    ) -> None:
        self.capacity = capacity
        self.token_budget = token_budget
        self.in_prefill = 0
        self.prefill_tokens = 0
        self.deferrals = 0
        """Requests deferred so far (each waited for a document another request computed)."""
        self._queue: RequestQueue[Attempt] = make_queue(
            queue, score=lambda a: a.request.score(), window=window
        )
        self._deferred: list[Attempt] = []

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

    def try_acquire(self, attempt: Attempt) -> bool:
        """Admit `attempt` only if room for its tokens is free now and nobody waits, not
        even a deferred request (speculation only uses capacity the final requests leave
        idle). Returns whether it was admitted."""
        tokens = attempt.request.score()[1]
        if self.waiting or not self.fits(tokens):
            return False
        self._enter(attempt, tokens)
        return True

    async def acquire(self, attempt: Attempt) -> None:
        """Wait for room in prefill; `attempt` holds it on return. Cancelling the wait leaves
        the queue consistent."""
        if self.in_prefill and attempt.request.blocked():
            self.deferrals += 1
            self._deferred.append(attempt)
        else:
            tokens = attempt.request.score()[1]
            if self.has_room(tokens):
                attempt.admitted_at = time.perf_counter()
                self._enter(attempt, tokens)
                return
            attempt.prefill_tokens = tokens
            self._queue.push(attempt)
        try:
            await attempt.wake
        except asyncio.CancelledError:
            self.release(attempt)  # if admitted just as we were cancelled: give it back
            attempt.wake.cancel()
            raise

    def release(self, attempt: Attempt) -> None:
        """`attempt` left prefill (first token, failure or abort): queue the deferred
        requests it unblocked, then admit the best waiters while they fit. Idempotent (every
        path that may end a request calls it, even a task cancelled before it ever ran), and
        a no-op for an attempt never admitted. Call it only after the request's copies were
        confirmed or aborted in the tree (so the deferred see what it wrote)."""
        if not attempt.in_prefill:
            return
        attempt.in_prefill = False
        self.in_prefill -= 1
        self.prefill_tokens -= attempt.prefill_tokens
        self._undefer()
        while self._queue:
            waiter = self._queue.peek()
            if waiter.wake.done():  # cancelled while waiting
                self._queue.pop()
                continue
            tokens = waiter.request.score()[1]  # the tree may have cached more since it queued
            waiter.prefill_tokens = tokens
            if not self.fits(tokens):
                break
            self._queue.pop()
            self._enter(waiter, tokens)
            waiter.admitted_at = time.perf_counter()
            waiter.wake.set_result(None)

    def _undefer(self) -> None:
        """Move deferred requests that are no longer blocked to the queue (all of them when
        nothing is in prefill: nobody is left to unblock them)."""
        if not self._deferred:
            return
        still: list[Attempt] = []
        for attempt in self._deferred:
            if attempt.wake.done():  # cancelled while deferred
                continue
            if self.in_prefill and attempt.request.blocked():
                still.append(attempt)
            else:
                self._queue.push(attempt)
        self._deferred = still

    def _enter(self, attempt: Attempt, tokens: int) -> None:
        self.in_prefill += 1
        self.prefill_tokens += tokens
        attempt.in_prefill = True
        attempt.prefill_tokens = tokens
