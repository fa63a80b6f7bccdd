"""The engine dies with the server, however the server ends (SIGKILL included).

vLLM starts its engine core with multiprocessing (fork on CPU, spawn where CUDA is
initialized), and the core starts its workers with spawn. A worker notices its core's death,
but the core does not notice the server's: after `kill -9` of the server it lives on, holding
its memory (on a GPU, the GPU's) and, when it was forked after the server began listening,
the server's port, until someone kills it. Nothing here patches vLLM; instead `ragcache
serve` starts this watchdog, a small process of its own (not forked: it holds nothing of the
server's):

    every POLL_S, while the server runs (its pid with its start time, from /proc):
        note the server's descendants (pid + start time)
    the server is gone, however it ended ──►
        SIGTERM to the noted processes still running (vLLM's engine core then stops its
        workers and frees its shared memory), SIGKILL after GRACE_S to what is left, then
        `reclaim_shared_memory` + `reclaim_locks` (the pools, segments and lock files left
        by processes that are gone), one line on stderr, exit

The server's liveness is polled, not read off a pipe: a forked engine core would inherit the
pipe's other end and keep it open. A pid is signalled only while its start time is the noted
one (never a reused pid). The watchdog ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C
reaches the whole process group: the server drains and stops its engine, and the watchdog
then finds nothing left to kill). Linux only (/proc); elsewhere the server starts none.

    python -m ragcache_core.serve.watchdog SERVER_PID SERVER_START_TIME
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

from ragcache_core.serve.owner import reclaim_locks
from ragcache_core.storage.reclaim import PROC, reclaim_shared_memory

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the server's descendants are noted."""
GRACE_S = 5.0
"""How long the engine has to stop on SIGTERM before it is killed."""

Noted = dict[int, int]
"""pid -> its start time (clock ticks since boot, /proc/<pid>/stat field 22)."""


class Watchdog:
    """The server's handle on its watchdog process (module docstring)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls) -> Watchdog | None:
        """Start the watchdog of this process (None where there is no /proc)."""
        me = _stat(os.getpid())
        if me is None:
            return None
        command = [sys.executable, "-m", "ragcache_core.serve.watchdog", str(os.getpid())]
        command.append(str(me[1]))
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, close_fds=True)
        return cls(process)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not all(a.isdigit() for a in args):
        print(
            "usage: python -m ragcache_core.serve.watchdog SERVER_PID SERVER_START_TIME",
            file=sys.stderr,
        )
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    server, started = int(args[0]), int(args[1])
    noted = watch(server, started)
    line = clean_up(server, noted)
    if line:
        print(f"ragcache serve watchdog: {line}", file=sys.stderr, flush=True)
    return 0


def watch(server: int, started: int) -> Noted:
    """Note the server's descendants while it runs; returns the last noted."""
    noted: Noted = {}
    while _alive({server: started}):
        noted.update(descendants(server))
        time.sleep(POLL_S)
    return noted


def clean_up(server: int, noted: Noted) -> str:
    """Stop the noted processes still running, then reclaim what is left of processes that
    are gone; what was done, in one line ("" when nothing was)."""
    stopped = stop(noted)
    reclaimed = reclaim_shared_memory()
    locks = reclaim_locks()
    parts = []
    if stopped:
        parts.append(f"stopped {len(stopped)} engine process(es) of server {server}")
    if reclaimed or locks:
        parts.append(
            f"removed {len(reclaimed.pools)} host pool file(s), {len(reclaimed.segments)} "
            f"shared-memory segment(s) ({reclaimed.nbytes / 2**20:.0f} MiB) and "
            f"{len(locks)} lock file(s) left by processes that are gone"
        )
    return "; ".join(parts)


def stop(noted: Noted) -> list[int]:
    """SIGTERM to each noted process still running (and what it started since), SIGKILL
    after `GRACE_S` to those left; the pids signalled."""
    targets = _alive(noted)
    for pid in list(targets):
        targets.update(descendants(pid))
    for pid in targets:
        _signal(pid, targets[pid], signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _alive(targets) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid, started in _alive(targets).items():
        _signal(pid, started, signal.SIGKILL)
    return sorted(targets)


def descendants(root: int) -> Noted:
    """Every process below `root` (children, their children, ...), with start times; the
    watchdog itself excluded."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: Noted = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid in found or pid == os.getpid():
            continue
        found[pid] = table[pid][1]
        stack.extend(children.get(pid, []))
    return found


def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every running process."""
    table = {}
    for entry in _pids():
        parsed = _stat(entry)
        if parsed is not None:
            table[entry] = parsed
    return table


def _pids() -> Iterable[int]:
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                yield int(entry.name)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a running `pid` (None when gone or a zombie)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])  # ppid (field 4), starttime (field 22)


def _alive(noted: Noted) -> Noted:
    """The noted processes that still run as themselves (same start time)."""
    alive = {}
    for pid, started in noted.items():
        now = _stat(pid)
        if now is not None and now[1] == started:
            alive[pid] = started
    return alive


def _signal(pid: int, started: int, sig: int) -> None:
    now = _stat(pid)
    if now is not None and now[1] == started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


if __name__ == "__main__":
    sys.exit(main())
