"""scripts/gpu_projection.py on a tiny trace: one row per rate, each system's TTFT, and a
stream that repeats its documents makes RAGCache faster than vLLM without prefix caching."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ragcache_core.trace import TraceRequest, write_trace

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_projection.py"


def test_one_row_per_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("gpu_projection", SCRIPT)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    requests = [
        TraceRequest(f"q{i}", float(i), (f"d{i % 5}", f"e{i % 3}"), (400, 300), 20)
        for i in range(60)
    ]
    trace = tmp_path / "tiny.jsonl"
    write_trace(trace, requests)
    sys.argv = ["gpu_projection.py", str(trace), "--load", "0.5", "0.9"]
    script.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[4]) > 1.0  # vLLM / RAGCache: the repeats are hits
        ragcache, vllm, sglang = (float(ms) for ms in cells[3].split(" / "))
        assert ragcache < vllm and sglang < vllm
