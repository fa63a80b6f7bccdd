"""`ragcache serve` under real SIGKILLs (tiny model, real vLLM engine, 127.0.0.1): a crash
leaves nothing behind, and an engine that dies is reported and replaced.

Two short-lived servers, in this order (the module's tests depend on it):

1. Server A is killed with its whole process group (server, watchdog, engine: what the OOM
   killer or a container kill does), so nothing of it can clean up: its host pool, vLLM's
   shared-memory segments and its engine lock stay in /dev/shm.
2. Server B starts: it reclaims A's leftovers and says so in one line. Then its engine core
   is killed mid-request (/health must say 503 until the new engine runs; whole requests,
   cached and uncached, are retried; every failure is counted), then B itself is killed
   alone (its watchdog must take the engine down and remove what B left).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from _integration_helpers import corpus
from _serve_helpers import ServerProcess, sse_data, started

from ragcache_core.serve.watchdog import lock_path
from ragcache_core.storage.host_pool import shm_folder

pytestmark = pytest.mark.vllm

KEY = "crash-key"
ARGS = ["--host-pool-tokens", "2048", "--max-num-seqs", "4"]
LONG = 1500
"""Tokens of the answers in flight when the engine is killed (long enough to be killed)."""
DOCS = corpus(4)
GONE_TIMEOUT_S = 60.0


def _tree(pid: int, *, helpers: bool = True) -> list[psutil.Process]:
    """The server's descendants but its watchdog: the engine core, its workers and (with
    `helpers`) multiprocessing's resource tracker, which lives as long as the server."""
    skip = ["ragcache_core.serve.watchdog"] + ([] if helpers else ["resource_tracker"])
    processes = psutil.Process(pid).children(recursive=True)
    return [p for p in processes if not any(s in " ".join(_cmd(p)) for s in skip)]


def _cmd(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def _mapped_shm(processes: list[psutil.Process]) -> set[Path]:
    """The shared-memory files these processes map (host pool, vLLM segments)."""
    folder = str(shm_folder())
    found = set()
    for process in processes:
        for line in Path(f"/proc/{process.pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            path = parts[5] if len(parts) == 6 else ""
            if path.startswith(folder + "/") and not path.endswith(" (deleted)"):
                found.add(Path(path))
    return found


def _all_gone(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `processes` still running after GONE_TIMEOUT_S."""
    _, alive = psutil.wait_procs(processes, timeout=GONE_TIMEOUT_S)
    return [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def crashed(tiny_model: Path, engine_pool: Any, tmp_path_factory: Any) -> dict[str, Any]:
    """Server A, killed with its process group; what it left behind."""
    engine_pool.close()  # one engine at a time
    log = tmp_path_factory.mktemp("crash-a") / "server.log"
    a = ServerProcess(tiny_model, ARGS, log, api_key=KEY, new_session=True)
    try:
        a.wait_ready()
        processes = _tree(a.pid)
        left = _mapped_shm([psutil.Process(a.pid), *processes])
        pools = [p for p in left if p.name.startswith(f"ragcache-{a.pid}-")]
        assert pools, f"server A maps no host pool: {left}"
        left |= {p.with_name(p.name + ".json") for p in pools}
        left.add(lock_path(a.port))
        os.killpg(a.pid, signal.SIGKILL)
        a.process.wait(30)
        assert not _all_gone(processes)
    finally:
        a.stop()
    missing = sorted(p for p in left if not p.exists())
    assert not missing, f"a killed server's files vanished without a reclaim: {missing}"
    return {"pid": a.pid, "left": sorted(left)}


@pytest.fixture(scope="module")
def server(
    crashed: dict[str, Any], tiny_model: Path, tmp_path_factory: Any
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("crash-b") / "server.log"
    yield from started(tiny_model, ARGS, log, api_key=KEY)


def test_the_next_server_reclaims_what_a_killed_one_left(
    crashed: dict[str, Any], server: ServerProcess
) -> None:
    still = [p for p in crashed["left"] if p.exists()]
    assert not still, f"not reclaimed: {still}"
    lines = [line for line in server.tail(400).splitlines() if "reclaimed what crashed" in line]
    assert len(lines) == 1, server.tail()
    assert str(crashed["pid"]) in lines[0] and "stale engine lock" in lines[0], lines[0]


def test_an_engine_killed_mid_request_is_reported_and_its_requests_retried(
    server: ServerProcess,
) -> None:
    """/health answers 503 from the engine's death until the new engine runs; the whole
    requests in flight (cached and uncached) were shown nothing, so they are retried and
    answered in full; the streamed one had shown text, so it ends with an error; all three
    failures are counted."""
    before = server.stats()
    engine = _tree(server.pid, helpers=False)
    cores = [p for p in engine if "EngineCore" in " ".join(_cmd(p))]
    assert len(cores) == 1, [_cmd(p) for p in engine]
    outcomes: dict[str, Any] = {}
    streaming = threading.Event()
    common = {"max_tokens": LONG, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    cached = {
        "messages": [{"role": "user", "content": "What is this about?"}],
        "documents": [{"id": d.id, "text": d.text} for d in DOCS[:2]],
        **common,
    }
    uncached = {"prompt": "Once upon a time", **common}

    def whole(name: str, route: str, body: dict[str, Any]) -> None:
        with server.client(timeout=600) as http:
            outcomes[name] = http.post(route, json=body)

    def stream() -> None:
        body = {**cached, "documents": [{"id": d.id, "text": d.text} for d in DOCS[2:]]}
        body["stream"] = True
        events = []
        with (
            server.client(timeout=600) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as response,
        ):
            for item in sse_data(response.iter_lines()):
                events.append(item)
                if item.get("choices") and item["choices"][0]["delta"].get("content"):
                    streaming.set()
        outcomes["stream"] = events

    threads = [
        threading.Thread(target=whole, args=("cached", "/v1/chat/completions", cached)),
        threading.Thread(target=whole, args=("uncached", "/v1/completions", uncached)),
        threading.Thread(target=stream),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while not (streaming.is_set() and server.stats()["engine_requests"] == 3):
        assert time.monotonic() < deadline, "the three requests never ran together"
        time.sleep(0.05)
    cores[0].send_signal(signal.SIGKILL)
    health = _health_until_recovered(server)
    for thread in threads:
        thread.join(600)

    assert {"engine_dead", "engine_restarting"} & set(health), health
    for name in ("cached", "uncached"):
        response = outcomes[name]
        assert response.status_code == 200, (name, response.text)
        assert len(response.json()["choices"][0]["token_ids"]) == LONG, name
    last = outcomes["stream"][-1]
    assert "error" in last and "streamed text already" in last["error"]["message"], last
    after = server.stats()
    assert after["requests_failed"] == before["requests_failed"] + 3  # uncached one included
    assert after["retries"] == before["retries"] + 2
    assert after["engine_restarts"] == before["engine_restarts"] + 1
    assert not _all_gone(engine)  # the dead engine's worker went with its core


def _health_until_recovered(server: ServerProcess) -> list[str]:
    """The statuses /health gives from now until it is 200 again after a 503."""
    seen: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        response = httpx.get(f"{server.url}/health", timeout=10)
        seen.append(response.json()["status"])
        if response.status_code == 200 and len(set(seen)) > 1:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"/health did not recover: {seen[-5:]}")


def test_a_server_killed_alone_takes_its_engine_with_it(server: ServerProcess) -> None:
    """SIGKILL of the server process only: its watchdog stops the engine processes and
    removes the host pool and the lock the server left."""
    engine = _tree(server.pid)
    assert any("EngineCore" in " ".join(_cmd(p)) for p in engine)
    pools = sorted(shm_folder().glob(f"ragcache-{server.pid}-*"))
    assert pools and lock_path(server.port).exists()
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(30)
    alive = _all_gone(engine)
    assert not alive, f"outlived the server: {[_cmd(p) for p in alive]}"
    deadline = time.monotonic() + 30
    while any(p.exists() for p in pools) or lock_path(server.port).exists():
        assert time.monotonic() < deadline, "the watchdog did not remove the server's files"
        time.sleep(0.2)
    assert "ragcache serve watchdog: stopped" in server.tail()
