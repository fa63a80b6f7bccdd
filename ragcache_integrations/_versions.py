"""Framework version checks shared by the integrations, run before anything imports a framework.

An unsupported framework tends to fail deep inside an import with a message about some renamed
class; checking the installed distribution first turns that into one clear line.
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from ragcache_core.errors import ConfigError


class UnsupportedFrameworkError(ConfigError, ImportError):
    """The installed framework is missing or outside the supported range (raised at import)."""


def check_version(distribution: str, supported: SpecifierSet, integration: str) -> str:
    """Return the installed version of `distribution`; raise `UnsupportedFrameworkError` when it
    is not installed or not in `supported`. Reads the installed metadata only (no import)."""
    hint = f'pip install "{distribution}{supported}"'
    try:
        installed = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        raise UnsupportedFrameworkError(
            f"{integration} needs {distribution}{supported}, which is not installed: {hint}"
        ) from None
    try:
        ok = Version(installed) in supported
    except InvalidVersion:
        ok = False
    if not ok:
        raise UnsupportedFrameworkError(
            f"{integration} supports {distribution}{supported}, but {installed} is installed: "
            f"{hint}"
        )
    return installed
