"""The LlamaIndex versions this integration supports (checked before anything imports it)."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet

from ragcache_integrations._versions import UnsupportedFrameworkError
from ragcache_integrations._versions import check_version as _check_version

DISTRIBUTION = "llama-index-core"
SUPPORTED = SpecifierSet(">=0.14,<0.15")

__all__ = ["DISTRIBUTION", "SUPPORTED", "UnsupportedFrameworkError", "check_version"]


def check_version(distribution: str = DISTRIBUTION, supported: SpecifierSet = SUPPORTED) -> str:
    """The installed version of `distribution`; `UnsupportedFrameworkError` when it is missing
    or outside `supported`."""
    return _check_version(distribution, supported, "ragcache_integrations.llama_index")
