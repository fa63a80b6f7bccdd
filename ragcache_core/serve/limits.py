"""What a connection may cost the server before its request is even parsed: bounded.

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
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

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
