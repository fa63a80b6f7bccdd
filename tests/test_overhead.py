"""The overhead benchmark runs and reports sane numbers (small sizes; the real figures
come from `ragcache bench overhead`)."""

from __future__ import annotations

import json

import pytest

from ragcache_core.bench.overhead import measure
from ragcache_core.cli import main


def test_measure_fills_the_cache_and_times_requests() -> None:
    result = measure(nodes=800, requests=200)
    assert result.nodes >= 800
    assert 0 < result.p50_us <= result.p99_us <= result.max_us
    assert result.p50_us < 10_000  # 10 ms would mean something is badly wrong


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", "--nodes", "300", "--requests", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["requests"] for r in out["results"]] == [50]
