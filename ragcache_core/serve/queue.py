"""The server's bounded queue: how many requests may be in flight, and what the rest are told.

    request ─► try_enter ─► Place (held until the response, streamed or not, has ended)
                   └──────► Refusal("full", retry_after_s)   -> 429 + Retry-After
                   └──────► Refusal("draining", ...)         -> 503 (shutting down)

In flight = running in the engine (at most `running`, vLLM's `max_num_seqs`) + waiting in
RAGCache's admission queue, where cache-aware reordering picks who goes next. The queue only
bounds the total (`capacity`); the order is RAGCache's. Retry-After estimates when a place
frees: the mean request time (a moving average) times the rounds of `running` requests ahead.
Used from the server's event loop only (not thread-safe).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Literal

_SMOOTHING = 0.2
"""Weight of the newest request time in the moving average."""
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class Refusal:
    """Why a request was not let in, and when to try again (whole seconds, as HTTP wants)."""

    reason: Literal["full", "draining"]
    retry_after_s: int


class Place:
    """A held place in flight. `release()` is idempotent (every path that ends a response
    calls it)."""

    def __init__(self, queue: BoundedQueue) -> None:
        self._queue = queue
        self._entered = time.perf_counter()
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._queue._leave(time.perf_counter() - self._entered)


class BoundedQueue:
    """At most `capacity` requests in flight; `running` of them run at once in the engine."""

    def __init__(self, capacity: int, running: int) -> None:
        if running < 1 or capacity < running:
            raise ValueError(f"need 1 <= running <= capacity, got {running}, {capacity}")
        self.capacity = capacity
        self.running = running
        self.in_flight = 0
        self.draining = False
        self.mean_request_s = 1.0
        self.refused = 0

    @property
    def waiting(self) -> int:
        """Requests in flight beyond those the engine runs at once."""
        return max(0, self.in_flight - self.running)

    def try_enter(self) -> Place | Refusal:
        """A place, or why not (the caller answers 429 / 503)."""
        if self.draining:
            self.refused += 1
            return Refusal("draining", self.retry_after_s())
        if self.in_flight >= self.capacity:
            self.refused += 1
            return Refusal("full", self.retry_after_s())
        self.in_flight += 1
        return Place(self)

    def retry_after_s(self) -> int:
        """Seconds until a place is likely free: the rounds of running requests ahead."""
        rounds = (self.waiting + 1) / self.running
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.mean_request_s * rounds)))

    def close(self) -> None:
        """Stop letting requests in (shutdown); those in flight finish."""
        self.draining = True

    def _leave(self, seconds: float) -> None:
        self.in_flight -= 1
        self.mean_request_s += _SMOOTHING * (seconds - self.mean_request_s)
