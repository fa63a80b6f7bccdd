"""The connector's report on one finished request (what was loaded, whether stores ran).

Built by the scheduler-side connector in `request_finished` and returned to the app inside
`RequestOutput.kv_transfer_params[RESULT_KEY]`. The app reads it to count hits per tier and to
decide what to confirm (see docs/data-plane.md, "Outcomes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragcache_core.engine.connector.config import RESULT_KEY


@dataclass(frozen=True, slots=True)
class ConnectorResult:
    """Outcome of one request's plan.

    `loaded_tokens` prompt tokens were served from the pools (`gpu_tokens` + `host_tokens`);
    the rest were computed. `stored` says the store ran in the step that completed the prompt
    (so, once the request has produced a token, its stores hold the prompt's KV).
    `failed_load_spans` lists load spans whose copy failed (vLLM recomputed from the block
    holding the failed span's first token). `rejected` lists why a plan was ignored (then
    nothing was copied at all).
    """

    loaded_tokens: int = 0
    gpu_tokens: int = 0
    host_tokens: int = 0
    stored: bool = False
    failed_load_spans: tuple[int, ...] = ()
    rejected: tuple[str, ...] = ()

    @property
    def load_failed(self) -> bool:
        return bool(self.failed_load_spans)

    def to_json(self) -> dict[str, Any]:
        return {
            "loaded_tokens": self.loaded_tokens,
            "gpu_tokens": self.gpu_tokens,
            "host_tokens": self.host_tokens,
            "stored": self.stored,
            "failed_load_spans": list(self.failed_load_spans),
            "rejected": list(self.rejected),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ConnectorResult:
        return cls(
            loaded_tokens=int(data["loaded_tokens"]),
            gpu_tokens=int(data["gpu_tokens"]),
            host_tokens=int(data["host_tokens"]),
            stored=bool(data["stored"]),
            failed_load_spans=tuple(int(i) for i in data["failed_load_spans"]),
            rejected=tuple(str(p) for p in data["rejected"]),
        )

    @classmethod
    def from_transfer_params(cls, params: dict[str, Any] | None) -> ConnectorResult:
        """The report inside a `RequestOutput.kv_transfer_params`; an empty result (nothing
        loaded or stored) when the request carried no plan."""
        if not params or RESULT_KEY not in params:
            return cls()
        return cls.from_json(params[RESULT_KEY])
