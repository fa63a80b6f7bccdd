"""`ragcache simulate`: replay a request trace through the control plane (no model, no GPU)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="replay a request trace through the knowledge cache: hit rates, recomputation",
        description=(
            "Replay a JSONL trace ({id, arrival_s, docs, doc_tokens, question_tokens} per line) "
            "through the knowledge tree with a replacement policy and GPU/host capacities. "
            "Prefill times come from the cost profile (default: the built-in analytic one); "
            "requests are served FCFS, or cache-aware reordered with --reorder."
        ),
    )
    parser.add_argument("--trace", type=Path, required=True, metavar="T.jsonl")
    parser.add_argument(
        "--policy", default="pgdsf", help="pgdsf, gdsf, lru, lfu, arc or apgdsf (%(default)s)"
    )
    parser.add_argument("--gpu-tokens", type=int, required=True, metavar="N")
    parser.add_argument("--host-tokens", type=int, required=True, metavar="M")
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
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
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


def _print(out: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(out))
        return 0
    width = max(len(k) for k in out)
    for key, value in out.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    return 0
