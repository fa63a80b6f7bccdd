"""`ragcache bench serve --smoke`: the real engines (tiny model), three systems, a few requests
each on the shipped long-chunk sample; the JSON schema, every request answered, the same answer
tokens from every system. `--quick` cut down on the tiny model: its calibrated ladder, repeats
and printed tables. Plus the workloads and the argument checks (no engine)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _runs import EngineRuns

from ragcache_core.bench.serve import Outcome, PointRun, identical_answers, run_point
from ragcache_core.bench.sweep import (
    MODES,
    ablation_groups,
    compare,
    compare_ablations,
    sustained,
    workload_systems,
)
from ragcache_core.bench.systems import ABLATIONS
from ragcache_core.bench.workloads import Request, chunk_articles, load_workload
from ragcache_core.config import SamplingConfig

SYSTEMS = ("vllm", "ragcache-offload-proxy-arc")
"""The smoke run's systems: plain vLLM and the proxy whose policy (ARC) is RAGCache's newest,
so that it serves on the real engine with answers identical to vLLM's. Two, not more: each
system is an engine start (20-40 s here), and the other systems serve on the real engine in
runs the suite has anyway: `ragcache` beside `vllm` in --quick below, `vllm-apc` and
`vllm-apc-total` beside both in `ragcache demo` (tests/test_demo.py: identical answers,
their hits)."""


def _words(text: str) -> int:
    return len(text.split())


def test_chunks_join_paragraphs_of_one_article_up_to_the_target() -> None:
    paragraphs = [
        {"title": "A", "paragraph_index": i, "paragraph_id": f"A::{i}", "context": "w " * 40}
        for i in range(5)
    ] + [{"title": "B", "paragraph_index": 0, "paragraph_id": "B::0", "context": "w " * 10}]
    chunks = chunk_articles(paragraphs, _words, target=100)
    assert [c["paragraph_ids"] for c in chunks] == [
        ["A::0", "A::1", "A::2"],
        ["A::3", "A::4"],
        ["B::0"],
    ]
    assert [c["tokens"] for c in chunks] == [120, 80, 10]


def test_shipped_long_sample_is_small_and_attributed() -> None:
    workload = load_workload("demo", _words)
    data = Path(__file__).resolve().parents[1] / "ragcache_core" / "data"
    size = sum(
        (data / f).stat().st_size for f in ("demo_long_corpus.jsonl", "demo_long_questions.jsonl")
    )
    assert size < 1_000_000
    assert 40 <= len(workload.documents) <= 80 and len(workload.requests) > 300
    assert "demo_long_corpus.jsonl" in (data / "ATTRIBUTION.md").read_text()


def test_noreuse_never_repeats_a_document(shared_data: Path) -> None:
    workload = load_workload("noreuse", _words, data_dir=shared_data)
    ids = [r.documents[0].id for r in workload.requests if r.documents]
    assert len(ids) == len(workload.requests) == len(set(ids)) > 100


def test_sustained_rate_and_claims_need_apart_spreads() -> None:
    def point(system: str, rate: float, mean: float, p95: float) -> dict[str, float | str]:
        return {
            "system": system,
            "rate_rps": rate,
            "ttft_mean_s": mean,
            "ttft_p95_s": p95,
            "throughput_rps": rate,
        }

    points = [
        point("vllm", 1.0, 0.20, 0.4),
        point("vllm", 1.0, 0.22, 0.5),
        point("vllm", 2.0, 0.90, 2.0),
        point("ragcache", 1.0, 0.21, 0.3),
        point("ragcache", 1.0, 0.23, 0.3),
        point("ragcache", 2.0, 0.30, 0.6),
        point("ragcache", 2.0, 0.32, 0.6),
        point("vllm", 2.0, 0.95, 2.5),
        point("vllm", 3.0, 0.30, 0.6),  # below the SLO again, after a miss: does not count
        point("ragcache", 3.0, 0.10, 0.2),  # one run each: no claim however far apart
    ]
    assert sustained(points, slo_s=1.0) == {
        "vllm": {"rate_rps": 1.0, "throughput_rps": 1.0},
        "ragcache": {"rate_rps": 3.0, "throughput_rps": 3.0},
    }
    rows = {r["rate_rps"]: r for r in compare(points)}
    assert not rows[1.0]["spreads_apart"] and rows[2.0]["spreads_apart"]
    assert not rows[3.0]["spreads_apart"]
    assert rows[2.0]["ratio_ttft_mean"] == pytest.approx(0.925 / 0.31)


def test_ablations_run_beside_and_against_their_parents() -> None:
    ablations = ABLATIONS
    groups = ablation_groups(ablations)
    assert [g for group in groups for g in group] == list(ablations)
    assert all(len(g) <= 2 for g in groups)
    assert ["vllm-noconn"] in groups and ["vllm-apc-noconn"] in groups  # parents differ

    def point(system: str, mean: float) -> dict[str, float | str]:
        return {"system": system, "rate_rps": 1.0, "ttft_mean_s": mean}

    points = [point("ragcache", 0.20), point("ragcache", 0.22), point("vllm", 0.50)]
    points += [point("vllm", 0.52), point("ragcache-lru", 0.40), point("ragcache-lru", 0.44)]
    points += [point("vllm-noconn", 2.0), point("vllm-noconn", 2.2)]
    rows = {r["system"]: r for r in compare_ablations(points)}
    assert set(rows) == {"ragcache-lru", "vllm-noconn"}  # the parents are not compared
    assert rows["ragcache-lru"]["against"] == "ragcache"
    assert rows["ragcache-lru"]["ratio_ttft_mean"] == pytest.approx(0.42 / 0.21)
    assert rows["vllm-noconn"]["against"] == "vllm" and rows["vllm-noconn"]["spreads_apart"]


def test_the_full_mode_runs_only_vllm_and_ragcache_on_noreuse_unless_named() -> None:
    full = MODES["full"]
    assert workload_systems(full, "noreuse", named=False) == ("vllm", "ragcache")
    assert workload_systems(full, "noreuse", named=True) == full.systems
    assert workload_systems(full, "long-shuffled", named=False) == full.systems


class _Recorder:
    """A served system that only records when requests start and end (isolates the replay
    logic of `run_point`; the real engines run in the smoke test below)."""

    name = "fake"
    start_s = 0.0

    def __init__(self) -> None:
        self.log: list[tuple[str, int, float]] = []
        self.in_flight = 0
        self.most_in_warmup = 0
        """The most requests in flight while a warm-up request was running."""
        self.sampling: dict[int, SamplingConfig | None] = {}
        """The sampling each request was served with (None: the system's)."""

    def use(self, source: object, top_k: int) -> None:
        pass

    async def serve(
        self, request: Request, request_id: str, sampling: SamplingConfig | None = None
    ) -> Outcome:
        index = int(request_id.rsplit("-", 1)[1])
        self.sampling[index] = sampling
        self.in_flight += 1
        if index < 10:
            self.most_in_warmup = max(self.most_in_warmup, self.in_flight)
        self.log.append(("start", index, time.perf_counter()))
        await asyncio.sleep(0.01)
        self.log.append(("end", index, time.perf_counter()))
        self.in_flight -= 1
        return Outcome(0.01, 0.01, (index,), 10, 0)

    async def reset(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def test_a_reordering_system_is_left_out_of_the_identical_answers() -> None:
    # ragcache-docorder sends other prompts (issue 40): its answers are checked against plain
    # vLLM on its own ordered prompts (tests/test_ragcache.py), not against the others'.
    def run(system: str, *tokens: int) -> PointRun:
        return PointRun(system, 1.0, (0.0,) * len(tokens), tuple(
            Outcome(0.01, 0.01, (t,), 10, 0) for t in tokens), 0)  # fmt: skip

    same = [run("vllm", 1, 2), run("ragcache", 1, 2)]
    assert identical_answers([*same, run("ragcache-docorder", 1, 9)]) == (2, 2)
    assert identical_answers([*same, run("ragcache-lru", 1, 9)]) == (1, 2)


def test_a_point_line_shows_the_machines_load_around_it() -> None:
    from ragcache_core.bench.sweep import load_note, machine_load

    assert machine_load() >= 0.0
    assert load_note({"load_avg_1m": [0.5, 3.25]}) == ", load 0.5->3.2"
    assert load_note({}) == ""  # a point recorded before the load was


def test_warm_up_runs_closed_loop_before_the_measured_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Warm-up requests go in order, `warmup_concurrency` at a time; the measured ones start
    only after the last warm-up request ended, at their arrival offsets from then. Checked
    by order and by the offsets `run_point` schedules (no wall-clock bound: a slow machine
    only delays a send, it never moves a schedule)."""
    import ragcache_core.bench.serve as serve_module

    scheduled: dict[int, tuple[float, float, float]] = {}
    """Each measured request's (scheduled offset, run start, when it was scheduled)."""
    at = serve_module._at

    async def spy(offset: float, start: float) -> None:
        scheduled[len(scheduled) + 10] = (offset, start, time.perf_counter())
        await at(offset, start)

    monkeypatch.setattr(serve_module, "_at", spy)
    system = _Recorder()
    requests = [Request(f"q{i}") for i in range(14)]
    arrivals = [0.05 * i for i in range(14)]
    run = asyncio.run(
        run_point(system, requests, arrivals, 20.0, 10, "t", warmup_concurrency=3)  # type: ignore[arg-type]
    )
    starts = [i for kind, i, _ in system.log if kind == "start"]
    assert starts[:10] == list(range(10)) and sorted(starts[10:]) == [10, 11, 12, 13]
    last_warm_end = max(n for n, (kind, i, _) in enumerate(system.log) if kind == "end" and i < 10)
    first_measured = min(
        n for n, (kind, i, _) in enumerate(system.log) if kind == "start" and i >= 10
    )
    assert first_measured > last_warm_end
    assert system.most_in_warmup == 3
    assert len(run.measured) == 4 and sorted(scheduled) == [10, 11, 12, 13]
    # One shift for the whole measured stream: the arrivals' gaps are kept exactly ...
    shifts = [scheduled[i][0] - arrivals[i] for i in range(10, 14)]
    assert max(shifts) - min(shifts) < 1e-9, shifts
    # ... and the first is due when the warm-up ended, no earlier and no later.
    offset, start, scheduled_at = scheduled[10]
    warm_end = max(t for kind, i, t in system.log if kind == "end" and i < 10)
    assert warm_end - start <= offset <= scheduled_at - start
    sent = {i: t for kind, i, t in system.log if kind == "start" and i >= 10}
    assert all(sent[i] >= start + scheduled[i][0] for i in sent)  # never sent early
    assert set(system.sampling.values()) == {None}  # the system's own sampling throughout


def test_the_warm_up_may_sample_apart() -> None:
    """`warmup_sampling` (the demo's: stopped at the first token) reaches the warm-up
    requests only; the measured ones keep the system's sampling."""
    system = _Recorder()
    requests = [Request(f"q{i}") for i in range(12)]
    first_token = SamplingConfig(max_tokens=1)
    asyncio.run(
        run_point(system, requests, [0.0] * 12, 20.0, 10, "t", warmup_concurrency=2,  # type: ignore[arg-type]
                  warmup_sampling=first_token)
    )  # fmt: skip
    assert [system.sampling[i] for i in range(12)] == [first_token] * 10 + [None, None]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=800,  # under pytest-timeout's 900 s, so a stuck run fails here, not there
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--systems", "nope"), "unknown system"),
        (("--workloads", "nope"), "unknown workload"),
        (("--requests", "0"), "--requests must be positive"),
        (("--model", "/no/such/model"), "does not exist"),
        (("--systems", "vllm,vllm-offload"), "vLLM refuses its native CPU offload here"),
        (("--systems", "vllm-offload-lazy"), "SimpleCPUOffloadConnector copies with CUDA"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(args: tuple[str, ...], message: str) -> None:
    """(`vllm-offload` and `vllm-offload-lazy` are refused this way only where no CUDA device
    is: on this machine.)"""
    result = _cli("--smoke", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


QUICK_SYSTEMS = ("vllm", "ragcache")


@dataclass(frozen=True)
class Terminated:
    """A `bench serve --smoke` stopped with SIGTERM once its engine started: its exit code,
    its stderr, and its engine processes still alive 30 s after it exited."""

    code: int
    stderr: str
    alive: tuple[int, ...]


def _terminated(model: Path, out: Path) -> Terminated:
    import psutil

    log = out / "stderr.txt"
    children: list[psutil.Process] = []
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "ragcache_core", "bench", "serve", "--smoke"),
                *("--systems", "vllm", "--model", str(model), "--out", str(out)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 300
        while "engine started" not in log.read_text() and time.monotonic() < deadline:
            if proc.poll() is not None:
                return Terminated(proc.returncode, log.read_text(), ())
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the engine runs in processes of its own"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        _, alive = psutil.wait_procs(children, timeout=30)
        return Terminated(code, log.read_text(), tuple(p.pid for p in alive))
    finally:
        for process in [proc, *children]:
            if isinstance(process, subprocess.Popen):
                if process.poll() is None:
                    process.kill()
            elif process.is_running():
                process.kill()


def runners(model: Path) -> dict[str, Callable[[Path], Any]]:
    """The engine runs of the tests below (`_runs`; each given its --out folder), by test
    name: the smoke and quick runs (`_cli`'s process and the folder) and the SIGTERM run, last
    of the module's: it ends while the longer smoke run still runs."""

    def cli(*args: str) -> Callable[[Path], tuple[subprocess.CompletedProcess[str], Path]]:
        return lambda out: (_cli(*args, "--model", str(model), "--out", str(out)), out)

    return {
        "test_smoke_serves_every_request_with_identical_answers": cli(
            *("--smoke", "--systems", ",".join(SYSTEMS), "--json")
        ),
        "test_quick_prints_a_calibrated_ladder_of_repeated_points": cli(
            *("--quick", "--systems", ",".join(QUICK_SYSTEMS)),
            *("--warmup", "2", "--requests", "3"),
        ),
        "test_sigterm_closes_the_engines_it_started": lambda out: _terminated(model, out),
    }


@pytest.mark.vllm
def test_smoke_serves_every_request_with_identical_answers(
    request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    result, tmp_path = engine_runs.result(request)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert document == json.loads((tmp_path / "serve.json").read_text())
    assert document["schema"] == "ragcache-bench-serve/2"
    assert {"git_commit", "model", "mode", "systems", "wall_s"} <= set(document["settings"])
    (workload,) = document["workloads"]
    assert {
        "name",
        "description",
        "retriever",
        "points",
        "answers",
        "sustained",
        "comparisons",
    } <= set(workload)
    mode = document["settings"]["mode"]
    assert sorted(p["system"] for p in workload["points"]) == sorted(SYSTEMS)
    for point in workload["points"]:
        assert point["requests"] == mode["requests"] == len(point["ttfts_s"])
        assert all(t > 0 for t in point["ttfts_s"])
        assert 0.0 <= point["token_hit_rate"] <= 1.0
        before, after = point["load_avg_1m"]  # the machine's load, around the point
        assert before >= 0 and after > 0  # the point itself ran on this machine
    hit_rates = {p["system"]: p["token_hit_rate"] for p in workload["points"]}
    # After the warm-up every prompt's system prompt (the root) is cached: the proxy (a
    # RAGCache) loads it; plain vLLM caches nothing.
    assert hit_rates["ragcache-offload-proxy-arc"] > 0, hit_rates
    assert hit_rates["vllm"] == 0, hit_rates
    proxy = next(p for p in workload["points"] if p["system"] == "ragcache-offload-proxy-arc")
    assert {"doc_hit_rate", "gpu_doc_hit_rate", "host_doc_hit_rate"} <= set(proxy)
    print(f"\nsmoke: token hit rates {hit_rates}, the proxy's docs hit {proxy['doc_hit_rate']}")
    (answers,) = workload["answers"]
    total = mode["warmup"] + mode["requests"]
    assert answers == {
        "rate_rps": answers["rate_rps"],
        "repeat": 0,
        "identical": total,
        "requests": total,
        "systems": 2,
    }
    for name in ("ttft_vs_rate.png", "ttft_cdf.png", "throughput_slo.png", "hit_rates.png"):
        assert (tmp_path / name).stat().st_size > 1000


@pytest.mark.vllm
def test_sigterm_closes_the_engines_it_started(
    request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    """SIGTERM (a job runner's stop, `kill`) ends a command as Ctrl-C does: its vLLM engine
    processes go with it (before, they outlived it, holding its output pipes and memory)."""
    run: Terminated = engine_runs.result(request)
    assert run.code == 143, run.stderr[-2000:]
    assert not run.alive, run.alive
    assert run.stderr.rstrip().endswith("terminated")


QUICK_ROW = re.compile(
    r"^  +(?P<rate>\d+\.\d\d) (?P<system>\S+)"
    r" +(?P<mean>\d+) \((?P<mean_lo>\d+)\.\.(?P<mean_hi>\d+)\)"
    r" +(?P<p95>\d+) \((?P<p95_lo>\d+)\.\.(?P<p95_hi>\d+)\) +(?P<tput>[\d.]+) +(?P<hit>\d+)%"
    r" +(?P<doc>\d+%|-)$",
    re.MULTILINE,
)
"""One row of the printed rate table: rate, system, TTFT mean and p95 (median (min..max) of
the repeats, ms), req/s, token and document hit rates."""


@pytest.mark.vllm
def test_quick_prints_a_calibrated_ladder_of_repeated_points(
    request: pytest.FixtureRequest, tiny_model: Path, engine_runs: EngineRuns
) -> None:
    """`ragcache bench serve --quick` as documented, its printed tables (not --json), on the
    tiny model and cut to 2 + 3 requests per point for the suite: the light load calibrates
    the first rate (1.0 / vllm's light-load service time), the ladder doubles it, each point
    runs twice and prints its min..max, RAGCache hits (plain vLLM does not), answers agree."""
    systems = QUICK_SYSTEMS
    result, tmp_path = engine_runs.result(request)
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "serve.json").read_text())
    mode = document["settings"]["mode"]
    assert (mode["name"], mode["repeats"], mode["max_points"], mode["light"]) == ("quick", 2, 2, 3)
    (workload,) = document["workloads"]
    light = workload["light_load"]
    rate0 = round(mode["start_fraction"] / light["vllm"]["service_s"], 2)
    assert workload["rates_rps"] == [rate0, round(rate0 * mode["factor"], 3)], workload
    stdout = result.stdout
    assert stdout.startswith(f"model {tiny_model}, commit ") and ", mode quick\n" in stdout
    for name in systems:
        line = re.search(
            rf"^  light load {name} +TTFT p95 +(\d+) ms, service +(\d+) ms", stdout, re.M
        )
        assert line is not None, stdout
        assert int(line.group(2)) == round(light[name]["service_s"] * 1000), (line[0], light)
    rows = {(float(m["rate"]), m["system"]): m for m in QUICK_ROW.finditer(stdout)}
    assert set(rows) == {(r, s) for r in workload["rates_rps"] for s in systems}, stdout
    for (rate, system), row in rows.items():
        means = [
            p["ttft_mean_s"]
            for p in workload["points"]
            if (p["rate_rps"], p["system"]) == (rate, system)
        ]
        assert len(means) == mode["repeats"], means  # each point ran twice ...
        lo, hi = round(min(means) * 1000), round(max(means) * 1000)
        assert (int(row["mean_lo"]), int(row["mean_hi"])) == (lo, hi), row[0]  # ... spread shown
        assert lo <= int(row["mean"]) <= hi and int(row["p95_lo"]) <= int(row["p95_hi"]), row[0]
        if system == "ragcache":
            assert int(row["hit"]) > 0 and row["doc"] != "-", row[0]
            assert all(
                {"doc_hit_rate", "gpu_doc_hit_rate", "host_doc_hit_rate"} <= set(p)
                for p in workload["points"]
                if p["system"] == system
            ), row[0]
        else:
            assert int(row["hit"]) == 0 and row["doc"] == "-", row[0]
    total = mode["warmup"] + mode["requests"]
    identical = re.findall(r"^  answers identical at ([\d.]+)/s #(\d): (\d+)/(\d+)$", stdout, re.M)
    assert len(identical) == len(workload["rates_rps"]) * mode["repeats"], stdout
    assert all(same == n == str(total) for _, _, same, n in identical), identical
    for name in systems:
        assert re.search(rf"^  highest rate within the SLO  {name} ", stdout, re.M), stdout
    assert all(Path(p).stat().st_size > 1000 for p in document["settings"]["plots"])
