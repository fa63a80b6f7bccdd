"""Who may call what: the API key, the admin key, and the routes each opens.

    route                                   no key set   --api-key      + --admin-key
    /health, /metrics                       open         open           open
    /v1/... (generation, config, stats)     open         api or admin   api or admin (open
                                                                        without --api-key)
    /v1/cache/invalidate (+ /local),        open         api or admin   admin only (403 for
    /v1/cache/integrity                                                 the api key)
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

"The API key" may be several (`--api-key-file`, `read_key_file`), each with its tenant: a request
that presents one carries its tenant in its scope (`scope["ragcache_tenant"]`), where
`ServeState.salt_for` reads it for `--salt-per-key`. The admin key belongs to no tenant.

The API key file (`--api-key-file`) names the keys and the tenants they belong to: one key
per line, optionally followed by whitespace and a tenant name; blank lines and lines starting
with `#` are ignored:

    # key                              tenant
    sk-team-a-7f3c9e                   team-a
    sk-team-a-ci-21b0                  team-a
    sk-team-b-c81d                     team-b
    sk-lone-5e2a

Several keys may name one tenant (they share its cache). A key without a name is a tenant of
its own, named by a hash of the key (never the key itself). With `--salt-per-key`, every
request is salted with its tenant: it hits only KV its own tenant stored (docs/deploy.md,
"Tenants"). A key may not appear twice, nor contain whitespace.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ragcache_core.errors import ConfigError
from ragcache_core.serve.errors import error_body


@dataclass(frozen=True)
class ApiKey:
    """One accepted bearer key and its tenant's name."""

    key: str
    tenant: str

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key):
            raise ConfigError("an API key must be non-empty and hold no whitespace")
        if not self.tenant:
            raise ConfigError("a tenant name cannot be empty")

    @classmethod
    def unnamed(cls, key: str) -> ApiKey:
        """A key that is a tenant of its own (named by a hash of it)."""
        return cls(key, "key-" + hashlib.sha256(key.encode()).hexdigest()[:12])

    def __repr__(self) -> str:  # never print the key
        return f"ApiKey(tenant={self.tenant!r})"


def read_key_file(path: Path) -> tuple[ApiKey, ...]:
    """The keys of a key file (format in the module docstring). Raises `ConfigError` naming
    the line of a malformed entry, a repeated key, or a file with no key."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from None
    keys: list[ApiKey] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ConfigError(
                f"{path}:{number}: expected '<key> [tenant]', got {len(fields)} fields"
            )
        key = fields[0]
        if key in seen:
            raise ConfigError(f"{path}:{number}: this key appears twice")
        seen.add(key)
        keys.append(ApiKey(key, fields[1]) if len(fields) == 2 else ApiKey.unnamed(key))
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key")
    return tuple(keys)


ADMIN_ROUTES = frozenset(
    {"/v1/cache/invalidate", "/v1/cache/invalidate/local", "/v1/cache/integrity"}
)
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
