"""Request traces for the simulator: JSON Lines, one request a line.

    {"id": "nq-17", "arrival_s": 3.25, "docs": ["812", "44"], "doc_tokens": [131, 97],
     "question_tokens": 14}

`docs` are document ids in prompt order; `doc_tokens[i]` is the token count of `docs[i]`
(wrapped as it is in the prompt). Blank lines are skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragcache_core.errors import InputError


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    arrival_s: float
    docs: tuple[str, ...]
    doc_tokens: tuple[int, ...]
    question_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "arrival_s": self.arrival_s,
            "docs": list(self.docs),
            "doc_tokens": list(self.doc_tokens),
            "question_tokens": self.question_tokens,
        }


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{what} cannot be negative, got {value}")
    return value


def parse_request(data: Any) -> TraceRequest:
    """One trace record; raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    for field in ("id", "arrival_s", "docs", "doc_tokens", "question_tokens"):
        if field not in data:
            raise ValueError(f"missing field {field!r}")
    docs, doc_tokens = data["docs"], data["doc_tokens"]
    if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
        raise ValueError("'docs' must be a list of document id strings")
    if not isinstance(doc_tokens, list):
        raise ValueError("'doc_tokens' must be a list of integers")
    if len(docs) != len(doc_tokens):
        raise ValueError(f"'docs' has {len(docs)} entries but 'doc_tokens' has {len(doc_tokens)}")
    arrival = data["arrival_s"]
    if isinstance(arrival, bool) or not isinstance(arrival, int | float):
        raise ValueError(f"'arrival_s' must be a number, got {arrival!r}")
    if not math.isfinite(arrival) or arrival < 0:
        raise ValueError(f"'arrival_s' must be finite and >= 0, got {arrival}")
    return TraceRequest(
        id=str(data["id"]),
        arrival_s=float(arrival),
        docs=tuple(docs),
        doc_tokens=tuple(_int(n, f"doc_tokens[{i}]") for i, n in enumerate(doc_tokens)),
        question_tokens=_int(data["question_tokens"], "'question_tokens'"),
    )


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a trace. Raises `InputError` "<path>:<line>: <problem>" for a malformed line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read trace {path}: {exc.strerror}") from exc
    requests = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(parse_request(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
        except ValueError as exc:
            raise InputError(f"{path}:{lineno}: {exc}") from exc
    return requests


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """Write one JSON object per line (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for request in requests:
            out.write(json.dumps(request.to_json(), separators=(",", ":")) + "\n")
