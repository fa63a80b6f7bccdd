"""The `ragcache` command line.

Each sub-command lives in its own module under `ragcache_core.cli` and exposes
`register(subparsers) -> None`, which adds its parser and sets `func` (a callable taking the
parsed `argparse.Namespace` and returning an exit code). Heavy imports (torch, vLLM, Faiss)
happen inside `func`, so `ragcache --help` stays instant.

Errors the user can fix (a missing model folder, a malformed trace) are raised as
`CliError`; `main` prints them as one line and exits with code 2, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
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
)


class CliError(RAGCacheError):
    """A problem with the command's input, printed as one line (exit code 2)."""


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
    try:
        code: int = args.func(args)
    except RAGCacheError as exc:
        # User-fixable problems: one clear line, no traceback.
        print(f"ragcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
