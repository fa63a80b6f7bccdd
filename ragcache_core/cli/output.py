"""Output helpers shared by commands."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr meanwhile (inherited by vLLM's child processes, which
    log to stdout), so a `--json` command's stdout holds the JSON document alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def add_verbose(parser: Any) -> None:
    """`-v/--verbose` on a command that starts vLLM: its log lines here, not in a file."""
    parser.add_argument(
        "-v",
        "--verbose",
        dest="show_vllm",  # not `verbose`: `ragcache -v` (DEBUG logging) is another switch
        action="store_true",
        help="show vLLM's own log lines here (default: in a log file, named at the start)",
    )


def vllm_log(args: argparse.Namespace, name: str, stream: TextIO) -> Path | None:
    """Unless `--verbose` (or `ragcache -v`): vLLM's output goes to `$RAGCACHE_VLLM_LOG` or
    `$RAGCACHE_HOME/logs/<name>.log` (`engine/logs.py`), and one line on `stream` says where.
    With it: vLLM prints here as usual. Returns the log file (None when verbose)."""
    from ragcache_core.engine.logs import LOG_ENV, default_log_file, quiet_vllm

    if getattr(args, "show_vllm", False) or getattr(args, "verbose", False):
        os.environ.pop(LOG_ENV, None)
        return None
    path = quiet_vllm(default_log_file(name))
    print(f"vLLM's log: {path} (--verbose shows it here)", file=stream, flush=True)
    return path
