"""Many replicas, without an engine: the client's document-affinity key and load bound, the
`X-RAGCache-Replica` header, and the invalidation fan-out between replicas.

The servers are the real app under real uvicorn on 127.0.0.1 over `CountingCache`, a stand-in
cache that counts invalidations (a mock isolating the fan-out from the engine). The client
tests talk to `FakeReplicas`, a stand-in server answering `/v1/rag/query` as replica r0 or
r1 by a rule the test sets, recording the headers it got. The real router with real
replicas is in test_replicas.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve_helpers import held_socket, serve_in_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ragcache_core.client import RAGCacheClient
from ragcache_core.client.affinity import AffinityKeys, affinity_key
from ragcache_core.client.wire import config_to_json, result_to_json
from ragcache_core.config import CacheConfig
from ragcache_core.documents import Document
from ragcache_core.errors import ConfigError
from ragcache_core.metrics import Metrics
from ragcache_core.query_result import CacheHits, QueryResult
from ragcache_core.serve.app import create_app
from ragcache_core.serve.state import ServeSettings

ADMIN = {"Authorization": "Bearer adm"}


# ---------------------------------------------------------------------- the affinity key


def test_the_key_names_the_first_document_only() -> None:
    a, b = Document("a", "x"), Document("b", "y")
    assert affinity_key([a, b]) == affinity_key([a]) != affinity_key([b, a])
    key = affinity_key([a])
    assert key is not None and key.startswith("rc1-") and len(key) == 20 and "a" not in key[4:5]
    assert affinity_key([]) is None


def test_the_bound_rekeys_a_hot_key_and_reuses_the_salt_that_landed_elsewhere() -> None:
    keys = AffinityKeys(load_factor=1.0, window=4)
    assert keys.key_for("k") == "k"
    for replica in ["r0", "r1", "r0", "r0"]:  # k's home r0 holds 3 of the last 4
        keys.observe("k", replica)
    # capacity ceil(1.0 x 5 / 2) = 3: r0 is full, so a first salt is tried
    assert keys.key_for("k") == "k#1"
    keys.observe("k#1", "r0")  # the salt hashed to r0 too: window r1 r0 r0 r0
    assert keys.key_for("k") == "k#2"
    keys.observe("k#2", "r1")  # window r0 r0 r0 r1
    assert keys.key_for("k") == "k#2"  # the salt known to land on the less-loaded replica
    keys.observe("other", "r1")
    keys.observe("other", "r1")  # window r0 r1 r1 r1: r0 has room again
    assert keys.key_for("k") == "k"
    with pytest.raises(ValueError, match="load_factor"):
        AffinityKeys(load_factor=0.5)


class FakeReplicas:
    """A stand-in server: `/v1/rag/config`, and `/v1/rag/query` answered by the replica
    `pick(headers)` names (in `X-RAGCache-Replica`); records each query's headers."""

    def __init__(self, pick: Callable[[dict[str, str]], str]) -> None:
        self.seen: list[dict[str, str]] = []
        self.app = FastAPI()
        config = config_to_json(CacheConfig(dtype="float32"))
        result = result_to_json(
            QueryResult("ok", (1,), (), 0.01, 0.0, 0.0, CacheHits(), 1, "length")
        )

        @self.app.get("/v1/rag/config")
        async def rag_config() -> dict[str, Any]:
            return {
                "model": "m",
                "has_index": True,
                "admin_key": False,
                "config": config,
                "replicas": 2,
            }

        @self.app.post("/v1/rag/query")
        async def query(request: Request) -> JSONResponse:
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.seen.append(headers)
            return JSONResponse(result, headers={"X-RAGCache-Replica": pick(headers)})


@pytest.fixture
def fake_url() -> Iterator[Callable[[FakeReplicas], str]]:
    with contextlib.ExitStack() as servers:

        def start(fake: FakeReplicas) -> str:
            sock = servers.enter_context(held_socket())
            return servers.enter_context(serve_in_thread(fake.app, sock))

        yield start


def test_the_client_sends_the_first_documents_key_and_none_without_documents(
    fake_url: Callable[[FakeReplicas], str],
) -> None:
    fake = FakeReplicas(lambda h: "r0")
    docs = [Document("d1", "one"), Document("d2", "two")]
    with RAGCacheClient(fake_url(fake)) as client:
        client.generate("q", docs)
        client.generate("q2", docs[:1])
        client.query("server-side search")
    with RAGCacheClient(fake_url(fake), affinity=False) as plain:
        plain.generate("q", docs)
    keys = [h.get("x-session-id") for h in fake.seen]
    assert keys == [affinity_key(docs), affinity_key(docs), None, None]


def test_a_hot_document_is_spread_past_the_bound(fake_url: Callable[[FakeReplicas], str]) -> None:
    """The stand-in routes as consistent_hash would: the same key, the same replica (here: a
    salted key on r1, the plain one on r0). 60% of the requests share one document."""
    fake = FakeReplicas(lambda h: "r1" if "#" in h.get("x-session-id", "") else "r0")
    hot, cold = Document("hot", "h"), [Document(f"c{i}", "c") for i in range(4)]
    with RAGCacheClient(fake_url(fake), load_factor=1.25) as client:
        for i in range(50):
            client.generate("q", [hot] if i % 5 < 3 else [cold[i % 4]])
    replicas = ["r1" if "#" in h.get("x-session-id", "") else "r0" for h in fake.seen]
    assert replicas.count("r0") <= 0.7 * len(replicas)  # unbounded: 100% on r0
    with RAGCacheClient(fake_url(fake), load_factor=100.0) as loose:
        before = len(fake.seen)
        for _ in range(20):
            loose.generate("q", [hot])
    assert all("#" not in h["x-session-id"] for h in fake.seen[before:])


# ---------------------------------------------------------------------- the fan-out


class CountingCache:
    """A stand-in cache: counts invalidations per document (all the fan-out needs)."""

    engine_state = "running"

    def __init__(self, holds: dict[str, int]) -> None:
        self.config = CacheConfig(dtype="float32", max_num_seqs=1)
        self.metrics = Metrics()
        self.holds = dict(holds)
        self.invalidated: list[str] = []

    def invalidate(self, doc_id: str) -> int:
        self.invalidated.append(doc_id)
        return self.holds.pop(doc_id, 0)

    def stats(self) -> dict[str, Any]:
        return {}

    def check_integrity(self) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass
class Trio:
    urls: list[str]
    caches: list[CountingCache]
    dead: str


@pytest.fixture(scope="module")
def trio(tiny_model: Path) -> Iterator[Trio]:
    """r0 with peers r1 and r2, r1 with peer r0, r2 with a peer nobody listens on; every
    server with an API key and an admin key (started at once: each loads the tokenizer)."""
    from transformers import AutoTokenizer  # imported once here: lazy imports race in threads

    assert AutoTokenizer is not None
    with contextlib.ExitStack() as stack:
        # Four held ports: three servers and a "dead" peer, bound and never listening.
        socks = [stack.enter_context(held_socket()) for _ in range(4)]
        ports = [sock.getsockname()[1] for sock in socks]
        urls = [f"http://127.0.0.1:{p}" for p in ports[:3]]
        dead = f"http://127.0.0.1:{ports[3]}"
        peers = [(urls[1], urls[2]), (urls[0],), (dead,)]
        caches = [CountingCache({}) for _ in range(3)]
        apps = [
            create_app(
                ServeSettings(
                    model=str(tiny_model),
                    port=ports[i],
                    api_key="k",
                    admin_key="adm",
                    replica_id=f"r{i}",
                    peers=peers[i],
                ),
                cache_factory=lambda s, c=caches[i]: c,
            )
            for i in range(3)
        ]
        with ThreadPoolExecutor(3) as pool:
            servers = [serve_in_thread(app, sock) for app, sock in zip(apps, socks, strict=False)]
            list(pool.map(stack.enter_context, servers))  # started at once
        yield Trio(urls, caches, dead)


def test_an_invalidation_reaches_every_peer_and_names_the_one_it_could_not(trio: Trio) -> None:
    urls, caches = trio.urls, trio.caches
    for cache, held in zip(caches, (2, 3, 0), strict=True):
        cache.holds, cache.invalidated = ({"d": held} if held else {}), []
    answer = httpx.post(f"{urls[0]}/v1/cache/invalidate", json={"doc_id": "d"}, headers=ADMIN)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-ragcache-replica"] == "r0"
    body = answer.json()
    assert body["removed"] == 5 and body["replicas"] == {"r0": 2, urls[1]: 3, urls[2]: 0}
    assert [c.invalidated for c in caches] == [["d"], ["d"], ["d"]]  # /local: no second fan-out
    # The API key cannot invalidate (the admin key can), on either route.
    user = {"Authorization": "Bearer k"}
    for path in ("/v1/cache/invalidate", "/v1/cache/invalidate/local"):
        assert httpx.post(urls[1] + path, json={"doc_id": "d"}, headers=user).status_code == 403


def test_an_unreachable_peer_is_a_502_that_lists_what_was_done(trio: Trio) -> None:
    cache = trio.caches[2]
    cache.holds, cache.invalidated = {"e": 1}, []
    answer = httpx.post(f"{trio.urls[2]}/v1/cache/invalidate", json={"doc_id": "e"}, headers=ADMIN)
    assert answer.status_code == 502
    body = answer.json()
    dead = trio.dead
    assert "retry the invalidation" in body["error"]["message"] and dead in body["error"]["message"]
    assert body["replicas"]["r2"] == 1 and body["replicas"][dead].startswith("error: unreachable")
    assert cache.invalidated == ["e"]  # done here all the same (idempotent: the retry is safe)


def test_peers_must_be_urls() -> None:
    with pytest.raises(ConfigError, match=r"peer '127\.0\.0\.1:8001' must be an http"):
        ServeSettings(model="m", peers=("127.0.0.1:8001",))


# ---------------------------------------------------------------------- ragcache replicas


def test_replicas_commands_name_their_peers_and_the_router_flags(tmp_path: Path) -> None:
    from ragcache_core.cli.replicas import Layout, router_command, serve_command

    layout = Layout("127.0.0.1", 8000, (8001, 8002, 8003))
    cmd = serve_command(layout, 1, tmp_path, "key", ["--host-pool-tokens", "64"])
    i = cmd.index("--peers")
    assert cmd[i + 1 : i + 3] == ["http://127.0.0.1:8001", "http://127.0.0.1:8003"]
    assert cmd[cmd.index("--port") + 1] == "8002" and cmd[cmd.index("--replica-id") + 1] == "r1"
    assert cmd[-2:] == ["--host-pool-tokens", "64"] and "key" in cmd
    router = router_command("/bin/vllm-router", layout, "consistent_hash", 29000, None)
    j = router.index("--worker-urls")
    assert router[j + 1 : j + 4] == list(layout.replica_urls)
    assert "--disable-retries" in router and "--api-key" not in router


def test_replicas_refuses_what_it_sets_and_names_the_missing_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ragcache_core.cli import main

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("RAGCACHE_VLLM_ROUTER", raising=False)
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    assert main(["replicas", "--model", str(tmp_path), "--", "--port", "9"]) == 2
    assert "--port is set by ragcache replicas" in capsys.readouterr().err
    assert main(["replicas", "--model", str(tmp_path)]) == 2
    assert "vllm-router not found" in capsys.readouterr().err
