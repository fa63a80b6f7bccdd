"""Policies by name: `make_policy("dgdsf")`. Adding a policy = one class + one line here."""

from __future__ import annotations

from ragcache_core.config import refuse_removed_policy
from ragcache_core.errors import ConfigError
from ragcache_core.policy.arc import ARC
from ragcache_core.policy.base import EvictionPolicy
from ragcache_core.policy.policies import DGDSF, GDSF, LFU, LRU, PGDSF

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (DGDSF, PGDSF, GDSF, LRU, LFU, ARC)
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance (each cache owns its own state). Raises `ConfigError` (a
    removed policy's names the default)."""
    cls = POLICIES.get(name)
    if cls is None:
        refuse_removed_policy(name)
        raise ConfigError(
            f"unknown replacement policy {name!r}; choose one of {', '.join(POLICIES)}"
        )
    return cls()
