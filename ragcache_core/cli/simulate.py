"""`ragcache simulate`: replay a request trace through the control plane (no model, no GPU)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ragcache_core.errors import CliError
from ragcache_core.policy import DEFAULT_POLICY, POLICIES


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a request trace through the knowledge cache: hit rates, recomputation",
        description=(
            "Replay a JSONL trace ({id, arrival_s, docs, doc_tokens, question_tokens} per line) "
            "through the knowledge tree with a replacement policy and GPU/host capacities. "
            "Prefill times come from the cost profile (default: the built-in analytic one); "
            "requests are served FCFS, or cache-aware reordered with --reorder. "
            "With --engine, the engine's tiers instead (vLLM's prefix-cached blocks under LRU, "
            "the host tier written at compute or at eviction; hit rates only). "
            "--replay serve.json replays a `ragcache bench serve` run's streams through the "
            "engine's tiers and prints the simulator's hit rates beside the engine's."
        ),
    )
    parser.add_argument("--trace", type=Path, default=None, metavar="T.jsonl")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help=f"{', '.join(POLICIES)} (%(default)s)"
    )
    parser.add_argument(
        "--gpu-tokens", type=int, default=None, metavar="N", help="the GPU pool (not --engine)"
    )
    parser.add_argument("--host-tokens", type=int, default=None, metavar="M")
    parser.add_argument(
        "--system-tokens", type=int, default=0, metavar="S", help="root size (%(default)s)"
    )
    parser.add_argument(
        "--max-depth", type=int, default=None, metavar="J", help="cache only the first J docs"
    )
    parser.add_argument("--profile", type=Path, default=None, help="cost profile JSON")
    parser.add_argument("--reorder", action="store_true", help="cache-aware reordering queue")
    parser.add_argument(
        "--max-prefill-bs", type=int, default=1, metavar="B", help="batch size (%(default)s)"
    )
    parser.add_argument(
        "--window",
        type=int,
        default=16,
        metavar="W",
        help="reordering: max times a request may be overtaken (%(default)s)",
    )
    parser.add_argument(
        "--store-policy",
        choices=("always", "second", "no_evict"),
        default="always",
        help="which computed documents are stored (%(default)s)",
    )
    parser.add_argument(
        "--document-order",
        choices=("retrieval", "cache", "sorted", "first_seen"),
        default="retrieval",
        help="the prompt's document order: retrieval (%(default)s), cache (follows the cached "
        "path, as document_order='cache' serves it), or the canonical orders sorted (by id) "
        "and first_seen (simulator only, for comparison)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="simulate N replicas behind a router (capacities are per replica)",
    )
    parser.add_argument(
        "--routing",
        default="doc_affinity",
        help="with --replicas: round_robin, prefix_affinity, doc_affinity, "
        "doc_affinity_unbounded or oracle (%(default)s)",
    )
    parser.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        metavar="C",
        help="with --replicas: the load bound of doc_affinity and oracle (%(default)s)",
    )
    engine = parser.add_argument_group("the engine's tiers (--engine, --replay)")
    engine.add_argument(
        "--engine", action="store_true", help="simulate the engine's tiers (sim/engine.py)"
    )
    engine.add_argument("--vllm-blocks", type=int, default=None, metavar="B", help="vLLM's KV")
    engine.add_argument("--block-size", type=int, default=32, help="vLLM's (%(default)s)")
    engine.add_argument("--page-size", type=int, default=16, help="host slots' (%(default)s)")
    engine.add_argument("--host-write", choices=("compute", "eviction"), default="compute")
    engine.add_argument("--host-write-return", choices=("head", "tail"), default="head")
    engine.add_argument("--max-num-batched-tokens", type=int, default=4096, metavar="T")
    engine.add_argument(
        "--window-tokens",
        type=int,
        default=0,
        help="a look-ahead of the free queue, copied before hand-out (default 0: none)",
    )
    engine.add_argument("--max-tokens", type=int, default=8, help="answer tokens (%(default)s)")
    engine.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="serve.json",
        help="replay a `ragcache bench serve` run; print the simulator beside the engine",
    )
    engine.add_argument(
        "--workloads", default=None, help="with --replay: a comma list (default: all in it)"
    )
    engine.add_argument(
        "--replay-policy",
        default=None,
        metavar="NAME",
        help="with --replay: the simulator's host tier under this policy instead of each "
        "system's (what the run would have hit; the engine's columns stay the run's)",
    )
    engine.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="with --replay: the benchmark data folder (default: $RAGCACHE_DATA_DIR, else "
        "../shared/data; docs/benchmarks.md, 'Benchmark data')",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.replay is not None:
        return _run_replay(args)
    if args.trace is None:
        raise CliError("simulate needs --trace T.jsonl (or --replay serve.json)")
    if args.engine:
        return _run_engine(args)
    if args.gpu_tokens is None or args.host_tokens is None:
        raise CliError("simulate needs --gpu-tokens and --host-tokens (or --engine)")
    from ragcache_core.cost import InterpolatedCostModel, default_cost_model
    from ragcache_core.cost.profile import CostProfile
    from ragcache_core.sim import SimConfig, Simulator, load_trace

    config = SimConfig(
        gpu_tokens=args.gpu_tokens,
        host_tokens=args.host_tokens,
        policy=args.policy,
        system_tokens=args.system_tokens,
        max_depth=args.max_depth,
        reorder=args.reorder,
        max_prefill_bs=args.max_prefill_bs,
        window=args.window,
        store_policy=args.store_policy,
        document_order=args.document_order,
    )
    cost = (
        InterpolatedCostModel(CostProfile.load(args.profile))
        if args.profile
        else default_cost_model()
    )
    if args.replicas is not None:
        return _run_cluster(args, config, cost)
    simulator = Simulator(config, cost)  # validates the policy before reading the trace
    result = simulator.run(load_trace(args.trace))
    out: dict[str, Any] = {
        **result.to_json(),
        "policy": args.policy,
        "gpu_tokens": args.gpu_tokens,
        "host_tokens": args.host_tokens,
        "system_tokens": args.system_tokens,
        "max_depth": args.max_depth,
        "reorder": args.reorder,
        "max_prefill_bs": args.max_prefill_bs,
        "window": args.window,
        "store_policy": args.store_policy,
        "document_order": args.document_order,
        "profile": str(args.profile) if args.profile else "analytic",
    }
    return _print(out, args.json)


def _run_cluster(args: argparse.Namespace, config: Any, cost: Any) -> int:
    from ragcache_core.sim import ClusterConfig, ClusterSimulator, load_trace

    cluster = ClusterConfig(
        replicas=args.replicas,
        replica=config,
        routing=args.routing,
        load_factor=args.load_factor,
    )
    simulator = ClusterSimulator(cluster, cost)  # validates before reading the trace
    result = simulator.run(load_trace(args.trace))
    out: dict[str, Any] = {
        **result.to_json(),
        "policy": args.policy,
        "gpu_tokens_per_replica": args.gpu_tokens,
        "host_tokens_per_replica": args.host_tokens,
        "system_tokens": args.system_tokens,
        "load_factor": args.load_factor,
        "profile": str(args.profile) if args.profile else "analytic",
    }
    return _print(out, args.json)


def _run_engine(args: argparse.Namespace) -> int:
    from ragcache_core.sim import (
        EngineConfig,
        EngineRequest,
        EngineSimulator,
        Simulator,
        load_trace,
    )

    if args.vllm_blocks is None:
        raise CliError("simulate --engine needs --vllm-blocks (vLLM's KV cache, in blocks)")
    config = EngineConfig(
        vllm_blocks=args.vllm_blocks,
        host_tokens=args.host_tokens or 0,
        block_size=args.block_size,
        page_size=args.page_size,
        policy=args.policy,
        store_policy=args.store_policy,
        host_write=args.host_write,
        host_write_return=args.host_write_return,
        max_num_batched_tokens=args.max_num_batched_tokens,
        window_tokens=args.window_tokens,
        max_tokens=args.max_tokens,
        max_depth=args.max_depth,
    )
    simulator = EngineSimulator(config)  # validates the settings before reading the trace
    requests = [
        EngineRequest(args.system_tokens, tuple(Simulator.specs(r)), r.question_tokens, r.id)
        for r in sorted(load_trace(args.trace), key=lambda r: r.arrival_s)
    ]
    result = simulator.run(requests)
    out: dict[str, Any] = {
        **result.to_json(),
        **{k: getattr(config, k) for k in config.__dataclass_fields__},
        "system_tokens": args.system_tokens,
    }
    return _print(out, args.json)


def _run_replay(args: argparse.Namespace) -> int:
    import sys

    from ragcache_core.bench.replay import print_rows, replay

    names = tuple(n.strip() for n in args.workloads.split(",")) if args.workloads else None
    rows = replay(args.replay, names, args.data_dir, args.replay_policy)
    if args.json:
        print(json.dumps([row.to_json() for row in rows]))
    else:
        print_rows(rows, sys.stdout)
    return 0


def _print(out: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(out))
        return 0
    width = max(len(k) for k in out)
    for key, value in out.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return 0
