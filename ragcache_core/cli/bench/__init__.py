"""`ragcache bench <name>`: benchmarks, one command module each.

Each module here exposes `register(bench_subparsers) -> None`, which adds its parser and sets
`func(args) -> int`; the measurement itself lives in `ragcache_core.bench` and is imported
inside `func`, so `ragcache --help` stays light. Adding a benchmark is adding its module here.
"""

from __future__ import annotations

from typing import Any

from ragcache_core.cli.bench import copies, overhead, prefill, quality, serve


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmarks (overhead, prefill, copies, serve, quality)"
    )
    bench_subparsers = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module in (overhead, prefill, copies, serve, quality):
        module.register(bench_subparsers)
