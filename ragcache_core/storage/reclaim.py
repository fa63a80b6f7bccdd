"""Shared memory a crash left behind: found, and removed.

Two kinds of files in the shared-memory folder (`shm_folder()`, /dev/shm on Linux) outlive a
process that was killed (SIGKILL, the OOM killer), and hold RAM until someone removes them:

    ragcache-<pid>-<8 hex>, .json   a RAGCache host pool and its sidecar, named after the
                                    process that created it (runtime/assembly.py): removed
                                    when that process is gone (a zombie counts as gone)
    psm_<hex>                       a Python `SharedMemory` segment (vLLM's message queues
                                    between the engine core and its workers; ~160 MiB each):
                                    no owner in the name, so removed when no process has it
                                    open or mapped (read off /proc/<pid>/fd and /maps, listed
                                    after the folder, so a segment being created is seen)

Only files of this user are considered, and a pool whose owner still runs is never touched,
mapped or not. Without /proc (not Linux) only the pools are judged. Nothing here imports
torch or vLLM: the server's watchdog (serve/watchdog.py) runs it too.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ragcache_core.storage.host_pool import shm_folder

_POOL = re.compile(r"^ragcache-(\d+)-[0-9a-f]{8}(\.json)?$")
_SEGMENT = re.compile(r"^psm_[0-9A-Za-z]+$")
PROC = Path("/proc")


@dataclass(frozen=True)
class Reclaimed:
    """What one reclaim removed."""

    pools: tuple[Path, ...] = ()
    """Host pool files and sidecars of processes that are gone."""
    segments: tuple[Path, ...] = ()
    """`SharedMemory` segments no process has open or mapped."""
    nbytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.pools or self.segments)


def reclaim_shared_memory(folder: Path | None = None) -> Reclaimed:
    """Remove the leftovers in `folder` (default: `shm_folder()`; module docstring)."""
    folder = folder or shm_folder()
    mine = [p for p in _entries(folder) if _owned(p)]
    pools = [p for p in mine if _dead_owner(p)]
    candidates = [p for p in mine if _SEGMENT.match(p.name)]
    segments = _unused(candidates) if candidates and PROC.is_dir() else []
    removed: list[Path] = []
    nbytes = 0
    for path in [*pools, *segments]:
        with contextlib.suppress(OSError):
            size = path.stat().st_size
            path.unlink()
            removed.append(path)
            nbytes += size
    kept = set(removed)
    return Reclaimed(
        pools=tuple(p for p in pools if p in kept),
        segments=tuple(p for p in segments if p in kept),
        nbytes=nbytes,
    )


def process_running(pid: int) -> bool:
    """Whether `pid` names a running process (not gone, not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's: running
    return _state(pid) not in ("Z", "X", None) if PROC.is_dir() else True


def _state(pid: int) -> str | None:
    """The process state letter of `pid` from /proc (None when it is gone)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]


def _entries(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.is_file())
    except OSError:
        return []


def _owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def _dead_owner(path: Path) -> bool:
    match = _POOL.match(path.name)
    return match is not None and not process_running(int(match.group(1)))


def _unused(segments: list[Path]) -> list[Path]:
    """The `segments` no process has open or mapped."""
    wanted = {str(p) for p in segments}
    used: set[str] = set()
    for pid_dir in _process_dirs():
        used.update(_open_paths(pid_dir, wanted))
        if used >= wanted:
            break
    return [p for p in segments if str(p) not in used]


def _process_dirs() -> Iterator[Path]:
    with contextlib.suppress(OSError):
        for entry in PROC.iterdir():
            if entry.name.isdigit():
                yield entry


def _open_paths(pid_dir: Path, wanted: set[str]) -> Iterable[str]:
    """Which of `wanted` the process of `pid_dir` has open (fd) or mapped."""
    found = set()
    with contextlib.suppress(OSError):  # the process ended, or is not ours to read
        for fd in (pid_dir / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target in wanted:
                    found.add(target)
        for line in (pid_dir / "maps").read_text().splitlines():
            parts = line.split(maxsplit=5)  # address, perms, offset, device, inode, path
            if len(parts) == 6 and parts[5] in wanted:
                found.add(parts[5])
    return found
