"""Capacity arithmetic: bytes <-> tokens <-> slots.

A slot is one page of `page_size` tokens holding K and V of every layer; a node of n tokens
owns ceil(n / page_size) slots (its last page may be partly used).
"""

from __future__ import annotations

from ragcache_core.errors import ConfigError


def kv_bytes_per_token(
    *, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
) -> int:
    """Bytes of K and V for one token across all layers."""
    for name, value in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
        if value <= 0:
            raise ConfigError(f"{name} must be positive, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def tokens_for_bytes(num_bytes: int, bytes_per_token: int) -> int:
    """How many whole tokens of KV fit in `num_bytes` (rounded down)."""
    if bytes_per_token <= 0:
        raise ConfigError(f"bytes_per_token must be positive, got {bytes_per_token}")
    if num_bytes < 0:
        raise ConfigError(f"a capacity cannot be negative, got {num_bytes} bytes")
    return num_bytes // bytes_per_token


def bytes_for_tokens(num_tokens: int, bytes_per_token: int) -> int:
    """Bytes of KV for `num_tokens` tokens."""
    if bytes_per_token <= 0:
        raise ConfigError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return num_tokens * bytes_per_token


def slots_for_tokens(num_tokens: int, page_size: int) -> int:
    """Slots (pages) needed to hold `num_tokens` tokens: ceil(num_tokens / page_size)."""
    if page_size <= 0:
        raise ConfigError(f"page_size must be positive, got {page_size}")
    return -(-num_tokens // page_size)


def slots_in_tokens(capacity_tokens: int, page_size: int) -> int:
    """Whole slots that fit in a capacity of `capacity_tokens` tokens (rounded down)."""
    if page_size <= 0:
        raise ConfigError(f"page_size must be positive, got {page_size}")
    if capacity_tokens < 0:
        raise ConfigError(f"a capacity cannot be negative, got {capacity_tokens} tokens")
    return capacity_tokens // page_size
