"""`ragcache serve`'s keys and roles on the real server (`_serve_session`, shared with
test_serve.py): every /v1 route needs the API key, the admin routes the admin key, the OpenAPI
pages a key; the probes stay open.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from _serve_helpers import ServerProcess
from _serve_session import (
    ADMIN,
    KEY,
)

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("idle_after")]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}],
    ids=["missing", "wrong", "not-bearer"],
)
def test_without_the_key_every_v1_route_is_401(server: ServerProcess, headers: Any) -> None:
    for method, path in [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/rag/query"),
        ("GET", "/v1/models"),
        ("GET", "/v1/cache/stats"),
        ("POST", "/v1/cache/invalidate"),
    ]:
        response = httpx.request(method, f"{server.url}{path}", headers=headers, json={})
        assert response.status_code == 401, (path, response.text)
        wanted = "--admin-key" if path == "/v1/cache/invalidate" else "API key"
        assert wanted in response.json()["error"]["message"]


# ---------------------------------------------------------------------- roles


def test_the_admin_routes_open_with_the_admin_key_only(server: ServerProcess) -> None:
    """--admin-key: the API key still generates and reads the config (RAGCacheClient needs
    it), but only the admin key invalidates or checks integrity; the admin key opens the
    ordinary routes too."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    user = {"Authorization": f"Bearer {KEY}"}
    body = {"doc_id": "nobody-cached-this"}
    for method, path, payload in [
        ("POST", "/v1/cache/invalidate", body),
        ("GET", "/v1/cache/integrity", None),
    ]:
        refused = httpx.request(method, f"{server.url}{path}", headers=user, json=payload)
        assert refused.status_code == 403, refused.text
        assert "--admin-key" in refused.json()["error"]["message"]
        missing = httpx.request(method, f"{server.url}{path}", json=payload)
        assert missing.status_code == 401 and "--admin-key" in missing.text
        allowed = httpx.request(method, f"{server.url}{path}", headers=admin, json=payload)
        assert allowed.status_code == 200, allowed.text
    config = httpx.get(f"{server.url}/v1/rag/config", headers=user).json()
    assert config["admin_key"] is True and config["config"]["top_k"] == 2
    assert httpx.get(f"{server.url}/v1/cache/stats", headers=admin).status_code == 200


def test_the_client_invalidates_with_its_admin_key_only(server: ServerProcess) -> None:
    from ragcache_core.client import RAGCacheClient, RemoteError

    with RAGCacheClient(server.url, api_key=KEY) as user:
        with pytest.raises(RemoteError, match="--admin-key") as refused:
            user.invalidate("nobody-cached-this")
        assert refused.value.status == 403
        with pytest.raises(RemoteError, match="admin_key="):
            user.check_integrity()
    with RAGCacheClient(server.url, api_key=KEY, admin_key=ADMIN) as admin:
        assert admin.invalidate("nobody-cached-this") == 0
        admin.check_integrity()
    with RAGCacheClient(server.url, api_key=KEY, admin_key="wrong") as wrong:
        with pytest.raises(RemoteError) as denied:
            wrong.invalidate("nobody-cached-this")
        assert denied.value.status == 401


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_the_openapi_pages_need_a_key(server: ServerProcess, path: str) -> None:
    assert httpx.get(f"{server.url}{path}").status_code == 401
    opened = httpx.get(f"{server.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
    assert opened.status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
    assert httpx.get(f"{server.url}/metrics").status_code == 200
