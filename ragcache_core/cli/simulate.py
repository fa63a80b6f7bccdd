"""`ragcache simulate`: replay a request trace through the engine's tiers, simulated (no model, no
GPU)."""

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
        help="replay a request trace through the engine's tiers: hit rates, TTFT",
        description=(
            "Replay a JSONL trace ({id, arrival_s, docs, doc_tokens, question_tokens} per line) "
            "through a simulated engine: vLLM's prefix-cached blocks under LRU and the host "
            "tier (the engine's knowledge tree and policy, written at eviction or at compute), "
            "driven as the runtime drives them. Prefill times come from the cost profile "
            "(default: the built-in analytic one; `paper-a10g`: the paper's GPU, from its "
            "published figures), host loads and copies from the profile's copy rate; requests "
            "are served FCFS, or cache-aware reordered with --reorder. "
            "--replay serve.json replays a `ragcache bench serve` run's streams through the "
            "same tiers and prints the simulator's hit rates beside the engine's."
        ),
    )
    parser.add_argument("--trace", type=Path, default=None, metavar="T.jsonl")
    parser.add_argument(
        "--policy", default=DEFAULT_POLICY, help=f"{', '.join(POLICIES)} (%(default)s)"
    )
    parser.add_argument("--vllm-blocks", type=int, default=None, metavar="B", help="vLLM's KV")
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="vLLM without prefix caching: no block is ever a hit (the host tier still serves)",
    )
    parser.add_argument("--host-tokens", type=int, default=0, metavar="M", help="(%(default)s)")
    parser.add_argument(
        "--system-tokens", type=int, default=0, metavar="S", help="root size (%(default)s)"
    )
    parser.add_argument(
        "--max-depth", type=int, default=None, metavar="J", help="cache only the first J docs"
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE|paper-a10g",
        help="cost profile JSON, or the built-in paper-a10g (default: the analytic profile)",
    )
    parser.add_argument("--reorder", action="store_true", help="cache-aware reordering queue")
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
        help="which computed documents are stored or kept (%(default)s)",
    )
    parser.add_argument(
        "--document-order",
        choices=("retrieval", "cache", "sorted", "first_seen"),
        default="retrieval",
        help="the prompt's document order: retrieval (%(default)s), cache (follows the cached "
        "path, as document_order='cache' serves it), or the canonical orders sorted (by id) "
        "and first_seen (simulator only, for comparison)",
    )
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's (%(default)s)")
    parser.add_argument("--page-size", type=int, default=16, help="host slots' (%(default)s)")
    parser.add_argument(
        "--host-write",
        choices=("compute", "eviction"),
        default=None,
        help="when the host tier is written (default: eviction, the engine's, with a host tier "
        "and prefix caching)",
    )
    parser.add_argument("--host-write-return", choices=("head", "tail"), default="head")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096, metavar="T")
    parser.add_argument(
        "--window-tokens",
        type=int,
        default=0,
        help="a look-ahead of the free queue, copied before hand-out (default 0: none)",
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="answer tokens (%(default)s)")
    replicas = parser.add_argument_group("many replicas (--replicas)")
    replicas.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="simulate N replicas behind a router (capacities are per replica)",
    )
    replicas.add_argument(
        "--routing",
        default="doc_affinity",
        help="with --replicas: round_robin, prefix_affinity, doc_affinity, "
        "doc_affinity_unbounded or oracle (%(default)s)",
    )
    replicas.add_argument(
        "--load-factor",
        type=float,
        default=1.25,
        metavar="C",
        help="with --replicas: the load bound of doc_affinity and oracle (%(default)s)",
    )
    replay = parser.add_argument_group("a bench run replayed (--replay)")
    replay.add_argument(
        "--replay",
        type=Path,
        default=None,
        metavar="serve.json",
        help="replay a `ragcache bench serve` run; print the simulator beside the engine",
    )
    replay.add_argument(
        "--workloads", default=None, help="with --replay: a comma list (default: all in it)"
    )
    replay.add_argument(
        "--replay-policy",
        default=None,
        metavar="NAME",
        help="with --replay: the simulator's host tier under this policy instead of each "
        "system's (what the run would have hit; the engine's columns stay the run's)",
    )
    replay.add_argument(
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
    if args.vllm_blocks is None:
        raise CliError("simulate needs --vllm-blocks (vLLM's KV cache, in blocks)")
    from ragcache_core.cost import InterpolatedCostModel
    from ragcache_core.sim import EngineConfig, SimConfig, Simulator, load_trace

    evicted = args.host_tokens and not args.no_prefix_caching  # the engine's default applies
    host_write = args.host_write or ("eviction" if evicted else "compute")
    engine = EngineConfig(
        vllm_blocks=args.vllm_blocks,
        host_tokens=args.host_tokens,
        block_size=args.block_size,
        page_size=args.page_size,
        policy=args.policy,
        store_policy=args.store_policy,
        host_write=host_write,
        host_write_return=args.host_write_return,
        max_num_batched_tokens=args.max_num_batched_tokens,
        window_tokens=args.window_tokens,
        max_tokens=args.max_tokens,
        max_depth=args.max_depth,
        prefix_caching=not args.no_prefix_caching,
    )
    config = SimConfig(
        engine=engine,
        system_tokens=args.system_tokens,
        reorder=args.reorder,
        window=args.window,
        document_order=args.document_order,
    )
    profile = _profile(args.profile)
    cost = InterpolatedCostModel(profile)
    settings: dict[str, Any] = {
        **{k: getattr(engine, k) for k in engine.__dataclass_fields__},
        "system_tokens": args.system_tokens,
        "profile": args.profile or "analytic",
    }
    if args.replicas is not None:
        return _run_cluster(args, config, cost, profile.copy_cost, settings)
    simulator = Simulator(config, cost, profile.copy_cost)  # validates before reading the trace
    result = simulator.run(load_trace(args.trace))
    out: dict[str, Any] = {
        **result.to_json(),
        **settings,
        "reorder": args.reorder,
        "window": args.window,
        "document_order": args.document_order,
    }
    return _print(out, args.json)


def _profile(name: str | None) -> Any:
    """The cost profile `--profile` names: a file, the built-in `paper-a10g`, or (None) the
    analytic one."""
    from ragcache_core.cost import analytic_profile
    from ragcache_core.cost.paper import PAPER_PROFILES
    from ragcache_core.cost.profile import CostProfile

    if name is None:
        return analytic_profile()
    if name in PAPER_PROFILES:
        return PAPER_PROFILES[name]()
    return CostProfile.load(name)


def _run_cluster(
    args: argparse.Namespace, config: Any, cost: Any, copies: Any, settings: dict[str, Any]
) -> int:
    from ragcache_core.sim import ClusterConfig, ClusterSimulator, load_trace

    cluster = ClusterConfig(
        replicas=args.replicas,
        replica=config,
        routing=args.routing,
        load_factor=args.load_factor,
    )
    simulator = ClusterSimulator(cluster, cost, copies)  # validates before reading the trace
    result = simulator.run(load_trace(args.trace))
    out: dict[str, Any] = {**result.to_json(), **settings, "load_factor": args.load_factor}
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
