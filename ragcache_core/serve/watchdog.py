"""One server owns the engine (the engine lock), and the engine dies with it, however the
server ends (SIGKILL included).

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

The engine lock: one `ragcache serve` process per port, and the stale locks a crash left.

A second process for the same port (another uvicorn worker, a second `ragcache serve`) is
refused at startup, before it starts an engine. The lock is an exclusive `flock` on
`ragcache-serve-port-<port>.lock` beside the host pools (`/dev/shm` on Linux); the kernel
drops it when the process ends, however it ends, so a crash never leaves it held, only its
file. The owner removes the file when it stops (while still holding the lock); a process that
locked a file just removed that way sees that the path no longer names its file and tries
again.

`reclaim_locks` removes the files of locks nobody holds (a server that was killed): it takes
each lock as the owner would, and removes the file while holding it, so a server starting at
that moment retries on a new file. Such a reclaimer holds a lock for microseconds, so `_lock`
tries for `RETRY_S` before it says another server owns the port.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ragcache_core.errors import ConfigError
from ragcache_core.storage.host_pool import shm_folder
from ragcache_core.storage.reclaim import PROC, reclaim_shared_memory

LOCK_GLOB = "ragcache-serve-port-*.lock"
RETRY_S = 1.0
"""How long a lock held by someone else is retried (a reclaimer lets go at once)."""


def lock_path(port: int, folder: Path | None = None) -> Path:
    return (folder or shm_folder()) / f"ragcache-serve-port-{port}.lock"


@contextlib.contextmanager
def sole_owner(host: str, port: int) -> Iterator[None]:
    """Hold the engine lock of `port` for the block; `ConfigError` if another process holds
    it. Keyed by the port alone: 0.0.0.0:8000 and 127.0.0.1:8000 cannot both bind, and the
    second must fail before it builds an engine. Port 0 (any free port) is never shared, so
    it takes no lock."""
    if port == 0:
        yield
        return
    path = lock_path(port)
    fd = _lock(path, f"{host}:{port}")
    try:
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)  # releases the lock


def _lock(path: Path, where: str) -> int:
    """An fd holding the exclusive lock on the file `path` names now."""
    deadline = time.monotonic() + RETRY_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.05)  # perhaps a reclaimer, which lets go at once
                continue
            raise ConfigError(
                f"another ragcache serve process already serves {where}: one process owns the "
                "engine (run one server with one worker; scale with more GPUs, not more "
                "workers)"
            ) from None
        if _names(path, fd):
            return fd
        os.close(fd)  # the owner removed this file as we locked it: lock the new one


def reclaim_locks(folder: Path | None = None) -> list[Path]:
    """Remove the lock files in `folder` (default: `shm_folder()`) that no process holds;
    returns them. A held lock (a running server) is left alone."""
    removed = []
    for path in sorted((folder or shm_folder()).glob(LOCK_GLOB)):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # held: its server runs
        try:
            if _names(path, fd):
                path.unlink()
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def _names(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open on `fd`."""
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


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
