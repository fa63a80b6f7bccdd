"""Policies by name: `make_policy("dgdsf")`. Adding a policy = one class + one line here."""

from __future__ import annotations

from ragcache_core.errors import ConfigError
from ragcache_core.policy.adaptive import AdaptivePGDSF
from ragcache_core.policy.arc import ARC
from ragcache_core.policy.base import EvictionPolicy
from ragcache_core.policy.policies import DGDSF, GDSF, LFU, LRU, PGDSF

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (DGDSF, PGDSF, GDSF, LRU, LFU, ARC, AdaptivePGDSF)
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy instance (each cache owns its own state). Raises `ConfigError`."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown replacement policy {name!r}; choose one of {', '.join(POLICIES)}"
        ) from None
