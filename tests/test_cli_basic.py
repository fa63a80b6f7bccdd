"""Command-line errors the user can fix: one line, exit code 2, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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


def test_help_lists_commands() -> None:
    result = _run("--help")
    assert result.returncode == 0
    assert "doctor" in result.stdout
