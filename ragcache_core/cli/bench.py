"""`ragcache bench <name>`: benchmarks, one module each.

Each module in `BENCH_MODULES` exposes `register(bench_subparsers) -> None`, which adds its
parser and sets `func(args) -> int`. Adding a benchmark is adding its module path here.
"""

from __future__ import annotations

import importlib
from typing import Any

BENCH_MODULES: tuple[str, ...] = (
    "ragcache_core.bench.overhead",
    "ragcache_core.bench.prefill",
    "ragcache_core.bench.copies",
    "ragcache_core.bench.serve_cli",
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (overhead, prefill, copies, serve)")
    bench_subparsers = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for path in BENCH_MODULES:
        importlib.import_module(path).register(bench_subparsers)
