"""One server process owns the engine: a second process for the same port (another uvicorn
worker, a second `ragcache serve`) is refused at startup, before it starts an engine.

The lock is an exclusive `flock` on a file beside the host pools (`/dev/shm` on Linux); the
kernel drops it when the process ends, however it ends, so a crash never leaves it held.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from ragcache_core.errors import ConfigError
from ragcache_core.storage.host_pool import shm_folder


@contextlib.contextmanager
def sole_owner(host: str, port: int) -> Iterator[None]:
    """Hold the engine lock of `host:port` for the block; `ConfigError` if another process
    holds it. Port 0 (any free port) is never shared, so it takes no lock."""
    if port == 0:
        yield
        return
    path = shm_folder() / f"ragcache-serve-{host.replace(':', '_')}-{port}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"another ragcache serve process already serves {host}:{port}: one process "
                "owns the engine (run one server with one worker; scale with more GPUs, not "
                "more workers)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)  # releases the lock
