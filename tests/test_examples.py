"""The quickstart scripts and notebooks and the chat scripts run end to end and show the repeated
question's documents served from the cache; quietly: vLLM's own lines go to the log file they
name, Faiss has enough points per IVF list, and nothing is printed at exit. Their default model
is the real SmolLM2-135M-Instruct; the suite runs them on the tiny model for speed
(`RAGCACHE_EXAMPLE_MODEL=tiny`, two questions or two two-turn conversations), except the
LlamaIndex quickstart script (`REAL`), which runs as a newcomer runs it, on the real model, and
must answer its questions right (`GOLD`), the same answer again from the cache. The
notebooks run with the command `examples/README.md` gives (`jupyter execute`). The two
quickstart scripts are the README's quickstarts, as written: a fast test checks that the
README's blocks are those files, so the run of the file is the run of the README's snippet.

The runs are separate processes with nothing shared but the built model, so they start with the
suite's other engine runs (`_runs`), two at a time (most of a run is starting Python, vLLM and
its engine processes, which use one core each), and each test checks its own run's outcome."""

from __future__ import annotations

import ast
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
from _runs import EngineRuns

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
QUICK = {"RAGCACHE_EXAMPLE_MODEL": "tiny", "RAGCACHE_EXAMPLE_QUESTIONS": "2"}
REAL = "llama_index_quickstart"
"""The one example run on the real model (its default: no override)."""
GOLD = {"who wrote a doll's house": "Ibsen", "what is the capital of slovakia": "Bratislava"}
"""The quickstart's questions and a word of their answers in the shipped sample."""
NAMES = ["llama_index_quickstart", "langchain_quickstart"]
CHATS = ["llama_index_chat", "langchain_chat"]
# On the terminal (or in a cell) these mean vLLM's lines, Faiss's warning or a noisy exit.
NOISE = (
    "(EngineCore",
    "(Worker",
    "(MainProcess",
    "Loading safetensors",
    "clustering",
    "Traceback",
    "Exception ignored",
    "resource_tracker",
    "DeprecationWarning",
)


def _env(log: Path, *, real: bool = False) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "RAGCACHE_VLLM_LOG": str(log)}
    if real:
        env.pop("RAGCACHE_EXAMPLE_MODEL", None)
        return env
    return {**env, **QUICK}


def _assert_quiet(output: str, log: Path) -> None:
    for noise in NOISE:
        assert noise not in output, f"{noise!r} in the output:\n{output[-3000:]}"
    assert f"vLLM's log: {log}" in output
    assert "Initializing a V1 LLM engine" in log.read_text()  # vLLM's lines went there


@dataclass(frozen=True)
class Run:
    """One example's finished process and where it ran."""

    done: subprocess.CompletedProcess[str]
    log: Path
    folder: Path


def _script(name: str, folder: Path) -> Run:
    log = folder / "vllm.log"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        capture_output=True,
        text=True,
        env=_env(log, real=name == REAL),
        cwd=REPO,
        timeout=600,
    )
    return Run(done, log, folder)


def _notebook(name: str, folder: Path) -> Run:
    copy = folder / f"{name}.ipynb"  # run beside a copy: --output writes next to its input
    shutil.copy(EXAMPLES / f"{name}.ipynb", copy)
    log = folder / "vllm.log"
    done = subprocess.run(
        [
            str(Path(sys.executable).with_name("jupyter")),
            *("execute", "--timeout=300", "--output={notebook_name}-out", str(copy)),
        ],
        capture_output=True,
        text=True,
        env=_env(log),
        cwd=REPO,
        timeout=800,
    )
    return Run(done, log, folder)


def runners(model: Path) -> dict[str, Callable[[Path], Run]]:
    """Each test's example run, by test name (`_runs`: they start with the suite's other
    engine runs, two at a time)."""
    scripts = {f"test_example_script[{name}]": partial(_script, name) for name in NAMES + CHATS}
    notebooks = {f"test_example_notebook[{name}]": partial(_notebook, name) for name in NAMES}
    return scripts | notebooks


def _hits(name: str, stdout: str) -> list[tuple[int, int]]:
    """Each request's documents hit (GPU, host), in order, from what the example printed."""
    if name == "llama_index_quickstart":  # each response's metadata["cache_hits"]
        found = re.findall(r"'gpu_docs': (\d+), 'host_docs': (\d+)", stdout)
        return [(int(g), int(h)) for g, h in found]
    if name == "langchain_quickstart":  # cache.stats() after each call: hits since start
        found = re.findall(r"'docs_hit_gpu': (\d+), 'docs_hit_host': (\d+)", stdout)
        totals = [(0, 0)] + [(int(g), int(h)) for g, h in found]
        return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(totals)]
    found = re.findall(r"cache hits: (\d+) GPU \+ (\d+) host", stdout)
    return [(int(g), int(h)) for g, h in found]


def _answers(stdout: str) -> dict[str, list[str]]:
    """The quickstart's answers by question, from its lines `'question': 'answer' {hits}`."""
    found: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        for question in GOLD:
            head = f"{question!r}: "
            if line.startswith(head):
                answer = ast.literal_eval(line[len(head) : line.rindex(" {")])
                found.setdefault(question, []).append(answer)
    return found


def _readme_blocks() -> dict[str, str]:
    """The README's quickstart blocks, by the example file each names in its marker."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    pattern = r"<!-- quickstart: examples/(\w+)\.py -->\n```python\n(.*?)\n```"
    return {name: block for name, block in re.findall(pattern, text, flags=re.DOTALL)}


def _after_docstring(path: Path) -> str:
    source = path.read_text(encoding="utf-8")
    end = ast.parse(source).body[0].end_lineno
    assert end is not None
    return "\n".join(source.splitlines()[end:]).strip("\n")


def test_readme_quickstarts_are_the_quickstart_scripts() -> None:
    """The README's two quickstarts are the two quickstart files below their docstring, so
    test_example_script's run of each file runs the README's snippet as written."""
    blocks = _readme_blocks()
    assert sorted(blocks) == sorted(NAMES)
    for name, block in blocks.items():
        assert block == _after_docstring(EXAMPLES / f"{name}.py"), name
        changed = [
            line for line in block.splitlines() if "<- the one line RAGCache changes" in line
        ]
        assert len(changed) == 1, name  # the one changed line is marked


@pytest.mark.vllm
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.real_model) if n == REAL else n for n in NAMES + CHATS],
)
def test_example_script(name: str, request: pytest.FixtureRequest, engine_runs: EngineRuns) -> None:
    run: Run = engine_runs.result(request)
    done, log = run.done, run.log
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_quiet(done.stdout + done.stderr, log)
    hits = _hits(name, done.stdout)
    assert len(hits) >= 3  # two questions (or turns) and the repeat
    assert hits[0] == (0, 0)  # cold
    # The repeat of question 1 (or conversation 1) hits both documents: the first in vLLM's
    # prefix cache (the GPU tier), the second up to the block it shares with the question,
    # whose tail comes from the host tier.
    gpu, host = hits[2]
    assert gpu + host == 2 and gpu >= 1, hits
    if name == REAL:  # the real model answers right, and the same from the cache
        print(done.stdout)
        answers = _answers(done.stdout)
        assert sorted(answers) == sorted(GOLD), done.stdout
        for question, (first, repeat) in answers.items():
            assert GOLD[question] in first, (question, first)
            assert repeat == first
    if name in CHATS:
        assert "prompt tokens saved" in done.stdout
        # Turn 2 carries turn 1, and conversation 2 starts afresh.
        history = [line for line in done.stdout.splitlines() if "history of " in line]
        assert [("history of 2 messages" in line) for line in history] == [False, True] * 2


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
def test_example_notebook(
    name: str, request: pytest.FixtureRequest, engine_runs: EngineRuns
) -> None:
    import nbformat

    run: Run = engine_runs.result(request)
    done, log, tmp_path = run.done, run.log, run.folder
    assert done.returncode == 0, done.stderr[-3000:]
    notebook = nbformat.read(tmp_path / f"{name}-out.ipynb", as_version=4)
    text = "\n".join(
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    found = re.findall(
        r"'gpu_docs': (\d+), 'host_docs': (\d+)|GPU hits (\d+), host hits (\d+)", text
    )
    repeated = [int(a or c) + int(b or d) for a, b, c, d in found]
    assert 2 in repeated, found  # the repeated question hit both documents
    _assert_quiet(text, log)
