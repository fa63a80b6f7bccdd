"""Two real `ragcache serve` replicas behind vllm-router: round_robin against document
affinity (consistent_hash on RAGCacheClient's X-Session-Id key, with its load bound), on
`bench serve`'s streams, then one replica killed mid-stream.

Setup: one pair of replicas (`ragcache replicas`' commands, `--peers` each other), two routers
in front of the same pair (round_robin and consistent_hash, each on its own port). Each run
starts cold: every document of the stream is invalidated first (through the fan-out). The
client searches locally (the workload's index, as `query(search=...)`), so it knows the
documents and their key before it sends; `--concurrency` requests in flight (closed loop).
Each replica's pools hold about half of the stream's working set (the distinct documents it
retrieves, in the model's tokens): GPU and host a quarter each. Runs alternate
(rr, affinity, affinity, rr, ...), `--repeats` each.

    RAGCACHE_VLLM_ROUTER=/path/to/vllm-router .venv/bin/python scripts/replica_bench.py \\
        --workload demo --requests 120 --out /tmp/ragcache-replica-bench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ragcache_core.bench.data_dir import DATA_HELP, script_data_dir
from ragcache_core.bench.workloads import index_source, load_workload, workload_files
from ragcache_core.cli.replicas import (
    Layout,
    find_router,
    hold_ports,
    router_command,
    spawn,
    start_replicas,
    stop,
    wait_for,
)
from ragcache_core.client.affinity import AffinityKeys, affinity_key
from ragcache_core.documents import Document
from ragcache_core.retrieval.trace import tokenizer_counter
from ragcache_core.search import SearchSource, final_result


def retrieved(questions: list[str], source: SearchSource, top_k: int) -> list[list[Document]]:
    return [list(final_result(source, q, top_k).documents) for q in questions]


async def one(
    http: httpx.AsyncClient,
    url: str,
    question: str,
    docs: list[Document],
    keys: AffinityKeys | None,
) -> dict[str, Any]:
    base = affinity_key(docs)
    sent = keys.key_for(base) if keys is not None and base is not None else base
    body = {
        "question": question,
        "documents": [{"id": d.id, "text": d.text, "metadata": dict(d.metadata)} for d in docs],
    }
    started = time.perf_counter()
    try:
        r = await http.post(
            f"{url}/v1/rag/query", json=body, headers={"X-Session-Id": sent or ""}, timeout=300
        )
    except httpx.HTTPError as exc:
        return {
            "status": 0,
            "error": type(exc).__name__,
            "latency_s": time.perf_counter() - started,
        }
    replica = r.headers.get("x-ragcache-replica")
    if keys is not None:
        keys.observe(sent, replica)
    out: dict[str, Any] = {"status": r.status_code, "replica": replica, "key": base}
    out["latency_s"] = time.perf_counter() - started
    if r.status_code == 200:
        data = r.json()
        hits = data["cache_hits"]
        out.update(
            ttft_s=data["ttft_s"],
            hit_docs=hits["gpu_docs"] + hits["host_docs"],
            docs=len(docs),
            cached_tokens=hits["cached_tokens"],
            computed_tokens=hits["computed_tokens"],
        )
    else:
        out["error"] = r.text[:200]
    return out


async def stream(
    url: str,
    questions: list[str],
    docs: list[list[Document]],
    concurrency: int,
    keys: AffinityKeys | None,
    on_index: Any = None,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in questions]
    next_i = 0

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal next_i
        while next_i < len(questions):
            i = next_i
            next_i += 1
            if on_index is not None:
                on_index(i)
            results[i] = await one(http, url, questions[i], docs[i], keys)

    async with httpx.AsyncClient() as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return results


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r.get("status") == 200]
    ttfts = sorted(r["ttft_s"] for r in ok)
    per: dict[str, int] = {}
    for r in ok:
        per[r["replica"]] = per.get(r["replica"], 0) + 1
    cached = sum(r["cached_tokens"] for r in ok)
    computed = sum(r["computed_tokens"] for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": [r.get("status") for r in results if r.get("status") != 200],
        "doc_hit_rate": sum(r["hit_docs"] for r in ok) / max(1, sum(r["docs"] for r in ok)),
        "token_hit_rate": cached / max(1, cached + computed),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else 0.0,
        "ttft_p95_s": ttfts[max(0, int(0.95 * len(ttfts) + 0.999) - 1)] if ttfts else 0.0,
        "per_replica": per,
        "busiest_share": max(per.values()) / max(1, len(ok)) if per else 0.0,
    }


def reset(replica_url: str, doc_ids: set[str]) -> None:
    for doc_id in sorted(doc_ids):
        r = httpx.post(f"{replica_url}/v1/cache/invalidate", json={"doc_id": doc_id}, timeout=60)
        r.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--workload", default="demo")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pool-share", type=float, default=0.5)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--no-kill", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=DATA_HELP,
    )
    args = parser.parse_args()
    script_data_dir(args.data_dir, workload_files(args.workload))
    args.out.mkdir(parents=True, exist_ok=True)

    def on_term(signum: int, frame: object) -> None:
        raise SystemExit(f"signal {signum}")  # the finally below stops the replicas

    signal.signal(signal.SIGTERM, on_term)
    if args.model is None:
        from ragcache_core.models import build_tiny_model

        args.model = build_tiny_model(size="tiny")
    count = tokenizer_counter(str(args.model))
    workload, source = index_source(
        load_workload(args.workload, count, data_dir=args.data_dir), progress=False
    )
    assert source is not None, "the workload's requests must retrieve"
    questions = [r.question for r in workload.stream(args.requests)]
    docs = retrieved(questions, source, workload.top_k)
    distinct = {d.id: d for ds in docs for d in ds}
    working_set = sum(count(d.text) for d in distinct.values())
    pool = int(args.pool_share * working_set / 2)
    print(
        f"{args.workload}: {len(questions)} requests, {len(distinct)} distinct documents, "
        f"working set {working_set} tokens; per replica GPU {pool} + host {pool} tokens",
        flush=True,
    )
    router_bin = find_router(None)
    # Every port bound and held until its process takes it (`ragcache replicas`' way): the
    # replicas inherit their sockets; each router's are let go just before it starts.
    held = [hold_ports("127.0.0.1", 0, 0, 2, 0), hold_ports("127.0.0.1", 0, 0, 0, 0)]
    layout = held[0].layout
    from ragcache_core.storage.pool_layout import layout_for_model

    token_bytes = layout_for_model(str(args.model), dtype="float32", page_size=16).token_bytes
    # vLLM's KV cache is the GPU tier: the pool's tokens plus one max-length sequence (4,096).
    gpu_gib = (pool + 4096 + 512) * token_bytes / 2**30
    extra = ["--vllm-kv-cache-gib", f"{gpu_gib:.6f}", "--host-pool-tokens", str(pool)]
    extra += ["--max-tokens", str(args.max_tokens), "--drain-timeout", "5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    routers: list[subprocess.Popen[bytes]] = []
    try:
        start_replicas(
            held[0],
            args.model,
            None,
            extra,
            procs,
            env_for=lambda i: env,
            log_for=lambda i: (args.out / f"replica-{i}.log").open("wb"),
        )
        for url in layout.replica_urls:
            wait_for(url + "/health", procs, 600, [])
        urls = {}
        for ports, policy in zip(held, ("round_robin", "consistent_hash"), strict=True):
            rl = Layout("127.0.0.1", ports.layout.port, layout.replica_ports)
            cmd = router_command(router_bin, rl, policy, ports.prometheus_port, None)
            ports.release_router()
            log = (args.out / f"router-{policy}.log").open("wb")
            routers.append(spawn(cmd, dict(os.environ), log))
            wait_for(rl.router_url + "/readiness", routers, 600, [])
            urls[policy] = rl.router_url
        runs: dict[str, list[dict[str, Any]]] = {"round_robin": [], "affinity": []}
        order = []
        for rep in range(args.repeats):
            order += ["round_robin", "affinity"] if rep % 2 == 0 else ["affinity", "round_robin"]
        for name in order:
            reset(layout.replica_urls[0], set(distinct))
            url = urls["round_robin" if name == "round_robin" else "consistent_hash"]
            keys = AffinityKeys(replicas=2) if name == "affinity" else None
            s = summary(asyncio.run(stream(url, questions, docs, args.concurrency, keys)))
            runs[name].append(s)
            print(f"{name}: {json.dumps(s)}", flush=True)
        result: dict[str, Any] = {"workload": args.workload, "requests": len(questions)}
        result.update(distinct_documents=len(distinct), working_set_tokens=working_set)
        result.update(pool_tokens_per_tier=pool, concurrency=args.concurrency, runs=runs)
        if not args.no_kill:
            result["kill"] = kill_run(layout, urls["consistent_hash"], procs, questions, docs, args)
            print(f"kill: {json.dumps(result['kill'])}", flush=True)
        (args.out / f"replica-bench-{args.workload}.json").write_text(json.dumps(result, indent=1))
    finally:
        for ports in held:
            ports.close()
        stop(routers, procs, 60)


def kill_run(
    layout: Layout,
    url: str,
    procs: list[subprocess.Popen[bytes]],
    questions: list[str],
    docs: list[list[Document]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Affinity; SIGKILL replica r1 when half the stream has been sent."""
    reset(layout.replica_urls[0], {d.id for ds in docs for d in ds})
    half = len(questions) // 2
    killed_at: list[float] = []

    def on_index(i: int) -> None:
        if i == half and not killed_at:
            procs[1].send_signal(signal.SIGKILL)
            killed_at.append(time.perf_counter())

    keys = AffinityKeys(replicas=2)
    results = asyncio.run(stream(url, questions, docs, args.concurrency, keys, on_index))
    before, after = results[:half], results[half:]
    tail = after[len(after) // 2 :]
    survivor = {r["key"] for r in before if r.get("replica") == "r0"}
    kept = [r for r in after if r.get("key") in survivor and r.get("status") == 200]
    return {
        "before": summary(before),
        "after": summary(after),
        "survivor_keys_after": summary(kept) if kept else None,
        "last_quarter_replicas": sorted({str(r.get("replica")) for r in tail}),
        "statuses_after": sorted({int(r.get("status", 0)) for r in after}),
    }


if __name__ == "__main__":
    sys.exit(main())
