"""Who may call what: the API key, the admin key, and the routes each opens.

    route                                   no key set   --api-key      + --admin-key
    /health, /metrics                       open         open           open
    /v1/... (generation, config, stats)     open         api or admin   api or admin (open
                                                                        without --api-key)
    /v1/cache/invalidate, /integrity        open         api or admin   admin only (403 for
                                                                        the api key)
    /openapi.json, /docs, /redoc            open         api or admin   api or admin (admin
                                                                        without --api-key)

A key is sent as `Authorization: Bearer <key>` and compared in constant time (hashed first,
so its length is not timed either). A missing or wrong key is 401; the API key on an admin
route when the server has an admin key is 403, naming `--admin-key`. Without `--admin-key`
the API key opens the admin routes too: an app that re-indexes a document must be able to
invalidate it, and invalidation only drops cached KV (it costs recomputation, never a wrong
answer); docs/deploy.md says when to set one. `/health` and `/metrics` stay open, as in
`vllm serve`, for load balancers and Prometheus (they reveal load, never content). OPTIONS
(CORS preflight) is never guarded. Pure ASGI middleware, as `vllm serve`'s.

"The API key" may be several (`--api-key-file`, serve/keys.py), each with its tenant: a request
that presents one carries its tenant in its scope (`scope["ragcache_tenant"]`), where
`ServeState.salt_for` reads it for `--salt-per-key`. The admin key belongs to no tenant.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Literal

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ragcache_core.serve.errors import error_body
from ragcache_core.serve.keys import ApiKey

ADMIN_ROUTES = frozenset({"/v1/cache/invalidate", "/v1/cache/integrity"})
DOC_ROUTES = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
GUARDED_PREFIX = "/v1"

Role = Literal["user", "admin"]


class KeyMiddleware:
    """Guards the routes by the table in the module docstring."""

    def __init__(
        self, app: ASGIApp, keys: tuple[ApiKey, ...] = (), admin_key: str | None = None
    ) -> None:
        self.app = app
        self._users = [(_digest(k.key), k.tenant) for k in keys]
        self._admin = _digest(admin_key) if admin_key else None

    def needs(self, path: str) -> Role | None:
        """The role a request for `path` needs (None: open)."""
        if path in ADMIN_ROUTES and self._admin is not None:
            return "admin"
        if path.startswith(GUARDED_PREFIX):
            return "user" if bool(self._users) else None
        if path in DOC_ROUTES:
            if bool(self._users):
                return "user"
            return "admin" if self._admin is not None else None
        return None

    def role(self, headers: Headers) -> tuple[Role | None, str | None]:
        """The role the request's bearer key gives (None: no valid key) and, for an API key,
        its tenant."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None, None
        given = _digest(token.strip())
        if self._admin is not None and secrets.compare_digest(given, self._admin):
            return "admin", None
        tenant = None
        for digest, name in self._users:  # every key compared, in constant time each
            if secrets.compare_digest(given, digest):
                tenant = name
        return ("user", tenant) if tenant is not None else (None, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        need = None
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            need = self.needs(str(scope["path"]))
        if need is None:
            await self.app(scope, receive, send)
            return
        role, tenant = self.role(Headers(scope=scope))
        if role == "admin" or (role == "user" and need == "user"):
            if tenant is not None:
                scope["ragcache_tenant"] = tenant
            await self.app(scope, receive, send)
            return
        status, message = _refusal(need, role)
        await JSONResponse(error_body(status, message), status_code=status)(scope, receive, send)


def _refusal(need: Role, role: Role | None) -> tuple[int, str]:
    if need == "admin" and role == "user":
        return 403, (
            "this route needs the server's admin key (ragcache serve --admin-key); the API key "
            "does not open it"
        )
    if need == "admin":
        return 401, (
            "this route needs the server's admin key (ragcache serve --admin-key): "
            "Authorization: Bearer <admin key>"
        )
    return 401, "a valid API key is required (Authorization: Bearer <key>)"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
