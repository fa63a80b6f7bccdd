"""API keys of `ragcache serve`, and the tenants they belong to (`--api-key-file`).

The key file has one key per line, optionally followed by whitespace and a tenant name;
blank lines and lines starting with `#` are ignored:

    # key                              tenant
    sk-team-a-7f3c9e                   team-a
    sk-team-a-ci-21b0                  team-a
    sk-team-b-c81d                     team-b
    sk-lone-5e2a

Several keys may name one tenant (they share its cache). A key without a name is a tenant of
its own, named by a hash of the key (never the key itself). With `--salt-per-key`, every
request is salted with its tenant: it hits only KV its own tenant stored (docs/deploy.md,
"Tenants"). A key may not appear twice, nor contain whitespace.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ragcache_core.errors import ConfigError


@dataclass(frozen=True)
class ApiKey:
    """One accepted bearer key and its tenant's name."""

    key: str
    tenant: str

    def __post_init__(self) -> None:
        if not self.key or any(c.isspace() for c in self.key):
            raise ConfigError("an API key must be non-empty and hold no whitespace")
        if not self.tenant:
            raise ConfigError("a tenant name cannot be empty")

    @classmethod
    def unnamed(cls, key: str) -> ApiKey:
        """A key that is a tenant of its own (named by a hash of it)."""
        return cls(key, "key-" + hashlib.sha256(key.encode()).hexdigest()[:12])

    def __repr__(self) -> str:  # never print the key
        return f"ApiKey(tenant={self.tenant!r})"


def read_key_file(path: Path) -> tuple[ApiKey, ...]:
    """The keys of a key file (format in the module docstring). Raises `ConfigError` naming
    the line of a malformed entry, a repeated key, or a file with no key."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc}") from None
    keys: list[ApiKey] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ConfigError(
                f"{path}:{number}: expected '<key> [tenant]', got {len(fields)} fields"
            )
        key = fields[0]
        if key in seen:
            raise ConfigError(f"{path}:{number}: this key appears twice")
        seen.add(key)
        keys.append(ApiKey(key, fields[1]) if len(fields) == 2 else ApiKey.unnamed(key))
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key")
    return tuple(keys)
