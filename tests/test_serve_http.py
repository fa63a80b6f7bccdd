"""`ragcache serve`'s HTTP and process behaviour without an engine: 429 with Retry-After past the
queue, 503 while draining, one engine owner per port, crash hygiene (what a killed server
left is reclaimed), the keys' roles and the bounds on headers and bodies.

The HTTP tests run the real app under real uvicorn on 127.0.0.1, over `HeldCache`: a stand-in
cache whose answers wait until the test releases them, so that requests are provably in
flight (a mock isolating the queue from the engine; it is not what is under test).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve_helpers import REPO, held_socket, serve_in_thread
from fastapi.testclient import TestClient

from ragcache_core.cli.replicas import hold_ports
from ragcache_core.config import (
    CacheConfig,
    SamplingConfig,
)
from ragcache_core.errors import ConfigError
from ragcache_core.metrics import Metrics
from ragcache_core.query_result import CacheHits, QueryResult, StreamChunk
from ragcache_core.serve.app import create_app, sole_owner
from ragcache_core.serve.auth import read_key_file
from ragcache_core.serve.listen import adopt_socket, bind_socket
from ragcache_core.serve.state import ServeSettings
from ragcache_core.storage.host_pool import shm_folder

DOCUMENTS = [{"id": "a", "text": "Paris is in France.", "title": "Paris"}]


# ---------------------------------------------------------------------- HTTP over HeldCache


class HeldCache:
    """Answers every request with a fixed result once `release` is set (see the module
    docstring). Counts what it was asked."""

    def __init__(self, model: Path) -> None:
        self.config = CacheConfig(dtype="float32", max_num_seqs=1)
        self.model = str(model)
        self.metrics = Metrics()
        self.release = threading.Event()
        self.started = 0
        self.closed = False
        self.calls: list[dict[str, Any]] = []

    async def _answer(self) -> AsyncIterator[StreamChunk]:
        self.started += 1
        await asyncio.to_thread(self.release.wait, 60)
        hits = CacheHits(computed_docs=1)
        result = QueryResult("ok", (1,), (), 0.01, 0.0, 0.0, hits, 10, "length")
        yield StreamChunk("ok")
        yield StreamChunk("", result)

    engine_state = "running"

    def astream(self, question: str, **kwargs: Any) -> AsyncIterator[StreamChunk]:
        self.calls.append(kwargs)
        return self._answer()

    def astream_uncached(self, prompt_ids: Sequence[int], **kwargs: Any) -> Any:
        return self._answer()

    async def _whole(self) -> QueryResult:
        async for chunk in self._answer():
            if chunk.result is not None:
                return chunk.result
        raise AssertionError("no result")

    async def aquery(self, question: str, **kwargs: Any) -> QueryResult:
        self.calls.append(kwargs)
        return await self._whole()

    async def agenerate(self, question: str, documents: Any, **kwargs: Any) -> QueryResult:
        self.calls.append(kwargs)
        return await self._whole()

    async def agenerate_uncached(self, prompt_ids: Sequence[int], **kwargs: Any) -> QueryResult:
        return await self._whole()

    def query(self, question: str, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server calls the async API only")

    def generate(self, question: str, documents: Any, **kwargs: Any) -> QueryResult:
        raise NotImplementedError("the server calls the async API only")

    def stream(self, question: str, **kwargs: Any) -> Any:
        raise NotImplementedError("the server calls the async API only")

    def stats(self) -> dict[str, Any]:
        return {"requests": self.started}

    def invalidate(self, doc_id: str) -> int:
        return 0

    def check_integrity(self) -> None:
        return None

    def check_sampling(self, sampling: SamplingConfig) -> None:
        return None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def held_server(tiny_model: Path) -> Iterator[tuple[str, HeldCache, Any]]:
    """The real app (capacity 1 running + 1 waiting) under real uvicorn, in a thread."""
    cache = HeldCache(tiny_model)
    with held_socket() as sock:
        port = sock.getsockname()[1]
        settings = ServeSettings(model=str(tiny_model), port=port, max_waiting=1, api_key="k")
        app = create_app(settings, cache_factory=lambda s: cache)
        with serve_in_thread(app, sock) as url:
            try:
                yield url, cache, app
            finally:
                cache.release.set()
    assert cache.closed  # the lifespan closed the cache


def _post(url: str) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": "Bearer k"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_past_the_queue_a_request_gets_429_with_retry_after(
    held_server: tuple[str, HeldCache, Any],
) -> None:
    url, cache, _ = held_server
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(_post, url) for _ in range(2)]
        deadline = time.monotonic() + 30
        while cache.started < 2:  # both are in flight (one "running", one waiting)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = _post(url)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert cache.started == 2  # the refused request never reached the cache
        cache.release.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert _post(url).status_code == 200  # room again
    metrics = httpx.get(f"{url}/metrics").text
    assert 'ragcache_serve_requests_total{route="/v1/completions",status="429"} 1.0' in metrics


def test_while_draining_requests_get_503_and_health_says_so(
    held_server: tuple[str, HeldCache, Any],
) -> None:
    url, cache, app = held_server
    app.state.serve.queue.close()  # what the runner does on SIGTERM
    refused = _post(url)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 503
    assert cache.started == 0


# ---------------------------------------------------------------------- one engine owner


def test_one_process_owns_a_port() -> None:
    with held_socket() as sock:  # (held: no server can take the port meanwhile)
        _one_owner(sock.getsockname()[1])


def _one_owner(port: int) -> None:
    refused = pytest.raises(ConfigError, match="one process owns the engine")
    with sole_owner("127.0.0.1", port), refused, sole_owner("127.0.0.1", port):
        pass
    with sole_owner("127.0.0.1", port), refused, sole_owner("0.0.0.0", port):
        pass  # another address, the same port: it could not bind either
    with sole_owner("127.0.0.1", port):  # released when the owner ended
        pass
    assert not list(shm_folder().glob(f"ragcache-serve-port-{port}.lock"))  # removed


def test_the_cli_refuses_more_than_one_worker(tiny_model: Path) -> None:
    command = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(tiny_model)]
    done = subprocess.run(
        [*command, "--workers", "2"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "one server process owns the engine" in done.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "ragcache_core", "serve", "--model", "/nonexistent"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_a_taken_port_is_one_line_that_names_it() -> None:
    """The bind comes first (serve/listen.py), so a taken port is refused before any engine,
    for `ragcache serve` and for each port `ragcache replicas` needs, with nothing left bound."""
    with held_socket() as sock:
        port = sock.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"cannot bind --port {port} on 127.0.0.1: another"):
            bind_socket("127.0.0.1", port)
        for ports in ((port, 0, 0), (0, port, 0), (0, 0, port)):
            with pytest.raises(ConfigError, match=f" {port} on 127.0.0.1: another program"):
                hold_ports("127.0.0.1", ports[0], ports[1], 2, ports[2])
    with pytest.raises(ConfigError, match="not an address of this machine"):
        bind_socket("192.0.2.123", 0)  # (TEST-NET-1: never this machine's; nothing is sent)
    with pytest.raises(ConfigError, match="--port 70000: a port is 0-65535"):
        bind_socket("127.0.0.1", 70000)
    with pytest.raises(ConfigError, match="port 8001 is asked for twice"):
        hold_ports("127.0.0.1", 8001, 8001, 2, 0)  # (refused before anything is bound)
    held = hold_ports("127.0.0.1", 0, 0, 2, 0)  # all free: distinct ports, all held
    try:
        ports = [held.layout.port, held.prometheus_port, *held.layout.replica_ports]
        assert len(set(ports)) == 4 and 0 not in ports
        for taken in ports:
            with pytest.raises(ConfigError, match=f"cannot bind --port {taken} "):
                bind_socket("127.0.0.1", taken)
        held.release_router()  # the router binds its two itself
        bind_socket("127.0.0.1", held.layout.port).close()
    finally:
        held.close()


def test_serve_adopts_an_inherited_socket_or_says_what_the_fd_is() -> None:
    with held_socket() as sock:
        adopted = adopt_socket(os.dup(sock.fileno()))
        assert adopted.getsockname() == sock.getsockname() and not adopted.get_inheritable()
        adopted.close()
    with pytest.raises(ConfigError, match="--fd 987: not an open socket"):
        adopt_socket(987)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(ConfigError, match=f"--fd {read_end}: not an open socket"):
            adopt_socket(read_end)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_the_cli_refuses_a_taken_port_before_the_engine(tiny_model: Path) -> None:
    command = [sys.executable, "-m", "ragcache_core", "serve", "--model", str(tiny_model)]
    with held_socket() as sock:
        port = sock.getsockname()[1]
        done = subprocess.run(
            [*command, "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"ragcache serve: error: cannot bind --port {port} on 127.0.0.1: another program holds "
        "it ([Errno 98]); choose another --port, or 0 for any free port"
    ]
    assert "vllm" not in done.stdout.lower()  # no engine was started


# ---------------------------------------------------------------------- crash hygiene


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(done.stdout)


def test_reclaim_removes_what_processes_that_are_gone_left(tmp_path: Path) -> None:
    from ragcache_core.storage.reclaim import reclaim_shared_memory

    dead, alive = _dead_pid(), os.getpid()
    orphan = [tmp_path / f"ragcache-{dead}-0123abcd", tmp_path / f"ragcache-{dead}-0123abcd.json"]
    kept = [tmp_path / f"ragcache-{alive}-89abcdef", tmp_path / "ragcache-named-pool"]
    unused, used = tmp_path / "psm_0badf00d", tmp_path / "psm_c0ffee00"
    for path in [*orphan, *kept, unused, used]:
        path.write_bytes(b"x" * 1000)
    with used.open("rb"):  # open in this process: in use
        reclaimed = reclaim_shared_memory(tmp_path)
    assert sorted(reclaimed.pools) == sorted(orphan) and reclaimed.segments == (unused,)
    assert reclaimed.nbytes == 3000
    assert all(p.exists() for p in [*kept, used]) and not any(p.exists() for p in orphan)
    import mmap

    with used.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    try:  # mapped, no fd open: still in use
        assert not reclaim_shared_memory(tmp_path) and used.exists()
    finally:
        mapped.close()
    assert reclaim_shared_memory(tmp_path).segments == (used,)  # now no one uses it


def test_reclaim_locks_removes_only_locks_nobody_holds(tmp_path: Path) -> None:
    import fcntl

    from ragcache_core.serve.watchdog import lock_path, reclaim_locks

    stale, held = lock_path(1, tmp_path), lock_path(2, tmp_path)
    stale.write_text(str(_dead_pid()))
    fd = os.open(held, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert reclaim_locks(tmp_path) == [stale]
        assert held.exists() and not stale.exists()
    finally:
        os.close(fd)


_FAKE_SERVER = """
import os, subprocess, sys, time
from ragcache_core.serve.watchdog import Watchdog
Watchdog.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
pool = "/dev/shm/ragcache-%d-0123abcd" % os.getpid()
open(pool, "w").write("x")
open(pool + ".json", "w").write("{}")
print(child.pid, pool, flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the watchdog needs /proc")
def test_the_watchdog_stops_a_killed_servers_children_and_removes_its_pool() -> None:
    """A stand-in server (a process with a child, its watchdog and a host pool file) is
    killed with SIGKILL: its watchdog kills the child and removes the pool."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    fake = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None and fake.stderr is not None
    pid, pool = fake.stdout.readline().split()
    child = psutil.Process(int(pid))
    time.sleep(1.5)  # the watchdog notes the server's descendants every 0.5 s
    fake.kill()
    fake.wait(10)
    _, alive = psutil.wait_procs([child], timeout=20)
    assert not alive, "the child outlived the killed server"
    assert not Path(pool).exists() and not Path(pool + ".json").exists()
    assert "ragcache serve watchdog: stopped 1 engine process(es)" in fake.stderr.read()


# ---------------------------------------------------------------------- roles and limits


def test_the_keys_guard_the_routes_by_role() -> None:
    from ragcache_core.serve.auth import ApiKey, KeyMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    both = KeyMiddleware(app, keys=(ApiKey("k", "default"),), admin_key="a")
    assert both.needs("/v1/cache/invalidate") == "admin" == both.needs("/v1/cache/integrity")
    assert both.needs("/v1/chat/completions") == "user" == both.needs("/openapi.json")
    assert both.needs("/health") is None and both.needs("/metrics") is None
    only_api = KeyMiddleware(app, keys=(ApiKey("k", "default"),), admin_key=None)
    assert only_api.needs("/v1/cache/invalidate") == "user"  # the documented default
    only_admin = KeyMiddleware(app, admin_key="a")
    assert only_admin.needs("/v1/chat/completions") is None
    assert only_admin.needs("/v1/cache/invalidate") == "admin" == only_admin.needs("/docs")
    with pytest.raises(ConfigError, match="differ"):
        ServeSettings(model="m", api_key="same", admin_key="same")
    assert ServeSettings(model="m").max_body_bytes == 8 * 2**20  # docs/deploy.md's default


@pytest.fixture(params=["httptools", "h11"])
def guarded_server(
    request: pytest.FixtureRequest, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, HeldCache]]:
    """The real app under real uvicorn with the server's guarded HTTP protocol (both of
    uvicorn's HTTP/1.1 implementations), a 1 s header timeout and a 1 KiB body limit."""
    from ragcache_core.serve.limits import guarded_protocol

    if request.param == "h11":  # as where httptools is not installed
        import uvicorn.protocols.http.httptools_impl as impl

        monkeypatch.delattr(impl, "HttpToolsProtocol")
    protocol = guarded_protocol(1.0)
    assert request.param.replace("httptools", "HttpTools").lower() in protocol.__name__.lower()
    cache = HeldCache(tiny_model)
    cache.release.set()
    with held_socket() as sock:
        settings = ServeSettings(
            model=str(tiny_model),
            port=sock.getsockname()[1],
            max_body_bytes=1024,
            read_timeout_s=1.0,
        )
        app = create_app(settings, cache_factory=lambda s: cache)
        with serve_in_thread(app, sock, http=protocol) as url:
            yield url, cache


def test_headers_and_bodies_are_bounded_in_size_and_time(
    guarded_server: tuple[str, HeldCache],
) -> None:
    import socket

    url, _ = guarded_server
    port = int(url.rsplit(":", 1)[1])
    partial = socket.create_connection(("127.0.0.1", port), timeout=20)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
    huge = socket.create_connection(("127.0.0.1", port), timeout=20)
    huge.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"x" * 70_000)
    slow = socket.create_connection(("127.0.0.1", port), timeout=20)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    # (h11 refuses large headers itself, with 400, before the guard's 431. A server that closes
    # with the 70 kB still unread makes the kernel send a reset, which may reach this socket
    # before the answer is read and discard it: refused too, not served.)
    refused = [(partial, [b"408"]), (huge, [b"431", b"400", b"reset"]), (slow, [b"408"])]
    for sock, statuses in refused:
        with sock:
            answer = b""
            try:
                while chunk := sock.recv(4096):  # until the server closes the connection
                    answer += chunk
            except ConnectionResetError:
                answer = answer or b"reset"
            status = b"reset" if answer == b"reset" else answer[9:12]
            assert status in statuses, answer[:200]
    body = {"prompt": "x" * 2000, "max_tokens": 2}
    too_big = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
    assert too_big.status_code == 413 and "1024 bytes" in too_big.json()["error"]["message"]
    with httpx.Client(base_url=url, timeout=10) as http:  # keep-alive: the next requests
        for _ in range(3):
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
            time.sleep(0.6)  # idle between requests is not a header timeout
        assert http.get("/health").status_code == 200


def test_health_is_503_while_the_engine_is_not_running(
    held_server: tuple[str, HeldCache, Any],
) -> None:
    url, cache, _ = held_server
    for state in ("dead", "restarting"):
        cache.engine_state = state
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503 and response.json() == {"status": f"engine_{state}"}
    cache.engine_state = "running"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_key_file_format(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# key tenant\nsk-a1 team-a\n\nsk-a2 team-a\nsk-b team-b\nsk-lone\n")
    keys = read_key_file(path)
    assert [k.tenant for k in keys[:3]] == ["team-a", "team-a", "team-b"]
    assert keys[3].tenant.startswith("key-") and "sk-lone" not in repr(keys[3])
    for bad, match in (("sk-a x y\n", "fields"), ("sk-a\nsk-a\n", "twice"), ("# none\n", "no key")):
        path.write_text(bad)
        with pytest.raises(ConfigError, match=match):
            read_key_file(path)
    with pytest.raises(ConfigError, match="needs API keys"):
        ServeSettings(model="m", salt_per_key=True)


def test_salt_per_key_salts_every_request_with_its_tenant(tiny_model: Path, tmp_path: Path) -> None:
    """Through the real app: the key a request presents decides its tenant, and with
    --salt-per-key the tenant is the request's cache salt (its own salt then separates within
    the tenant); an unknown key is 401."""
    path = tmp_path / "keys"
    path.write_text("sk-a team-a\nsk-b team-b\n")
    cache = HeldCache(tiny_model)
    cache.release.set()
    settings = ServeSettings(
        model=str(tiny_model), port=0, api_keys=read_key_file(path), salt_per_key=True
    )
    app = create_app(settings, cache_factory=lambda s: cache)
    body = {"messages": [{"role": "user", "content": "Where?"}], "documents": DOCUMENTS}
    with TestClient(app) as client:
        for key, extra, salt in (
            ("sk-a", {}, "tenant:team-a"),
            ("sk-b", {}, "tenant:team-b"),
            ("sk-a", {"cache_salt": "x"}, "tenant:team-a\0x"),
        ):
            answer = client.post(
                "/v1/chat/completions",
                json={**body, **extra},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert answer.status_code == 200, answer.text
            assert cache.calls[-1]["cache_salt"] == salt
        refused = client.post(
            "/v1/chat/completions", json=body, headers={"Authorization": "Bearer no"}
        )
        assert refused.status_code == 401
