"""`ragcache bench copies` on the tiny model's shapes (CPU: vLLM's write kernel, no engine):
the function and the command as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ragcache_core.bench.copies import measure


def _expected_copies() -> tuple[str, str]:
    """(the device kind, the copy implementation) this machine must use, from the device:
    Triton kernels on CUDA when Triton imports, torch indexing everywhere else."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", "TorchCopyOps"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "cuda", "TorchCopyOps"
    return "cuda", "TritonCopyOps"


def test_copies_benchmark_reports_every_page_size(tiny_model: Path) -> None:
    report = measure(str(tiny_model), tokens=96, span=40, page_sizes=(4, 16), repeats=1)
    assert [r["page_size"] for r in report["results"]] == [4, 16]
    for row in report["results"]:
        assert row["tokens"] == 96 and row["load_ms"] > 0 and row["store_gbps"] > 0
    kind, copies = _expected_copies()
    assert report["ceiling_copy_gbps"] > 0 and report["copies"] == copies
    assert report["device"].split()[0] == kind


def test_the_command_prints_one_row_per_page_size(tiny_model: Path) -> None:
    """`ragcache bench copies` as documented: the table names the device, the copy
    implementation and one row per page size (`--json` prints `measure`'s document)."""
    args = ["--model", str(tiny_model), "--tokens", "96", "--span", "40", "--repeats", "1"]
    args += ["--page-sizes", "4", "16"]
    command = [sys.executable, "-m", "ragcache_core", "bench", "copies", *args]
    table = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert table.returncode == 0, table.stderr[-3000:]
    kind, copies = _expected_copies()
    lines = table.stdout.strip().splitlines()
    assert lines[0].startswith(kind) and f", {copies}, float32," in lines[0], lines[0]
    assert lines[1].startswith("ceiling (torch copy_ of the same bytes): ")
    assert lines[2].split() == ["page", "load", "ms", "GB/s", "store", "ms", "GB/s"]
    rows = [line.split() for line in lines[3:]]
    assert [row[0] for row in rows] == ["4", "16"]
    for _, load_ms, load_gbps, store_ms, store_gbps in rows:  # the tiny model's GB/s: ~0.01
        assert float(load_ms) > 0 and float(store_ms) > 0, rows
        assert float(load_gbps) >= 0 and float(store_gbps) >= 0, rows
