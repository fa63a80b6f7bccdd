"""`ragcache bench overhead`: the command line of `bench.overhead`."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from ragcache_core.bench import overhead
from ragcache_core.policy import DEFAULT_POLICY


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "overhead",
        help="control-plane time per request (queue + match + update + evict + plan)",
        description=overhead.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--nodes", type=int, nargs="+", default=[10_000, 100_000], help="%(default)s"
    )
    parser.add_argument("--requests", type=int, default=2000, help="%(default)s")
    parser.add_argument("--policy", default=DEFAULT_POLICY, help="%(default)s")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    results = [overhead.measure(n, args.requests, args.policy) for n in args.nodes]
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "target_p99_us": 100}))
        return 0
    print(f"{'nodes':>8} {'requests':>8} {'p50 us':>8} {'p99 us':>8} {'mean us':>8} {'max us':>8}")
    for r in results:
        print(
            f"{r.nodes:>8} {r.requests:>8} {r.p50_us:>8.1f} {r.p99_us:>8.1f} "
            f"{r.mean_us:>8.1f} {r.max_us:>8.1f}"
        )
    return 0
