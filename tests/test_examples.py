"""The quickstart scripts and notebooks run end to end (tiny model, two questions) and show the
repeated question's documents served from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
QUICK = {"RAGCACHE_EXAMPLE_MODEL_SIZE": "tiny", "RAGCACHE_EXAMPLE_QUESTIONS": "2"}
NAMES = ["llama_index_quickstart", "langchain_quickstart"]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, **QUICK, "PYTHONPATH": path}


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_example_script(name: str, tiny_model: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    hit_lines = [line for line in done.stdout.splitlines() if "cache hits:" in line]
    assert len(hit_lines) >= 3  # two questions and the repeat
    assert "cache hits: 0 GPU" in hit_lines[0]  # cold
    assert "cache hits: 2 GPU" in hit_lines[2]  # the repeat of question 1
    assert "prompt tokens saved" in done.stdout


def test_notebook_kernel_is_this_python() -> None:
    """nbclient's "python3" kernel must run this environment's interpreter."""
    from jupyter_client.kernelspec import get_kernel_spec
    from jupyter_client.manager import KernelManager

    spec = get_kernel_spec("python3")
    command = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert spec.language == "python"
    assert Path(command[0]).resolve() == Path(sys.executable).resolve()


@pytest.mark.vllm
@pytest.mark.parametrize("name", NAMES)
def test_example_notebook(name: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nbformat
    from nbclient import NotebookClient

    for key, value in _env().items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    ).execute()
    text = "\n".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert "'gpu_docs': 2" in text or "GPU hits 2" in text  # the repeated question hit
