"""`ragcache bench prefill`: the command line of `bench.prefill`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ragcache_core.bench.prefill import DOC_TOKENS, PrefillResult, measure, result_line
from ragcache_core.cli.model import bench_model
from ragcache_core.cli.output import stdout_to_stderr
from ragcache_core.errors import CliError


def register(bench_subparsers: Any) -> None:
    parser = bench_subparsers.add_parser(
        "prefill", help="TTFT: full prefill vs GPU-tier / host-tier hits vs vLLM prefix cache"
    )
    parser.add_argument(
        "--model", help="local checkpoint folder (default: the offline bench model)"
    )
    parser.add_argument(
        "--doc-tokens",
        type=int,
        nargs="+",
        default=list(DOC_TOKENS),
        help="document lengths in tokens (default: 512 1024 2048 4096)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs per median (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or any(n < 1 for n in args.doc_tokens):
        raise CliError("--repeats and --doc-tokens must be positive")
    model = bench_model(args.model)
    if args.json:
        # vLLM's processes log to stdout: keep stdout for the JSON document alone.
        with stdout_to_stderr():
            report = measure(model, tuple(args.doc_tokens), args.repeats)
    else:
        report = measure(model, tuple(args.doc_tokens), args.repeats, progress=True)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for r in report["results"]:
            print(result_line(PrefillResult(**r)))
    return 0
