"""API-key check (pure ASGI middleware, as `vllm serve`'s): when the server has a key, every
`/v1/...` request needs `Authorization: Bearer <key>`, else 401. `/health` and `/metrics`
stay open for load balancers and Prometheus."""

from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ragcache_core.serve.errors import error_body

GUARDED_PREFIX = "/v1"


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()

    def _allowed(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.strip().encode()).digest()
        return secrets.compare_digest(given, self._digest)  # constant time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = (
            scope["type"] == "http"
            and scope.get("method") != "OPTIONS"
            and str(scope["path"]).startswith(GUARDED_PREFIX)
        )
        if guarded and not self._allowed(Headers(scope=scope)):
            body = error_body(401, "a valid API key is required (Authorization: Bearer <key>)")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)
