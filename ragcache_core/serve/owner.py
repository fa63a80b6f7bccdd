"""One server process owns the engine: a second process for the same port (another uvicorn
worker, a second `ragcache serve`) is refused at startup, before it starts an engine.

The lock is an exclusive `flock` on a file beside the host pools (`/dev/shm` on Linux); the
kernel drops it when the process ends, however it ends, so a crash never leaves it held. The
owner removes the file when it stops (while still holding the lock); a process that locked a
file just removed that way sees that the path no longer names its file and tries again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from ragcache_core.errors import ConfigError
from ragcache_core.storage.host_pool import shm_folder


@contextlib.contextmanager
def sole_owner(host: str, port: int) -> Iterator[None]:
    """Hold the engine lock of `port` for the block; `ConfigError` if another process holds
    it. Keyed by the port alone: 0.0.0.0:8000 and 127.0.0.1:8000 cannot both bind, and the
    second must fail before it builds an engine. Port 0 (any free port) is never shared, so
    it takes no lock."""
    if port == 0:
        yield
        return
    path = shm_folder() / f"ragcache-serve-port-{port}.lock"
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
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"another ragcache serve process already serves {where}: one process owns the "
                "engine (run one server with one worker; scale with more GPUs, not more "
                "workers)"
            ) from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the owner removed this file as we locked it: lock the new one
