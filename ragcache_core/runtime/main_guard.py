"""The `if __name__ == "__main__":` check, before an engine starts.

vLLM starts its engine core (and that starts its worker) with multiprocessing's *spawn*
method on CPUs, and wherever CUDA is already initialized. A spawned process imports the
parent's script again (as `__mp_main__`) before it runs anything, so a script that creates a
`RAGCache` at top level, unguarded, creates one again in every engine process. Python then
stops it in its "bootstrapping phase" error and vLLM reports "Engine core initialization
failed": two tracebacks, neither naming the fix. `check_main_guard` finds that case in the
parent, before anything starts, and raises one `MainGuardError` that names the line and the fix.

How: the frame running the script's top-level code (`<module>` of `__main__.__file__`) is on
the caller's stack; the line it is at must lie in the body of an `if __name__ == "__main__":`.
No script (a notebook, the REPL, `python -c`), one spawn does not import again (a package's
`__main__.py`, as in `python -m ragcache_core`), or no such frame (another thread): nothing to
check.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from ragcache_core.errors import MainGuardError

__all__ = ["check_main_guard", "unguarded_main_line", "vllm_spawns"]


def vllm_spawns(device: Any) -> bool:
    """Whether vLLM will spawn (not fork) its engine processes for `device` (a `DeviceInfo`):
    always on CPU, when asked for, and on CUDA once CUDA is initialized in this process (which
    RAGCache's device detection does)."""
    if getattr(device, "kind", "cpu") == "cpu":
        return True
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
        return True
    import torch

    return bool(torch.cuda.is_initialized())


def check_main_guard(what: str, *, spawns: bool = True) -> None:
    """Raise `MainGuardError` when the running script's top-level code, outside
    `if __name__ == "__main__":`, is what creates `what` (and vLLM will spawn)."""
    if not spawns:
        return
    found = unguarded_main_line(sys._getframe(1))
    if found is None:
        return
    path, line = found
    raise MainGuardError(
        f"{what} starts vLLM, whose engine processes import this script again: line {line} of "
        f"{path} runs at import time, so every engine process would start another engine. "
        f'Put the script\'s code under   if __name__ == "__main__":   (as in the examples)'
    )


def unguarded_main_line(frame: FrameType | None) -> tuple[str, int] | None:
    """(script path, line) when `frame`'s stack holds the script's top-level code at a line
    outside `if __name__ == "__main__":`; None otherwise (guarded, or no script)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str) or not _imported_again(main, path):
        return None
    while frame is not None:
        code = frame.f_code
        if code.co_name == "<module>" and frame.f_globals is vars(main):
            break
        frame = frame.f_back
    if frame is None or not _same_file(frame.f_code.co_filename, path):
        return None
    line = frame.f_lineno
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    return None if any(_within(guard, line) for guard in _guards(tree)) else (path, line)


def _imported_again(main: Any, path: str) -> bool:
    """Whether a spawned process imports `main` again, as multiprocessing's spawn decides
    (`multiprocessing.spawn`): by module name unless it is a package's `__main__`
    (`python -m package`), else by path unless it is IPython's."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return not (name == "__main__" or name.endswith(".__main__"))
    return os.path.splitext(os.path.basename(path))[0] != "ipython"


def _guards(tree: ast.Module) -> list[ast.If]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.If) and _is_guard(node.test)]


def _is_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either side)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    texts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and texts == ["__main__"]


def _within(guard: ast.If, line: int) -> bool:
    first, last = guard.body[0], guard.body[-1]
    return first.lineno <= line <= (last.end_lineno or last.lineno)


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)
