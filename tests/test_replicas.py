"""Two real `ragcache serve` replicas (tiny model) behind the real vllm-router, started by
`ragcache replicas` (consistent_hash on X-Session-Id): a first document's requests land on
one replica and hit there; an invalidation sent through the router misses on every replica
afterwards; a killed replica is routed around while the survivor keeps its hits.

Needs the `vllm-router` binary (`pip install vllm-router==0.1.17`, the `replicas` extra; or
`$RAGCACHE_VLLM_ROUTER`): skipped without it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _serve_helpers import REPO

from ragcache_core.cli.replicas import find_router
from ragcache_core.client.affinity import affinity_key
from ragcache_core.documents import Document
from ragcache_core.errors import CliError

pytestmark = pytest.mark.vllm

SERVE_ARGS = ["--host-pool-tokens", "8192", "--max-tokens", "4"]
READY = re.compile(r"r(\d) (http://\S+) \(pid (\d+)\)")
ROUTER = re.compile(r"^ready: router (http://\S+) ")


@dataclass
class Cluster:
    router: str
    replicas: dict[str, str]  # replica id -> URL
    pids: dict[str, int]
    process: subprocess.Popen[str]
    log_dir: Path


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    try:
        router = find_router(None)
    except CliError as exc:
        pytest.skip(str(exc))
    log_dir = tmp_path_factory.mktemp("replicas")
    cmd = [sys.executable, "-m", "ragcache_core", "replicas", "--model", str(tiny_model)]
    # Every port 0: `ragcache replicas` binds them and holds them (no port picked here and
    # released); the "ready:" line names them.
    cmd += ["--replicas", "2", "--port", "0", "--base-port", "0", "--prometheus-port", "0"]
    cmd += ["--router", router, "--log-dir", str(log_dir)]
    cmd += ["--stop-timeout", "30", "--", *SERVE_ARGS]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env.pop("RAGCACHE_API_KEY", None)
    process = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        ready = _read_ready(process, log_dir)
        found = READY.findall(ready)
        router_url = ROUTER.match(ready)
        assert router_url is not None, ready
        yield Cluster(
            router=router_url.group(1),
            replicas={f"r{i}": url for i, url, _ in found},
            pids={f"r{i}": int(pid) for i, _, pid in found},
            process=process,
            log_dir=log_dir,
        )
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()


def _read_ready(process: subprocess.Popen[str], log_dir: Path) -> str:
    assert process.stdout is not None
    lines = []
    deadline = time.monotonic() + 400
    for line in process.stdout:
        lines.append(line)
        if line.startswith("ready:"):
            return line
        assert time.monotonic() < deadline, "ragcache replicas did not get ready"
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(log_dir.glob("*.log")))
    raise AssertionError(f"ragcache replicas exited ({process.wait()}):\n{''.join(lines)}\n{logs}")


def _ask(url: str, docs: list[Document], key: str | None = None) -> httpx.Response:
    body = {
        "question": "What is it?",
        "documents": [{"id": d.id, "text": d.text} for d in docs],
    }
    headers = {"X-Session-Id": key or affinity_key(docs) or ""}
    return httpx.post(f"{url}/v1/rag/query", json=body, headers=headers, timeout=120)


def _hit_docs(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    hits: dict[str, Any] = response.json()["cache_hits"]
    return int(hits["gpu_docs"]) + int(hits["host_docs"])


def _doc(name: str) -> Document:
    return Document(name, f"{name} is a document about the number {len(name)} and its uses.")


def test_one_first_document_lands_on_one_replica_and_hits_there(cluster: Cluster) -> None:
    docs = [_doc("affinity-a"), _doc("affinity-b")]
    answers = [_ask(cluster.router, docs) for _ in range(3)]
    replicas = {a.headers["x-ragcache-replica"] for a in answers}
    assert len(replicas) == 1, replicas
    assert [_hit_docs(a) for a in answers] == [0, 2, 2]
    # Another first document may land elsewhere, but always on one replica.
    others = {_ask(cluster.router, [_doc(f"other-{i}")]).headers["x-ragcache-replica"]
              for i in range(6)}  # fmt: skip
    assert others <= set(cluster.replicas)


def test_an_invalidation_through_the_router_misses_on_every_replica(cluster: Cluster) -> None:
    doc = _doc("to-invalidate")
    for url in cluster.replicas.values():  # cached on both, straight at each replica
        assert _hit_docs(_ask(url, [doc])) == 0
        assert _hit_docs(_ask(url, [doc])) == 1
    answer = httpx.post(
        f"{cluster.router}/v1/cache/invalidate", json={"doc_id": doc.id}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["removed"] >= 2 and len(answer.json()["replicas"]) == 2
    edited = Document(doc.id, "Changed: " + doc.text)  # at its start: no block of it matches
    for url in cluster.replicas.values():
        # The changed text is computed (nothing stale is served); the old text would still
        # hit vLLM's blocks, keyed by its token ids (exact), but never the tree's host copy.
        assert _hit_docs(_ask(url, [edited])) == 0
        hits = _ask(url, [doc]).json()["cache_hits"]
        assert hits["host_docs"] == 0


def test_a_killed_replica_is_routed_around_and_the_survivor_keeps_its_hits(
    cluster: Cluster,
) -> None:
    # Two keys, one on each replica (salted until both are found).
    homes: dict[str, tuple[str, list[Document]]] = {}
    for i in range(40):
        docs = [_doc(f"death-{i}")]
        replica = _ask(cluster.router, docs).headers["x-ragcache-replica"]
        homes.setdefault(replica, (affinity_key(docs) or "", docs))
        if len(homes) == 2:
            break
    assert len(homes) == 2
    victim, survivor = sorted(homes)
    assert _hit_docs(_ask(cluster.router, homes[survivor][1])) == 1
    os.kill(cluster.pids[victim], signal.SIGKILL)
    statuses, deadline, moved = [], time.monotonic() + 30, False
    while time.monotonic() < deadline:
        answer = _ask(cluster.router, homes[victim][1])
        statuses.append(answer.status_code)
        assert answer.status_code == 200 or answer.status_code >= 500, answer.text
        if answer.status_code == 200:
            assert answer.headers["x-ragcache-replica"] == survivor
            moved = True
            break
        time.sleep(0.5)
    assert moved, f"the router kept sending to the dead replica: {statuses}"
    assert _hit_docs(_ask(cluster.router, homes[survivor][1])) == 1  # its cache is intact
    # The router's health checks (every 2 s, two failures) mark it down after its circuit
    # breaker may already have moved the requests: poll, with a bound.
    healthy, deadline = None, time.monotonic() + 30
    while time.monotonic() < deadline:
        healthy = httpx.get(f"{cluster.router}/readiness", timeout=10).json()["healthy_workers"]
        if healthy == 1:
            break
        time.sleep(0.5)
    assert healthy == 1, f"the router still counts {healthy} healthy workers"
