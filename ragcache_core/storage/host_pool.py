"""The host KV pool: a tensor in shared memory, created by the app, mapped by the worker.

The app creates the pool (a file on a tmpfs, `/dev/shm` on Linux) and passes its name to the
engine; the worker-side connector maps the same pages. Because the app owns the file, the
pool and its contents survive an engine (worker) restart: the next worker maps it again
(docs/design.md 2.6, 3.1). A sidecar `<file>.json` records the layout, so a worker never maps a
pool written for another model or page size.

    app process                          vLLM worker process
    HostPool.create(name, layout, n) ──► HostPool.attach(name, layout, n)
          │ owns the file, unlinks it          maps it (MAP_SHARED); on CUDA also
          ▼ on close()                         pins it with cudaHostRegister
    /dev/shm/ragcache-<name>  [n, L, 2, P, H, D]
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ragcache_core.errors import ConfigError
from ragcache_core.storage.memory import available_host_bytes, check_fits, free_bytes_at
from ragcache_core.storage.pool_layout import PoolLayout

if TYPE_CHECKING:
    import torch

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


def shm_folder() -> Path:
    """Where shared-memory pools live: `/dev/shm` when present, else the temp folder."""
    dev_shm = Path("/dev/shm")
    return dev_shm if dev_shm.is_dir() else Path(tempfile.gettempdir())


def pool_path(name: str) -> Path:
    if not _NAME.match(name):
        raise ConfigError(
            f"host pool name {name!r} must be 1-100 characters of letters, digits, '_', '-', '.'"
        )
    return shm_folder() / f"ragcache-{name}"


class HostPool:
    """A mapped host pool: `tensor` is [num_slots, L, 2, P, H, D] on the CPU.

    Create with `HostPool.create` (app) or `HostPool.attach` (worker). Not thread-safe; the
    data plane is its only writer. `close()` unmaps; `unlink()` (the creator's job) removes
    the file, after which no new process can attach.
    """

    def __init__(self, name: str, layout: PoolLayout, num_slots: int, tensor: torch.Tensor):
        self.name = name
        self.layout = layout
        self.num_slots = num_slots
        self.tensor = tensor  # [num_slots, L, 2, P, H, D]

    @property
    def path(self) -> Path:
        return pool_path(self.name)

    @property
    def nbytes(self) -> int:
        return self.layout.pool_bytes(self.num_slots)

    @classmethod
    def create(
        cls, name: str, layout: PoolLayout, num_slots: int, *, reuse: bool = True
    ) -> HostPool:
        """Create (or, with `reuse`, re-open an existing compatible) pool file.

        Reserves the memory up front (`posix_fallocate` on a tmpfs), so an oversized pool is
        refused now with the numbers (`ConfigError`) rather than failing later. An existing
        file with another layout or size is replaced. Contents of a reused pool are kept (that
        is what lets KV outlive an engine restart); the caller decides what is valid in it.
        """
        if num_slots < 0:
            raise ConfigError(f"host pool: num_slots cannot be negative, got {num_slots}")
        path = pool_path(name)
        wanted = layout.pool_bytes(num_slots)
        if reuse and _matches(path, layout, num_slots):
            return cls.attach(name, layout, num_slots)
        _remove(path)
        hint = "lower the host pool size (host_pool_gib)"
        check_fits(f"host KV pool {name!r}", wanted, available_host_bytes(), hint)
        check_fits(
            f"host KV pool {name!r} on {path.parent}", wanted, free_bytes_at(path.parent), hint
        )
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if wanted:
                try:
                    os.posix_fallocate(fd, 0, wanted)
                except OSError as exc:
                    _remove(path)
                    raise ConfigError(
                        f"host KV pool {name!r}: cannot reserve {wanted} bytes on "
                        f"{path.parent} ({exc.strerror})"
                    ) from exc
        finally:
            os.close(fd)
        _sidecar(path).write_text(json.dumps({"layout": layout.to_json(), "num_slots": num_slots}))
        return cls.attach(name, layout, num_slots)

    @classmethod
    def attach(cls, name: str, layout: PoolLayout, num_slots: int) -> HostPool:
        """Map an existing pool. Raises `ConfigError` if it is missing or was created with
        another layout or size."""
        import torch

        path = pool_path(name)
        if not _matches(path, layout, num_slots):
            raise ConfigError(
                f"host KV pool {name!r} at {path} is missing or has another layout/size "
                f"than expected ({num_slots} slots of {layout.to_json()})"
            )
        shape = layout.pool_shape(num_slots)
        numel = num_slots * layout.slot_numel
        dtype = getattr(torch, layout.dtype)
        if numel == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            # shared=True maps the file MAP_SHARED: writes are seen by every process mapping it.
            tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(shape)
        return cls(name, layout, num_slots, tensor)

    @staticmethod
    def exists(name: str, layout: PoolLayout, num_slots: int) -> bool:
        """Whether a pool with exactly this layout and size already exists (is reusable)."""
        return _matches(pool_path(name), layout, num_slots)

    def close(self) -> None:
        """Drop this process's mapping (the file stays)."""
        import torch

        self.tensor = torch.empty(0)

    def unlink(self) -> None:
        """Remove the pool file (the creator calls this when the cache closes)."""
        self.close()
        _remove(pool_path(self.name))


def remove_pool(name: str) -> None:
    """Remove the pool file of `name` and its sidecar, if present (no process may attach
    afterwards; processes that mapped it keep their mapping)."""
    _remove(pool_path(name))


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _matches(path: Path, layout: PoolLayout, num_slots: int) -> bool:
    try:
        meta = json.loads(_sidecar(path).read_text())
        size = path.stat().st_size
    except (OSError, json.JSONDecodeError):
        return False
    return (
        meta.get("layout") == layout.to_json()
        and meta.get("num_slots") == num_slots
        and size == layout.pool_bytes(num_slots)
    )


def _remove(path: Path) -> None:
    for p in (path, _sidecar(path)):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
