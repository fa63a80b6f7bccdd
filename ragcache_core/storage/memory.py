"""How much memory a pool may take, and refusing pools that do not fit (with the numbers)."""

from __future__ import annotations

import os
from pathlib import Path

from ragcache_core.errors import ConfigError

GIB = 1024**3


def available_host_bytes() -> int:
    """Memory the OS can still give without swapping (`MemAvailable`), in bytes."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE"))


def free_bytes_at(folder: str | Path) -> int:
    """Free space of the file system holding `folder` (a tmpfs for shared memory)."""
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def check_fits(what: str, wanted_bytes: int, available_bytes: int, hint: str = "") -> None:
    """Raise `ConfigError` naming both sizes when `wanted_bytes > available_bytes`."""
    if wanted_bytes > available_bytes:
        message = (
            f"{what} needs {wanted_bytes / GIB:.2f} GiB ({wanted_bytes} bytes) but only "
            f"{available_bytes / GIB:.2f} GiB ({available_bytes} bytes) are available"
        )
        raise ConfigError(f"{message}; {hint}" if hint else message)
