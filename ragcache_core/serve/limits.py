"""What the server takes on, bounded: what a connection may cost before its request is even
parsed, and how many requests may be in flight.

    connect ──► headers, within `header_timeout_s` of the connection (or of the first byte
                of a keep-alive connection's next request), at most MAX_HEADER_BYTES:
                else 408 (or 431) and the connection closed. uvicorn has no such timeout,
                so `guarded_protocol` adds one to its HTTP/1.1 protocol (httptools, or h11)
            ──► the body (`BodyLimitMiddleware`): a Content-Length over `max_body_bytes` is
                refused with 413 before any of it is read; a body read in parts is refused
                with 413 as soon as it passes the limit, and with 408 when a part takes more
                than `read_timeout_s` to come; at most `max_body_bytes` is ever held
            ──► the app, which gets the body whole (and later reads, disconnects, as usual)

Each refusal is OpenAI-shaped JSON (`error_body`). The defaults (`ServeSettings`,
docs/deploy.md): 8 MiB of body (a full 128k-token context of text is under 1 MiB; JSON
escaping at most sextuples it), 10 s for the headers, 30 s per part of the body.

The bounded queue (`BoundedQueue`): how many requests may be in flight, and what the rest are
told.

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

import asyncio
import json
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragcache_core.serve.errors import error_body

MAX_HEADER_BYTES = 64 * 1024
"""Bytes a request may send before its headers are complete (431 past them)."""


class BodyLimitMiddleware:
    """Reads each request's body (bounded in size and in time) before the app runs."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except TimeoutError:
                message = {"type": "timeout"}
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            if message["type"] == "timeout":
                text = f"the request body did not arrive within {self.read_timeout_s:g} s"
                await _refuse(408, text, "--read-timeout", scope, receive, send)
                return
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(part)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replaying(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        text = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        await _refuse(413, text, "--max-body-mib", scope, receive, send)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` whose first message is the whole `body` (then the connection's own)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(
    status: int, text: str, flag: str, scope: Scope, receive: Receive, send: Send
) -> None:
    body = error_body(status, f"{text} (ragcache serve {flag})")
    await JSONResponse(body, status_code=status)(scope, receive, send)


def guarded_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (httptools when installed, else h11), with a header
    timeout and a header size limit (module docstring)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # uvicorn without httptools
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return type("GuardedH11", (_H11Guard, H11Protocol), {"header_timeout_s": header_timeout_s})
    return type(
        "GuardedHttpTools",
        (_HttpToolsGuard, HttpToolsProtocol),
        {"header_timeout_s": header_timeout_s},
    )


class _HeaderGuard:
    """The timer and the byte count of one connection's headers. Armed at the connection
    and at the start of each next request, disarmed when the headers are complete; when it
    fires, the connection gets 408 and is closed."""

    header_timeout_s: float
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _timer: asyncio.TimerHandle | None = None
    _header_bytes = 0

    def _arm(self) -> None:
        if self._timer is None:
            self._header_bytes = 0
            self._timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def _armed(self) -> bool:
        return self._timer is not None

    def _count(self, data: bytes) -> None:
        if self._armed:
            self._header_bytes += len(data)

    def _check_size(self) -> None:
        if self._armed and self._header_bytes > MAX_HEADER_BYTES:
            self._close_with(431, f"the request headers are larger than {MAX_HEADER_BYTES} bytes")

    def _expired(self) -> None:
        self._timer = None
        text = f"the request headers did not arrive within {self.header_timeout_s:g} s"
        self._close_with(408, f"{text} (ragcache serve --header-timeout)")

    def _close_with(self, status: int, text: str) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(status, text)).encode()
        head = f"HTTP/1.1 {status} {_PHRASES[status]}\r\ncontent-type: application/json\r\n"
        head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        self.transport.write(head.encode() + body)
        self.transport.close()


_PHRASES = {408: "Request Timeout", 431: "Request Header Fields Too Large"}


class _HttpToolsGuard(_HeaderGuard):
    """The guard on uvicorn's httptools protocol: its parser says when a request begins
    (`on_message_begin`) and when its headers are complete (`on_headers_complete`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._count(data)
        super().data_received(data)  # type: ignore[misc]
        self._check_size()

    def on_message_begin(self) -> None:
        super().on_message_begin()  # type: ignore[misc]
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()  # type: ignore[misc]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]


class _H11Guard(_HeaderGuard):
    """The guard on uvicorn's h11 protocol: h11 waits in IDLE until a request's headers
    are complete."""

    conn: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def data_received(self, data: bytes) -> None:
        import h11

        if self.conn.their_state is h11.IDLE:
            self._arm()
        self._count(data)
        super().data_received(data)  # type: ignore[misc]
        if self.conn.their_state is not h11.IDLE:
            self._disarm()
        self._check_size()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]


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
