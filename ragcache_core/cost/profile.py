"""Prefill-time profiles: T(cached alpha, new beta) measured on a grid, stored as JSON.

File format (written by `ragcache profile`, read by `CostProfile.load`):

    {
      "format": "ragcache-cost-profile/1",
      "model": "meta-llama/Llama-2-7b-hf",       # what was measured
      "hardware": "1x NVIDIA A10G",               # where
      "cached_tokens": [0, 512, 2048],            # alpha grid, strictly increasing, >= 2 values
      "new_tokens": [16, 256, 1024],              # beta grid, strictly increasing, >= 2 values
      "prefill_s": [[...], [...], [...]],         # prefill_s[i][j] = T(cached_tokens[i],
                                                  #                     new_tokens[j]) in seconds
      "kv_bytes_per_token": 524288,               # optional: KV bytes of one token, and the
      "copy_bytes_per_s": 1.2e10                  # host <-> GPU copy rate (`CopyCost`; absent:
    }                                             # copies are not timed)
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_core.errors import ConfigError, InputError

PROFILE_FORMAT = "ragcache-cost-profile/1"


@dataclass(frozen=True, slots=True)
class CopyCost:
    """Time to copy KV between the host tier and the GPU (loads and stores): its bytes over
    `bytes_per_s`. 0 bytes per token or 0 bytes/s: copies take no time."""

    kv_bytes_per_token: int = 0
    bytes_per_s: float = 0.0

    def seconds(self, tokens: int) -> float:
        if not self.bytes_per_s:
            return 0.0
        return tokens * self.kv_bytes_per_token / self.bytes_per_s


@dataclass(frozen=True, slots=True)
class CostProfile:
    """A grid of measured prefill times, and optionally the copy rate between host and GPU
    (`copy_cost`). Validated on construction (raises `ConfigError`)."""

    model: str
    hardware: str
    cached_tokens: tuple[int, ...]
    new_tokens: tuple[int, ...]
    prefill_s: tuple[tuple[float, ...], ...]
    kv_bytes_per_token: int = 0
    copy_bytes_per_s: float = 0.0

    @property
    def copy_cost(self) -> CopyCost:
        return CopyCost(self.kv_bytes_per_token, self.copy_bytes_per_s)

    def __post_init__(self) -> None:
        for name, axis in (("cached_tokens", self.cached_tokens), ("new_tokens", self.new_tokens)):
            if len(axis) < 2:
                raise ConfigError(f"cost profile: {name} needs at least 2 grid points")
            if any(b <= a for a, b in itertools.pairwise(axis)):
                raise ConfigError(f"cost profile: {name} must be strictly increasing")
            if axis[0] < 0:
                raise ConfigError(f"cost profile: {name} cannot be negative")
        if len(self.prefill_s) != len(self.cached_tokens) or any(
            len(row) != len(self.new_tokens) for row in self.prefill_s
        ):
            raise ConfigError(
                "cost profile: prefill_s must be a "
                f"{len(self.cached_tokens)} x {len(self.new_tokens)} grid "
                "(one row per cached_tokens value)"
            )
        if any(not math.isfinite(t) or t < 0 for row in self.prefill_s for t in row):
            raise ConfigError("cost profile: prefill_s values must be finite and >= 0")
        if self.kv_bytes_per_token < 0 or not 0 <= self.copy_bytes_per_s < math.inf:
            raise ConfigError("cost profile: kv_bytes_per_token and copy_bytes_per_s are >= 0")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "hardware": self.hardware,
            "cached_tokens": list(self.cached_tokens),
            "new_tokens": list(self.new_tokens),
            "prefill_s": [list(row) for row in self.prefill_s],
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "copy_bytes_per_s": self.copy_bytes_per_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostProfile:
        """Parse the JSON form. Raises `InputError` naming the missing/bad field."""
        if data.get("format") != PROFILE_FORMAT:
            raise InputError(
                f"cost profile: expected format {PROFILE_FORMAT!r}, got {data.get('format')!r}"
            )
        try:
            return cls(
                model=str(data["model"]),
                hardware=str(data["hardware"]),
                cached_tokens=tuple(int(x) for x in data["cached_tokens"]),
                new_tokens=tuple(int(x) for x in data["new_tokens"]),
                prefill_s=tuple(tuple(float(t) for t in row) for row in data["prefill_s"]),
                kv_bytes_per_token=int(data.get("kv_bytes_per_token", 0)),
                copy_bytes_per_s=float(data.get("copy_bytes_per_s", 0.0)),
            )
        except KeyError as exc:
            raise InputError(f"cost profile: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise InputError(str(exc)) from exc
            raise InputError(f"cost profile: malformed grid ({exc})") from exc

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise InputError(f"cannot read cost profile {path}: {exc.strerror}") from exc
        except json.JSONDecodeError as exc:
            raise InputError(f"cost profile {path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InputError(f"cost profile {path}: expected a JSON object")
        return cls.from_json(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
