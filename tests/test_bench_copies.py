"""`ragcache bench copies` on the tiny model's shapes (CPU: vLLM's write kernel, no engine)."""

from __future__ import annotations

from pathlib import Path

from ragcache_core.bench.copies import measure


def test_copies_benchmark_reports_every_page_size(tiny_model: Path) -> None:
    report = measure(str(tiny_model), tokens=96, span=40, page_sizes=(4, 16), repeats=1)
    assert [r["page_size"] for r in report["results"]] == [4, 16]
    for row in report["results"]:
        assert row["tokens"] == 96 and row["load_ms"] > 0 and row["store_gbps"] > 0
    assert report["ceiling_copy_gbps"] > 0 and report["copies"] == "TorchCopyOps"
