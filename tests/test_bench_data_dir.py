"""Where the benchmark data comes from: `--data-dir` over `$RAGCACHE_DATA_DIR` over
`../shared/data`, and a missing file is one clear error naming the flag and the variable, in the
library, the commands and the scripts (no engine, no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragcache_core.bench.data_dir import (
    DATA_DIR_ENV,
    DATA_FILES,
    DEFAULT_DATA_DIR,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    require_data,
    resolve_data_dir,
)
from ragcache_core.bench.workloads import load_workload, workload_files
from ragcache_core.cli import main as cli_main
from ragcache_core.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def _words(text: str) -> int:
    return len(text.split())


def _squad(folder: Path) -> Path:
    """A two-paragraph, one-question SQuAD layout: what the `long` workloads read."""
    folder.mkdir(parents=True, exist_ok=True)
    paragraphs = [
        {"paragraph_id": f"p{i}", "title": "T", "paragraph_index": i, "context": f"text {i}"}
        for i in range(2)
    ]
    lines = "".join(json.dumps(p) + "\n" for p in paragraphs)
    (folder / SQUAD_PARAGRAPHS).write_text(lines, encoding="utf-8")
    question = {"id": "q0", "title": "T", "paragraph_id": "p1", "question": "what is 1?"}
    (folder / SQUAD_QUESTIONS).write_text(json.dumps(question) + "\n", encoding="utf-8")
    return folder


def test_the_flag_wins_over_the_variable_which_wins_over_the_default(tmp_path: Path) -> None:
    flag, env = tmp_path / "flag", tmp_path / "env"
    assert resolve_data_dir(flag, {DATA_DIR_ENV: str(env)}) == flag
    assert resolve_data_dir(str(flag), {}) == flag
    assert resolve_data_dir(None, {DATA_DIR_ENV: str(env)}) == env
    assert resolve_data_dir(None, {}) == DEFAULT_DATA_DIR
    assert resolve_data_dir(None, {DATA_DIR_ENV: ""}) == DEFAULT_DATA_DIR  # set but empty
    assert REPO.parent / "shared" / "data" == DEFAULT_DATA_DIR  # today's folder


def test_the_variable_is_read_at_call_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert resolve_data_dir() == tmp_path
    monkeypatch.delenv(DATA_DIR_ENV)
    assert resolve_data_dir() == DEFAULT_DATA_DIR


def test_a_missing_folder_or_file_names_the_flag_and_the_variable(tmp_path: Path) -> None:
    with pytest.raises(InputError) as absent:
        require_data(tmp_path / "nowhere")
    message = str(absent.value)
    assert "nowhere is absent" in message
    assert "--data-dir" in message and DATA_DIR_ENV in message and "docs/benchmarks.md" in message
    squad = _squad(tmp_path / "squad")
    assert require_data(squad, (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS)) == squad
    with pytest.raises(InputError, match=r"lacks vital_articles_en_corpus\.jsonl, NQ-open"):
        require_data(squad)  # every file of DATA_FILES
    assert len(DATA_FILES) == 5


def test_load_workload_reads_the_folder_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    squad = _squad(tmp_path / "squad")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "nowhere"))
    workload = load_workload("long", _words, data_dir=squad)  # the argument over the variable
    assert [d.id for d in workload.documents] == ["T::0"]  # both paragraphs, one chunk
    assert [r.question for r in workload.requests] == ["what is 1?"]
    with pytest.raises(InputError, match=f"nowhere is absent.*{DATA_DIR_ENV}"):
        load_workload("long", _words)  # None: the variable
    monkeypatch.setenv(DATA_DIR_ENV, str(squad))
    assert load_workload("long-shuffled-host25", _words).host_share == 0.25
    with pytest.raises(InputError, match=r"lacks vital_articles_en_corpus\.jsonl"):
        load_workload("short", _words)  # `short` needs the other files too
    assert load_workload("demo", _words, data_dir=tmp_path / "nowhere").documents  # shipped


def test_workload_files() -> None:
    assert workload_files("demo") == workload_files("demo-short") == ()
    assert workload_files("noreuse") == (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS)
    assert set(workload_files("short-host50")) == set(DATA_FILES) - {SQUAD_QUESTIONS}


def test_bench_serve_refuses_a_missing_folder_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    code = cli_main(
        ["bench", "serve", "--smoke", "--workloads", "long", "--data-dir", str(missing)]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert f"benchmark data folder {missing} is absent" in err and "--data-dir" in err


def test_simulate_replay_takes_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"settings": {"seed": 0, "model": "m", "mode": {}}, "workloads": [{"name": "long"}]}
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(run), encoding="utf-8")
    missing = tmp_path / "nowhere"
    code = cli_main(["simulate", "--replay", str(path), "--data-dir", str(missing)])
    assert code == 2
    assert f"benchmark data folder {missing} is absent" in capsys.readouterr().err


def test_a_script_with_no_data_exits_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    script = str(REPO / "scripts" / "build_long_docs.py")
    done = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path), "--data-dir", str(missing)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"build_long_docs.py: error: benchmark data folder {missing} is absent: give the folder "
        f"with --data-dir DIR or {DATA_DIR_ENV}=DIR (its files and their public sources: "
        'docs/benchmarks.md, "Benchmark data")'
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), DATA_DIR_ENV: str(_squad(tmp_path / "sq"))}
    out = tmp_path / "out"
    built = subprocess.run(
        [sys.executable, script, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr
    assert "1 documents, 1 questions" in built.stdout  # the variable's folder was read
