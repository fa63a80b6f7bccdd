"""Command-line errors the user can fix: one line, exit code 2, no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ragcache_core", *args], capture_output=True, text=True, timeout=120
    )


def test_doctor_missing_model() -> None:
    result = _run("doctor", "--model", "/no/such/path")
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_doctor_model_without_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = _run("doctor", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "no tokenizer" in result.stderr
    assert "Traceback" not in result.stderr


def _readme_commands() -> dict[str, set[str]]:
    """The README's "Command line" block: each command -> the actions it names
    (`ragcache bench overhead | prefill | copies` -> bench: {overhead, prefill, copies})."""
    block = README.read_text(encoding="utf-8").split("## Command line", 1)[1].split("```")[1]
    commands: dict[str, set[str]] = {}
    for line in block.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "ragcache":
            continue
        actions = commands.setdefault(words[1], set())
        rest = words[2:]
        while rest and rest[0][0].isalpha():
            actions.add(rest[0])
            if len(rest) > 1 and rest[1] == "|":
                rest = rest[2:]
            else:
                break
    return commands


def _listed(help_text: str) -> set[str]:
    """The sub-commands an argparse help lists (one per line, indented by four spaces)."""
    return set(re.findall(r"^    (\S+)", help_text, re.MULTILINE))


def test_help_lists_every_documented_command() -> None:
    """`ragcache --help` lists exactly the README's commands, and each command's help the
    actions the README names (bench serve, bench copies, model build, ...)."""
    documented = _readme_commands()
    assert {"demo", "doctor", "bench", "model", "serve"} <= set(documented)
    assert documented["bench"] >= {"serve", "overhead", "prefill", "copies"}
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert _listed(result.stdout) == set(documented)
    for command, actions in documented.items():
        if actions:
            sub = _run(command, "--help")
            assert sub.returncode == 0, sub.stderr
            assert actions <= _listed(sub.stdout), (command, sub.stdout)


def test_index_without_the_text_field_names_the_flag(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "body": "some text"}\n', encoding="utf-8")
    result = _run("index", "--corpus", str(corpus), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert "no text field (looked for text; the record has id, body)" in result.stderr
    assert "set --text-field" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("systems", "message"),
    [("vllm,nope", "unknown system(s) ['nope']"), ("ragcache,vllm-offload", "needs a CUDA vLLM")],
)
def test_demo_refuses_an_unknown_or_cuda_only_system_in_one_line(
    systems: str, message: str
) -> None:
    result = _run("demo", "--systems", systems)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_demo_takes_any_system_of_bench_serve_that_runs_here() -> None:
    """`--systems ragcache,ragcache-writethrough`: a user sees both host-write modes on their
    own stream (the systems are `bench serve`'s)."""
    from ragcache_core.cli import build_parser
    from ragcache_core.cli.demo import _check

    args = build_parser().parse_args(["demo", "--systems", "ragcache,ragcache-writethrough"])
    assert _check(args) == ["ragcache", "ragcache-writethrough"]


def test_demo_runs_the_four_systems_unless_told_otherwise() -> None:
    """The suite's demo run names three of them (`test_demo.SYSTEMS`): the default stays all four
    of the README's table."""
    from ragcache_core.cli import build_parser
    from ragcache_core.cli.demo import DEMO_SYSTEMS, _check

    assert DEMO_SYSTEMS == ("vllm", "vllm-apc", "vllm-apc-total", "ragcache")
    assert _check(build_parser().parse_args(["demo"])) == list(DEMO_SYSTEMS)
