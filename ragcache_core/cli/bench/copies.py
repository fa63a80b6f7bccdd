"""`ragcache bench copies`: the command line of `bench.copies`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ragcache_core.bench.copies import PAGE_SIZES, measure
from ragcache_core.cli.model import bench_model
from ragcache_core.errors import CliError


def _table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['device']}, {report['copies']}, {report['dtype']}, {report['shapes']}, "
        f"{report['tokens']} tokens in spans of {report['span']}, "
        f"torch threads {report['torch_threads']}",
        f"ceiling (torch copy_ of the same bytes): {report['ceiling_copy_gbps']:.2f} GB/s",
        f"{'page':>5} {'load ms':>9} {'GB/s':>7} {'store ms':>9} {'GB/s':>7}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['page_size']:>5} {r['load_ms']:>9.2f} {r['load_gbps']:>7.2f}"
            f" {r['store_ms']:>9.2f} {r['store_gbps']:>7.2f}"
        )
    return "\n".join(lines)


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "copies", help="KV copy speed (load/store per step) per page size, vs torch copy_"
    )
    parser.add_argument("--model", help="local checkpoint folder (default: the bench model)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step (%(default)s)")
    parser.add_argument("--span", type=int, default=512, help="tokens per document span")
    parser.add_argument(
        "--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES), help="pool page sizes"
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per median (%(default)s)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.tokens < 1 or args.span < 1 or min(args.page_sizes) < 1:
        raise CliError("--repeats, --tokens, --span and --page-sizes must be positive")
    model = bench_model(args.model)
    report = measure(
        model,
        tokens=args.tokens,
        span=args.span,
        page_sizes=tuple(args.page_sizes),
        repeats=args.repeats,
    )
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0
