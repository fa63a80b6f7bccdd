"""What the RAGCache connector is told at engine start, and the keys it reads/writes per request.

The app builds a `ConnectorConfig` and passes it through vLLM's `KVTransferConfig` (see
`kv_transfer_config()`); both connector roles rebuild it from `kv_connector_extra_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragcache_core.errors import ConfigError
from ragcache_core.storage.pool_layout import PoolLayout

CONNECTOR_CLASS = "RAGCacheConnector"
CONNECTOR_MODULE = "ragcache_core.engine.connector"
EXTRA_KEY = "ragcache"

RESULT_KEY = "ragcache_result"
"""Key of the connector's per-request report in `RequestOutput.kv_transfer_params`."""

FAULT_KEY = "ragcache_inject_fault"
"""Test hook in a request's `kv_transfer_params`: `{"fail_load_span": i}` makes the worker
raise while copying load span i (after spans < i were copied), exercising the recovery path
exactly as a real copy failure would; `{"fail_host_write": true}` makes every eviction-time copy
of the request's kept documents fail after writing its slots (a failed copy is never read);
`{"kill_host_write": true}` makes the worker write the first half of the step's eviction-time
copies when one of them is of the request's kept documents, then SIGKILL its own process: the
engine dies mid-copy, with torn slots no report names."""

HOST_WRITES = ("compute", "eviction")
"""When the host tier is written: as a document is computed (write-through, plans' `store`) or
as it leaves vLLM's blocks (plans' `keep`, the connector's window; docs/design.md 2.2)."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The host pool's size and layout. `host_slots == 0` means no host tier (no shared-memory
    file). There is no GPU pool: the GPU tier is vLLM's own KV cache (docs/design.md 3.1).
    `host_write` is `CacheConfig.host_write`; with "eviction" the scheduler side copies a kept
    document when vLLM hands one of its blocks out (`handout`, `CacheConfig.host_write_at_handout`),
    and with a look-ahead watches the first `window_blocks` blocks of vLLM's free queue every
    step, `back_to_head` putting the blocks it held back at the queue's head
    (`CacheConfig.host_write_return`)."""

    layout: PoolLayout
    host_slots: int = 0
    host_pool_name: str = ""
    host_write: str = "compute"
    window_blocks: int = 0
    back_to_head: bool = False
    handout: bool = True

    def __post_init__(self) -> None:
        if self.host_slots < 0:
            raise ConfigError(f"the host pool size cannot be negative, got {self.host_slots}")
        if self.host_slots and not self.host_pool_name:
            raise ConfigError("a host pool needs a name (host_pool_name)")
        if self.host_write not in HOST_WRITES:
            raise ConfigError(
                f"unknown host_write {self.host_write!r}; choose one of {', '.join(HOST_WRITES)}"
            )
        if self.window_blocks < 0:
            raise ConfigError(f"the window cannot be negative, got {self.window_blocks} blocks")

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def to_extra_config(self) -> dict[str, Any]:
        return {
            EXTRA_KEY: {
                "layout": self.layout.to_json(),
                "host_slots": self.host_slots,
                "host_pool_name": self.host_pool_name,
                "host_write": self.host_write,
                "window_blocks": self.window_blocks,
                "back_to_head": self.back_to_head,
                "handout": self.handout,
            }
        }

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        if not extra or EXTRA_KEY not in extra:
            raise ConfigError(
                f"the RAGCache connector needs kv_connector_extra_config[{EXTRA_KEY!r}]"
            )
        data = extra[EXTRA_KEY]
        return cls(
            layout=PoolLayout.from_json(data["layout"]),
            host_slots=int(data["host_slots"]),
            host_pool_name=str(data["host_pool_name"]),
            host_write=str(data.get("host_write", "compute")),
            window_blocks=int(data.get("window_blocks", 0)),
            back_to_head=bool(data.get("back_to_head", False)),
            handout=bool(data.get("handout", True)),
        )

    def kv_transfer_config(self) -> dict[str, Any]:
        """Keyword arguments of vLLM's `KVTransferConfig` that load this connector.

        Load failures are recomputed by vLLM (`kv_load_failure_policy="recompute"`), so a
        failed copy costs time, never correctness.
        """
        return {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": self.to_extra_config(),
        }
