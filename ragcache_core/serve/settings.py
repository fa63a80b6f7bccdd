"""`ServeSettings`: everything one `ragcache serve` process is started with (frozen).

The app is built from these by `app.create_app(settings)`; nothing is read from globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ragcache_core.config import CacheConfig
from ragcache_core.errors import ConfigError

DEFAULT_MAX_WAITING = 64
"""Requests that may wait beyond the engine's `max_num_seqs` running ones before 429."""


@dataclass(frozen=True)
class ServeSettings:
    """One server: the model, its cache settings, where it listens, how it sheds load.

    - `index`: a folder written by `ragcache index`, searched by `/v1/rag/query` (None: that
      route needs `documents`).
    - `api_key`: when set, every `/v1/...` route wants `Authorization: Bearer <key>` (401
      otherwise); `/health` and `/metrics` stay open for probes, as in `vllm serve`.
    - `served_model_name`: the name in `/v1/models` and the `model` field requests must use
      (None: `model` as given, as `vllm serve` does).
    - `max_waiting`: in flight at most `config.max_num_seqs + max_waiting` requests (running
      plus waiting in RAGCache's reordering queue); past it a request gets 429 with
      Retry-After at once, so the backlog is bounded.
    - `drain_timeout_s`: on SIGTERM/SIGINT the server stops accepting and waits this long for
      requests in flight, then cancels the rest, then closes the engine and the shared memory.
    """

    model: str
    config: CacheConfig = field(default_factory=CacheConfig)
    index: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_waiting: int = DEFAULT_MAX_WAITING
    drain_timeout_s: float = 30.0
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ConfigError(f"max_waiting cannot be negative, got {self.max_waiting}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"drain_timeout_s cannot be negative, got {self.drain_timeout_s}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0-65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key cannot be empty (omit it to serve without a key)")

    @property
    def model_name(self) -> str:
        """The name clients use in `model`."""
        return self.served_model_name or self.model
