"""The shape of one KV pool: slots of `page_size` tokens, K and V of every layer.

A pool is one tensor, slot-major so that a slot is one contiguous run of bytes (a GPU<->host
page copy is one contiguous transfer per slot):

    pool: [num_slots, num_layers, 2 (K, V), page_size, num_kv_heads, head_size]

Token t of a node sits in slot `slots[t // page_size]`, row `t % page_size` (see
`ragcache_core.plan.LoadSpan`). Both pools (GPU and host) of one engine share one `PoolLayout`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ragcache_core.errors import ConfigError, ModelError

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """What one slot holds. Immutable; validated on construction (raises `ConfigError`)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    """KV dtype name as torch spells it: "float32", "float16" or "bfloat16"."""
    page_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "page_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"pool layout: {name} must be positive, got {getattr(self, name)}"
                )
        if self.dtype not in _DTYPE_BYTES:
            raise ConfigError(
                f"pool layout: unsupported KV dtype {self.dtype!r} "
                f"(supported: {', '.join(sorted(_DTYPE_BYTES))})"
            )

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def slot_bytes(self) -> int:
        return self.page_size * self.token_bytes

    @property
    def slot_numel(self) -> int:
        return self.slot_bytes // self.dtype_bytes

    def pool_shape(self, num_slots: int) -> tuple[int, int, int, int, int, int]:
        return (num_slots, self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_size)

    def pool_bytes(self, num_slots: int) -> int:
        return num_slots * self.slot_bytes

    def to_json(self) -> dict[str, int | str]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype,
            "page_size": self.page_size,
        }

    @classmethod
    def from_json(cls, data: dict[str, int | str]) -> PoolLayout:
        return cls(
            num_layers=int(data["num_layers"]),
            num_kv_heads=int(data["num_kv_heads"]),
            head_size=int(data["head_size"]),
            dtype=str(data["dtype"]),
            page_size=int(data["page_size"]),
        )


def layout_for_model(model_dir: str | Path, *, dtype: str, page_size: int) -> PoolLayout:
    """The pool layout of a local Hugging Face checkpoint (reads its `config.json`).

    `dtype` is the KV dtype the engine runs with (vLLM's `dtype` when `kv_cache_dtype` is
    "auto"). Raises `ModelError` when the config lacks the attention shape.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read the model config {path}: {exc}") from exc
    config = config.get("text_config", config)
    try:
        num_layers = int(config["num_hidden_layers"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
        head_size = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"model config {path} lacks the attention shape ({exc})") from exc
    return PoolLayout(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        page_size=page_size,
    )
