"""One server among N replicas behind a router (docs/deploy.md, "Many replicas").

- Every response carries `X-RAGCache-Replica: <replica id>` (`ReplicaHeaderMiddleware`), so a
  client learns which replica a routing key went to (RAGCacheClient's load bound) and a test
  or an operator sees where a request was served. The id is `--replica-id`, by default
  `host:port`.
- Invalidation fans out from the replica that receives it: `POST /v1/cache/invalidate` drops the
  document here, then on every `--peers` URL through `POST /v1/cache/invalidate/local` (which
  drops it on that replica only, never fans out again). The router sends an invalidation to
  one replica, but any replica may hold the document (as a later document of someone's
  prompt, after a spill past the load bound, after a failover), so one call must reach all.
  The answer lists every replica's count; if a peer cannot be reached or refuses, it is 502
  with the same list (this replica and the reachable peers have dropped the document;
  invalidation is idempotent, so the caller retries). A peer that is down has lost its cache
  with its process, so it cannot serve the stale copy when it comes back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "X-RAGCache-Replica"
LOCAL_INVALIDATE = "/v1/cache/invalidate/local"
PEER_TIMEOUT_S = 10.0


class ReplicaHeaderMiddleware:
    """Adds `X-RAGCache-Replica` to every HTTP response (pure ASGI, streams untouched)."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self._header = (REPLICA_HEADER.lower().encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self._header]
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass(frozen=True, slots=True)
class PeerReport:
    """What one fan-out did: documents dropped per replica, and the peers that failed."""

    removed: dict[str, int]
    errors: dict[str, str]

    @property
    def total(self) -> int:
        return sum(self.removed.values())

    def to_json(self, doc_id: str) -> dict[str, Any]:
        replicas: dict[str, Any] = {
            **self.removed,
            **{u: f"error: {e}" for u, e in self.errors.items()},
        }
        return {"doc_id": doc_id, "removed": self.total, "replicas": replicas}


async def invalidate_peers(
    peers: tuple[str, ...], doc_id: str, key: str | None, timeout_s: float = PEER_TIMEOUT_S
) -> PeerReport:
    """`POST <peer>/v1/cache/invalidate/local` on every peer at once (with `key` as the bearer
    key: the replicas of one deployment share their keys). Never raises for a peer's failure:
    it is in `errors`."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as http:
        answers = await asyncio.gather(
            *(_invalidate_one(http, peer, doc_id) for peer in peers), return_exceptions=False
        )
    removed = {p: n for p, (n, _) in zip(peers, answers, strict=True) if n is not None}
    errors = {p: e for p, (_, e) in zip(peers, answers, strict=True) if e is not None}
    return PeerReport(removed, errors)


async def _invalidate_one(
    http: httpx.AsyncClient, peer: str, doc_id: str
) -> tuple[int | None, str | None]:
    try:
        response = await http.post(peer.rstrip("/") + LOCAL_INVALIDATE, json={"doc_id": doc_id})
    except httpx.HTTPError as exc:
        return None, f"unreachable ({type(exc).__name__})"
    if response.status_code != 200:
        return None, f"HTTP {response.status_code}: {response.text[:200]}"
    try:
        return int(response.json()["removed"]), None
    except (ValueError, KeyError, TypeError):
        return None, f"unexpected answer {response.text[:200]!r}"
