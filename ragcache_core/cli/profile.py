"""`ragcache profile --model M --out profile.json`: measure T(cached, new) for the cost model."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ragcache_core.cli.model import bench_model


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure prefill time over a (cached, new) token grid; write the cost profile",
    )
    parser.add_argument("--model", required=True, help="local checkpoint folder ('bench': offline)")
    parser.add_argument("--out", required=True, help="where to write the profile JSON")
    parser.add_argument(
        "--cached", type=int, nargs="+", help="cached-token grid (default 0 256 1024 2048)"
    )
    parser.add_argument(
        "--new", type=int, nargs="+", help="new-token grid (default 16 128 512 1024)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per grid point (median)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ragcache_core.engine.profiler import DEFAULT_CACHED, DEFAULT_NEW, profile_prefill

    model = bench_model(None if args.model == "bench" else args.model)
    cached = tuple(args.cached or DEFAULT_CACHED)
    new = tuple(args.new or DEFAULT_NEW)
    with tqdm(total=len(set(cached)) * len(set(new)), desc="profiling", file=sys.stderr) as bar:

        def on_point(alpha: int, beta: int, seconds: float) -> None:
            bar.set_postfix_str(f"T({alpha}, {beta}) = {seconds * 1e3:.1f} ms")
            bar.update(1)

        profile = profile_prefill(model, cached, new, args.repeats, on_point=on_point)
    profile.save(args.out)
    print(f"wrote {args.out} ({len(profile.cached_tokens)} x {len(profile.new_tokens)} grid)")
    return 0
