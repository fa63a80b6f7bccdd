"""The `ragcache` command line.

Each sub-command lives in its own module under `ragcache_core.cli` and exposes
`register(subparsers) -> None`, which adds its parser and sets `func` (a callable taking the
parsed `argparse.Namespace` and returning an exit code). Heavy imports (torch, vLLM, Faiss)
happen inside `func`, so `ragcache --help` stays instant.

Errors the user can fix (a missing model folder, a malformed trace) are raised as
`CliError` (in `ragcache_core.errors`); `main` prints them as one line and exits with code 2,
without a traceback.
SIGTERM ends a command the way Ctrl-C does (exit code 143), so the engines it started are
closed on the way out instead of outliving it (`ragcache serve` drains on it instead).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from ragcache_core.errors import RAGCacheError

# One module per sub-command; adding a command is adding its module name here.
COMMAND_MODULES: tuple[str, ...] = (
    "doctor",
    "model",
    "index",
    "trace",
    "search_stats",
    "simulate",
    "bench",
    "profile",
    "demo",
    "serve",
    "replicas",
)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: every `finally` on the way out runs."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


OWN_SIGTERM = frozenset({"serve"})
"""Commands that handle SIGTERM themselves (uvicorn drains the server)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragcache",
        description="RAGCache: a knowledge cache for retrieval-augmented generation on vLLM.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at DEBUG level (and show vLLM's own lines where a command would file them)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(f"ragcache_core.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command in OWN_SIGTERM or threading.current_thread() is not threading.main_thread():
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    try:
        code: int = args.func(args)
    except RAGCacheError as exc:
        # User-fixable problems: one clear line, no traceback.
        print(f"ragcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
