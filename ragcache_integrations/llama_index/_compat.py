"""The LlamaIndex versions this integration supports, checked before anything imports it.

An unsupported `llama-index-core` tends to fail deep inside an import with a message about some
renamed class; checking the installed distribution first turns that into one clear line.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ragcache_core.errors import ConfigError

DISTRIBUTION = "llama-index-core"
SUPPORTED = SpecifierSet(">=0.14,<0.15")


class UnsupportedFrameworkError(ConfigError, ImportError):
    """The installed framework is missing or outside the supported range (raised at import)."""


def check_version(distribution: str = DISTRIBUTION, supported: SpecifierSet = SUPPORTED) -> str:
    """Return the installed version of `distribution`; raise `UnsupportedFrameworkError` when it
    is not installed or not in `supported`. Reads the installed metadata only (no import)."""
    hint = f'pip install "{distribution}{supported}"'
    try:
        installed = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise UnsupportedFrameworkError(
            f"ragcache_integrations.llama_index needs {distribution}{supported}, which is not "
            f"installed: {hint}"
        ) from None
    try:
        ok = Version(installed) in supported
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedFrameworkError(
            f"ragcache_integrations.llama_index supports {distribution}{supported}, but "
            f"{installed} is installed: {hint}"
        )
    return installed
