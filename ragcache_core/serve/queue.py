"""The server's bounded queue: how many requests may be in flight, and what the rest are told.

    request ─► try_enter ─► Place (held until the response, streamed or not, has ended)
                   └──────► Refusal("full", retry_after_s)   -> 429 + Retry-After
                   └──────► Refusal("draining", ...)         -> 503 (shutting down)

In flight = running in the engine (at most `running`, vLLM's `max_num_seqs`) + waiting in
RAGCache's admission queue, where cache-aware reordering picks who goes next. The queue only
bounds the total (`capacity`); the order is RAGCache's.

Retry-After: when a full queue refuses a request, a place frees at the next completion. The
queue measures its drain rate (completions per second over the recent releases; before the
first one, at most `running` per the age of the oldest request in flight) and gives each
refused client its own turn behind the clients refused before it: turn k is about k / rate
seconds away. So a burst of refusals is spread over the time the queue needs to drain them,
instead of coming back at once and being refused again. Used from the server's event loop only
(not thread-safe).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

MAX_RETRY_AFTER_S = 60
RATE_WINDOW = 64
"""Releases the drain rate is measured over."""
RATE_HORIZON_S = 60.0
"""Releases older than this do not count toward the drain rate."""


@dataclass(frozen=True)
class Refusal:
    """Why a request was not let in, and when to try again (whole seconds, as HTTP wants)."""

    reason: Literal["full", "draining"]
    retry_after_s: int


class Place:
    """A held place in flight. `release()` is idempotent (every path that ends a response
    calls it)."""

    def __init__(self, queue: BoundedQueue, entered: float) -> None:
        self._queue = queue
        self.entered = entered
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._queue._leave(self)


class BoundedQueue:
    """At most `capacity` requests in flight; `running` of them run at once in the engine.
    `clock` (monotonic seconds) is injectable for tests."""

    def __init__(
        self, capacity: int, running: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if running < 1 or capacity < running:
            raise ValueError(f"need 1 <= running <= capacity, got {running}, {capacity}")
        self.capacity = capacity
        self.running = running
        self.in_flight = 0
        self.draining = False
        self.refused = 0
        self._clock = clock
        self._places: dict[int, Place] = {}
        self._releases: deque[float] = deque(maxlen=RATE_WINDOW)
        self._promised = 0.0
        """The time the last refused client was told to come back at."""

    @property
    def waiting(self) -> int:
        """Requests in flight beyond those the engine runs at once."""
        return max(0, self.in_flight - self.running)

    def try_enter(self) -> Place | Refusal:
        """A place, or why not (the caller answers 429 / 503)."""
        if self.draining:
            self.refused += 1
            return Refusal("draining", self._turn())
        if self.in_flight >= self.capacity:
            self.refused += 1
            return Refusal("full", self._turn())
        self.in_flight += 1
        place = Place(self, self._clock())
        self._places[id(place)] = place
        return place

    def drain_rate(self) -> float:
        """Completions per second: measured over the recent releases, else (nothing
        finished lately) at most `running` per the age of the oldest request in flight."""
        now = self._clock()
        recent = [t for t in self._releases if now - t <= RATE_HORIZON_S]
        if len(recent) >= 2 and recent[-1] > recent[0]:
            # n releases over the time since the first (now included: a stall lowers it).
            return len(recent) / max(now - recent[0], 1e-3)
        oldest = min((p.entered for p in self._places.values()), default=now)
        return self.running / max(now - oldest, 1.0)

    def retry_after_s(self) -> int:
        """When the next place is likely free (whole seconds, without taking a turn)."""
        return _clamp(1.0 / self.drain_rate())

    def _turn(self) -> int:
        """The next refused client's turn: one completion after those of the clients refused
        before it that are still to come back, at the rate measured now."""
        now = self._clock()
        at = max(now, self._promised) + 1.0 / self.drain_rate()
        self._promised = at
        return _clamp(at - now)

    def close(self) -> None:
        """Stop letting requests in (shutdown); those in flight finish."""
        self.draining = True

    def _leave(self, place: Place) -> None:
        self.in_flight -= 1
        self._places.pop(id(place), None)
        self._releases.append(self._clock())


def _clamp(seconds: float) -> int:
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))
