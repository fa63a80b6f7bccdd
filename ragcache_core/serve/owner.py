"""The engine lock: one `ragcache serve` process per port, and the stale locks a crash left.

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
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ragcache_core.errors import ConfigError
from ragcache_core.storage.host_pool import shm_folder

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
